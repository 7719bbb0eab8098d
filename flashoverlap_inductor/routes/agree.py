"""Ranks agree or fail clearly: what decides which collectives a fused call issues is compared across the group.

Before the first run of a call shape (a dispatcher memo entry), outside CUDA-graph captures, every rank of the group
exchanges one digest per item below (an ``all_gather`` of int64 hashes, on the device the group's backend
communicates from) and compares. A difference raises ``errors.RankMismatch`` on every rank, naming the items and
the ranks that differ, before any route makes its launch or issues a collective, so ranks that disagree never pair
unlike collectives (a hang or garbage). Everything a route decides afterwards (``make_launch``) is a function of
these items, so agreeing on them is agreeing on the route, the plan, the kernel and the steps.

``check_graph``: the same for a compiled graph, on its first run (the backend installs it): its ranks exchange a
digest of the collectives it will issue over each group (``passes.manifest``); a difference raises
``errors.RankMismatch`` on every rank naming the first collective that differs and what each rank has, before any of
the graph's collectives runs. Cost: one small all_gather per group on the first run (plus one ``all_gather_object``
of the manifests when they differ); nothing afterwards.

Items: the call (collective, N, K, dtype, B's layout, plan string, world size; the rows too except for
all_to_all, whose rows and split sizes are per rank by design), the settings that decide (every field but the
library's and the data folder's paths), the candidate routes (which include whether the kernel library loaded and
why a route declined), the library's identity (ABI and compiled configurations), the cost-model data (a digest of
the data folder's files) and the GPU model. Cost: one small collective and one host sync per call shape per group.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from flashoverlap_inductor import config, errors
from flashoverlap_inductor.native import kernels

from .. import _inductor_compat as compat
from ..schedule import steps
from .base import Call, Route

ITEMS = ("call", "rows", "settings", "routes", "library", "data", "gpu")


def items(call: Call, settings: config.Settings, routes: Sequence[Route], gpu: str) -> dict[str, str]:
    """The decision's items as strings (equal strings: equal decisions)."""
    a2a = call.collective == "all_to_all"
    if a2a:  # rows, splits and the plan string (which holds the rows) are per rank; the group count is not
        groups = len(steps.schedule_steps(call.collective, call.plan, call.rows, call.n, call.k, call.dtype_name,
                                          call.world, call.rank, call.send_rows, call.recv_rows,
                                          settings.all_to_all_default_groups))
        rows = f"per rank, {groups} groups"
    else:
        rows = str(call.rows)
    kernel_routes = call.device == "cuda"
    return {
        "call": repr((call.collective, call.n, call.k, str(call.dtype), call.b_layout, None if a2a else call.plan,
                      call.world, call.device, None if a2a else call.operand_issue)),
        "rows": rows,
        "settings": shared_settings_key(settings),
        "routes": ",".join(r.name for r in routes),
        "library": library_identity(str(kernels.library_path())) if kernel_routes else "-",
        "data": data_digest(settings.config_dir),
        "gpu": gpu,
    }


@functools.lru_cache(maxsize=64)
def shared_settings_key(settings: config.Settings) -> str:
    """The key of what of ``settings`` the ranks must share: all but the library path and the data folder (whose
    contents are compared as ``library`` and ``data``). Memoized: a fused MoE call asks it per call (~35 us)."""
    return settings.replace(library=None, config_dir=None).key()


@functools.lru_cache(maxsize=8)
def library_identity(path: str) -> str:
    """ABI and compiled configurations of the library at ``path`` ("unavailable" when it does not load)."""
    if not kernels.available():
        return "unavailable"
    return f"abi {kernels.ABI_VERSION}: " + ",".join(sorted(f"{c.name}{c.variants}" for c in kernels.configs()))


