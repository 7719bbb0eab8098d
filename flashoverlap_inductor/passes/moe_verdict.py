"""One verdict per MoE op for the whole group under ``fuse="auto"``, agreed through the group's c10d store.

A MoE op's cost-model verdict depends on its rows per rank (``passes/moe_pass.py``), and ranks may compile different
token counts (uneven batches, a recompile that one rank alone needs). A rank that fused where another did not would
pair a fused op with the other's plain all_to_all. So the verdict a graph gets is not the rank's own: it is the
group's, agreed at compile time without any collective:

* **The op's identity** (``MoeProblem.identity``): the op ("dispatch" / "combine"), the dtype, the world size, the
  expert count, each term's (K, N), the settings the ranks share (``agree.shared_settings_key``) and a digest of the
  cost-model data. Nothing of it depends on the rows, so every rank names the op alike, whatever tokens it compiled.
* **First writer wins**: ``agreed`` offers this rank's verdict to the group's store with ``compare_set(key, "",
  mine)``, which sets the key only while it is absent and returns what it holds. The store serializes the offers,
  so every rank of the group gets the same answer for the identity, at every compilation and recompilation, for the
  group's lifetime; no rank waits for another (a rank compiling alone cannot hang).
* **Cost**: one store round trip per MoE op per compilation (a TCPStore: ~0.1 ms), none per call.
* **What it gives up**: the first verdict stands for every later token count of the same op. A job whose first
  compiled shape is not its usual one (a short warm-up, then long prefills) keeps the warm-up's verdict; the
  reason each graph reports says which rows decided it. ``fuse="always"`` / ``"never"`` decide without the store.

Graphs served by Inductor's caches skip the pass. Each verdict is therefore also recorded in Inductor's counters
(replayed on every cache hit, as ``manifest`` does), and ``conflicts`` offers it to the store again when the graph
is loaded: a cached graph whose verdict differs from the group's raises ``errors.RankMismatch`` at each of its runs
on the rank that loaded it, before anything of it runs (the backend; a raise at compile time could be swallowed by
Dynamo's ``suppress_errors`` into an eager run beside fused peers). It was compiled in an earlier job whose ranks
agreed otherwise; clearing the cache, or ``fuse="always"``, mends it. (Under torch 2.13 the MoE graphs are not
served by the FX-graph cache at all: their compiled form does not serialize.)

Every rank must run the same settings and cost-model data (as everywhere: ``routes/agree.py``): both are part of
the identity, so a rank whose differ names the op otherwise and gets a verdict of its own. A store that fails (a
timeout) fails the compilation on that rank (``moe_pass.fuse_each``): declining alone is never the fallback.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from flashoverlap_inductor import _inductor_compat as compat

VERDICT_PREFIX = "flashoverlap-moe-verdict|"  # Inductor counters: one per verdict a compilation used
STORE_PREFIX = "flashoverlap/moe-verdict/"  # keys in the group's own (prefixed) store


@dataclass(frozen=True)
class Agreed:
    """The group's verdict for one op: ``fuse``; ``rows``, the rows per rank of the compilation that decided it
    (None: symbolic); ``own``: whether this rank's own verdict is the same."""

    fuse: bool
    rows: int | None
    own: bool

    def describe(self) -> str:
        rows = "symbolic rows" if self.rows is None else f"{self.rows} rows per rank"
        whose = "this rank's own is the same" if self.own else "adopted: this rank's own differs"
        return f"the group's verdict, {'fuse' if self.fuse else 'decline'}, first given at {rows}; {whose}"


def _encode(fuse: bool, rows: int | None) -> str:
    return json.dumps([bool(fuse), rows])


def _decode(raw: bytes | str) -> tuple[bool, int | None]:
    fuse, rows = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return bool(fuse), rows


def _offer(group_name: str, identity: str, fuse: bool, rows: int | None) -> tuple[bool, int | None]:
    """What the group's store holds for ``identity`` after offering ``(fuse, rows)`` (first writer wins)."""
    store = compat.group_store(compat.resolve_group(group_name))
    return _decode(store.compare_set(STORE_PREFIX + identity, "", _encode(fuse, rows)))


_held: dict[tuple[str, str], tuple[bool, int | None]] = {}  # (group, identity) -> the group's verdict: it never changes


def agreed(group_name: str, identity: str, fuse: bool, rows: int | None) -> Agreed:
    """The group's verdict for the op ``identity`` (module docstring), this rank offering ``fuse`` decided at
    ``rows`` (one store round trip per op and group in this process; raises where the store fails); recorded with
    the graph being compiled (``conflicts``)."""
    key = (group_name, identity)
    if key not in _held:
        _held[key] = _offer(group_name, identity, fuse, rows)
    held, at = _held[key]
    compat.inductor_counters()[VERDICT_PREFIX + json.dumps([group_name, identity, held, at])] += 1
    return Agreed(held, at, held == fuse)


def snapshot() -> Counter:
    """The verdicts in Inductor's counters now (pass it to ``take`` after a compilation)."""
    return Counter({k: n for k, n in compat.inductor_counters().items() if k.startswith(VERDICT_PREFIX)})


def take(before: Counter) -> list[tuple[str, str, bool, int | None]]:
    """``(group_name, identity, fuse, rows)`` of every verdict one compilation or cache load used since
    ``before``."""
    return [tuple(json.loads(k[len(VERDICT_PREFIX):])) for k in snapshot() - before]


def conflicts(verdicts: list[tuple[str, str, bool, int | None]]) -> str:
    """Offer each verdict a compiled (or cache-loaded) graph was built with to its group's store again; the message
    naming those the group holds otherwise ("" where none: module docstring)."""
    for group_name, identity, fuse, at in verdicts:
        held, rows = _held.get((group_name, identity)) or _offer(group_name, identity, fuse, at)
        _held[(group_name, identity)] = (held, rows)
        if held != fuse:
            return (f"flashoverlap: this rank loaded a compiled graph whose MoE op ({identity.split('|')[0]}) was "
                    f"{'fused' if fuse else 'declined'} under fuse='auto', but group {group_name} agreed to "
                    f"{'fuse' if held else 'decline'} it (first decided at {rows} rows per rank); its ranks would "
                    "pair unlike collectives. The graph came from Inductor's cache of an earlier job: clear the cache "
                    "(TORCHINDUCTOR_CACHE_DIR) or use fuse='always'. Nothing of this graph has run.")
    return ""
