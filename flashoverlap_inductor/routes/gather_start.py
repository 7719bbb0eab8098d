"""When an all_gather peer call's GEMMs start, shared by the gather route (``routes/gather_peer.py``) and the pull
route (``routes/scatter_pull.py``), whose calls run the same protocol (``csrc/gather_call.cu``): the
``fo_gather_args.options`` bits, the push schedule's receive slot sets and buffer size, and the choice of start
per call (``resolve_start``) from ``Tuning.gather_start``.

Invariants: a push call needs ``SLOT_SETS x world x shard`` bytes of receive buffer per rank (``push_bytes``); any
other start one shard. The choice reads the world size, the shard's bytes and the settings only, so it is the same
on every rank of a group.
"""

from __future__ import annotations

from flashoverlap_inductor import config

SLOT_SETS = 2  # FO_GATHER_SLOT_SETS: the push schedule's receive slot sets
GEMM_AFTER_HANDSHAKE = 1  # fo_gather_args.options bit FO_GATHER_GEMM_AFTER_HANDSHAKE (Tuning.gather_start)
PUSH = 2  # fo_gather_args.options bit FO_GATHER_PUSH (gather_start="push")
COPY_NOTIFY = 4  # options bit FO_GATHER_COPY_NOTIFY (push on 3+ ranks under the experiment gather_copy_notify)
COPY_NOTIFY_EXPERIMENT = "gather_copy_notify"
COPY_NOTIFY_MIN_WORLD = 3  # kCopyNotifyMinWorld of csrc/gather_call.cu: the bit acts from this many ranks on
OPTIONS = {"handshake": GEMM_AFTER_HANDSHAKE, "eager": 0, "push": PUSH}  # a resolved gather_start -> options
# gather_start="auto": push on at most this many ranks (4 H200s, peers told after the last push: 1.03x over
# sequential against the handshake's 1.41x; docs/design.md)
PUSH_AUTO_MAX_WORLD = 2


def push_bytes(world: int, shard_bytes: int) -> int:
    """A push call's receive buffer per rank, bytes: ``SLOT_SETS`` sets of ``world`` shards (the all_gather route's
    push start and the pull route's push schedule alike)."""
    return SLOT_SETS * world * shard_bytes


def push_fits(settings: config.Settings, world: int, shard_bytes: int) -> bool:
    """Whether a push call's receive buffer (``push_bytes``) fits ``gather_push_max_mb``."""
    return push_bytes(world, shard_bytes) <= settings.tuning.gather_push_max_mb << 20


def resolve_start(settings: config.Settings, world: int, shard_bytes: int, desc: str) -> tuple[int, int, str]:
    """A call's ``fo_gather_args.options``, workspace bytes per rank (push: ``SLOT_SETS`` x world shards, else one)
    and ``desc`` with why where the start is not the one set. "auto": push on at most ``PUSH_AUTO_MAX_WORLD`` ranks;
    a push whose buffer would pass ``gather_push_max_mb``: handshake; ``COPY_NOTIFY`` for a push of
    ``COPY_NOTIFY_MIN_WORLD``+ ranks under its experiment. World, shapes and settings only: alike on every rank."""
    tuning = settings.tuning
    start, buffer_bytes = tuning.gather_start, push_bytes(world, shard_bytes)
    if start == "auto" and world > PUSH_AUTO_MAX_WORLD:
        return OPTIONS["handshake"], shard_bytes, \
            f"{desc}; handshake start (auto: push only on up to {PUSH_AUTO_MAX_WORLD} ranks)"
    if start != "push" and start != "auto":
        return OPTIONS[start], shard_bytes, desc
    if not push_fits(settings, world, shard_bytes):
        why = f"the push's receive buffer would pass gather_push_max_mb={tuning.gather_push_max_mb}"
        return OPTIONS["handshake"], shard_bytes, f"{desc}; handshake start ({why})"
    if world >= COPY_NOTIFY_MIN_WORLD and COPY_NOTIFY_EXPERIMENT in settings.experiments:
        return PUSH | COPY_NOTIFY, buffer_bytes, \
            f"{desc}; each peer told by copy engine after its push (experiment {COPY_NOTIFY_EXPERIMENT})"
    return PUSH, buffer_bytes, desc