@functools.lru_cache(maxsize=8)
def data_digest(config_dir: str | None) -> str:
    """A digest of the cost-model data folder's JSON files (names and contents)."""
    root = Path(config_dir) if config_dir else Path(__file__).resolve().parent.parent / "configs"
    h = hashlib.sha1()
    for path in sorted(root.glob("*.json")) + sorted(root.glob("plans/*.json")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def exchange_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's backend communicates from: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# (id(group), agreement items) the ranks agreed on: a call that differs from an agreed one only in what the items leave
# out (a node-local library or data path) must not exchange again, since its peers, whose call is agreed, will not
# (they would pair the exchange with their real collective)
_agreed: set[tuple] = set()


def check_once(found: dict[str, str], group: dist.ProcessGroup, what: str) -> None:
    """``check`` unless ``group``'s ranks already agreed on these items (then nothing: no collective)."""
    mark = (id(group), tuple(sorted(found.items())))
    if mark not in _agreed:
        check(found, group, what)
        _agreed.add(mark)


def forget() -> None:
    """Forget every agreement (``routes.reset``)."""
    _agreed.clear()


def check(found: dict[str, str], group: dist.ProcessGroup, what: str) -> None:
    """Exchange ``found``'s digests over ``group`` (collective); raise ``errors.RankMismatch`` on every rank if any
    item differs. ``what`` names the call in the message."""
    world = group.size()
    if world == 1:
        return
    mine = torch.tensor([_hash(found[name]) for name in ITEMS], dtype=torch.int64, device=exchange_device(group))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()
    differ = [name for i, name in enumerate(ITEMS) if bool((table[:, i] != table[0, i]).any())]
    if not differ:
        return
    rank = group.rank()
    parts = []
    for name in differ:
        col = table[:, ITEMS.index(name)]
        same = [r for r in range(world) if col[r] == col[rank]]
        parts.append(f"{name} (this rank has {found[name]!r}; ranks {same} agree with it, the others differ)")
    raise errors.RankMismatch(f"flashoverlap: the ranks of group {getattr(group, 'group_name', '?')} disagree on "
                              f"{what}: " + "; ".join(parts) + ". Every rank must run the same program with the same "
                              "settings, library and data files.")


def check_graph(manifest: list[tuple[str, str]], kind: str) -> float:
    """Agree on ``manifest`` (``[(group_name, entry)]``, the collectives of a compiled ``kind`` graph in order) with
    the other ranks of each group it uses, groups in name order (exchanged on the current CUDA device for NCCL: the
    caller makes it the graph's); raise ``errors.RankMismatch`` on every rank of a
    group whose ranks differ. Returns the milliseconds it took (host clock)."""
    import time

    start = time.perf_counter()
    groups: dict[str, list[str]] = {}
    for name, entry in manifest:
        groups.setdefault(name, []).append(entry)
    for name, entries in sorted(groups.items()):  # one order on every rank, whatever their manifests hold
        group = compat.resolve_group(name)
        if group.size() == 1:
            continue
        digest = _hash("\n".join(entries))
        mine = torch.tensor([digest, len(entries)], dtype=torch.int64, device=exchange_device(group))
        every = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(every, mine, group=group)
        if all(bool((t == every[0]).all()) for t in every):
            continue
        theirs: list = [None] * group.size()
        dist.all_gather_object(theirs, entries, group=group)
        raise errors.RankMismatch(_first_difference(theirs, group.rank(), name, kind))
    return (time.perf_counter() - start) * 1e3


def _first_difference(per_rank: list[list[str]], rank: int, group_name: str, kind: str) -> str:
    """The message naming the first collective of a compiled graph on which the ranks differ, and what each rank
    has there: the op when the ops differ, else the arguments that differ."""
    longest = max(len(e) for e in per_rank)
    for i in range(longest):
        seen = [json.loads(e[i]) if i < len(e) else None for e in per_rank]
        if any(s != seen[0] for s in seen):
            break
    ops = {s["op"] if s else None for s in seen}
    keys = [] if len(ops) > 1 else [k for k in seen[0]["args"] if any(s["args"].get(k) != seen[0]["args"][k]
                                                                          for s in seen)]

    def show(s: dict | None) -> str:
        if s is None:
            return "nothing (its graph has no more collectives on this group)"
        args = {k: s["args"].get(k) for k in keys} if keys else s["args"]
        text = ", ".join(f"{k}={_short(v)}" for k, v in args.items())
        return f"{s['op']}({text})" if not keys else f"{s['op']} with {text}"

    lines = "; ".join(f"rank {r}{' (this rank)' if r == rank else ''}: {show(s)}" for r, s in enumerate(seen))
    counts = ", ".join(str(len(e)) for e in per_rank)
    return (f"flashoverlap: the ranks of group {group_name} compiled different {kind} graphs and would pair unlike "
            f"collectives (collectives per rank: {counts}). First difference, collective #{i + 1}: {lines}. Every "
            "rank must compile the same model with the same flashoverlap settings (fuse, transport, data folder) and "
            "the same input shapes; nothing of this graph has run.")


def _short(value: object, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
