"""A call probe: CUDA events that a route records at the points of one fused call, read back as a timeline.

Only the timeline tool (``python -m flashoverlap_inductor.bench timeline``) makes one; a route given none
(``Context.probe is None``, every call the dispatcher makes) records nothing and pays one ``is None`` test.

Invariants: every mark is a timing-enabled ``torch.cuda.Event`` recorded on the stream named with it; times are
read after the caller synchronized, in ms since the ``start`` mark (``CallProbe.times``); a name marked twice keeps
the last record. Events the library records itself (the gather route's pull events, the peer route's points:
``routes.peer.probe_points``) come from ``events_for``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CallProbe:
    """Named timing events of one call. ``marks``: name -> (event, stream label: "compute" or "copy")."""

    marks: dict[str, tuple[torch.cuda.Event, str]] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)  # host-side spans (perf_counter), ms

    def mark(self, name: str, stream: torch.cuda.Stream, lane: str = "compute") -> None:
        """Record ``name`` on ``stream`` now (in stream order)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        self.marks[name] = (ev, lane)

    def events_for(self, names: list[str], lane: str) -> list[torch.cuda.Event]:
        """Fresh timing events under ``names`` for someone else to record (the library, on ``lane``), in order."""
        out = []
        for name in names:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream())  # created now (torch makes an event at its first record)
            self.marks[name] = (ev, lane)
            out.append(ev)
        return out

    def times(self) -> dict[str, float]:
        """ms since ``start`` of every mark (after a synchronize)."""
        start = self.marks["start"][0]
        return {name: start.elapsed_time(ev) for name, (ev, _) in self.marks.items()}

    def lanes(self) -> dict[str, str]:
        return {name: lane for name, (_, lane) in self.marks.items()}
