"""The exceptions a fused op raises where a collective would fail: one module, importable without torch internals.

Every one of them is raised on every rank of the group that the failure concerns (``docs/design.md``, "Failure
contract"), never on one rank alone.
"""

from __future__ import annotations


class FlashOverlapError(RuntimeError):
    """Base of the errors below."""


class FlashOverlapTimeout(FlashOverlapError):
    """A bounded GPU wait of a fused call gave up (a rank stalled past the timeout, or a GEMM hung): the outputs of
    the calls it concerned were poisoned (NaN), never returned with stale data."""


class RankMismatch(FlashOverlapError):
    """The ranks of a group disagree about something that decides which collectives a fused call issues (settings,
    route, plan, kernel, library, data file, shapes)."""


class PeerFailure(FlashOverlapError):
    """Another rank of the group failed in the middle of a fused call; this rank's output of it is not returned."""


class PoisonedResult(FlashOverlapError):
    """A fused call that returned before its ranks' status was read on the host (a deferred settle) turned out to have
    failed on some rank: its outputs were NaN on every rank (never other values); raised at a later call on the group
    or in ``routes.check()``, with the cause chained where there is one."""
