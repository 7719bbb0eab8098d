"""``routes/moe_peer.py``'s host rules, on the CPU (the transfers themselves: ``tests/test_gpu_moe_peer.py``): the
choice declines alike on every rank for shared reasons (the experiment, the device, the world size, the dtype, the
deferred settle); a call whose block outgrew its slot marks its settle vector as a failed premise (every rank redoes
it) and, where it has no routing facts, reports its largest block as ``ROWS``; the group's rows bound only grows and
is learned from every rank's vector alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashoverlap_inductor.routes import moe_peer, moe_settle


def _group(size: int = 2, name: str = "g"):
    return SimpleNamespace(size=lambda: size, rank=lambda: 0, group_name=name)


def test_cpu_rows_never_take_peer_transfers():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert moe_peer.begin(x, 16, [2, 2], [2, 2], _group(), False, True) is None
    assert moe_peer.static_issue(x, _group(), frozenset({moe_peer.EXPERIMENT})).startswith("device")


@pytest.mark.parametrize("experiments, size, dtype, want", [
    (frozenset(), 2, torch.bfloat16, "experiment"),
    (frozenset({moe_peer.EXPERIMENT}), 1, torch.bfloat16, "world"),
    (frozenset({moe_peer.EXPERIMENT}), 9, torch.bfloat16, "world"),
    (frozenset({moe_peer.EXPERIMENT}), 2, torch.float64, "dtype"),
    (frozenset({moe_peer.EXPERIMENT, "moe_settle_deferred"}), 2, torch.bfloat16, "settle")])
def test_shared_reasons_decline(monkeypatch, experiments, size, dtype, want):
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)
    assert moe_peer.static_issue(x, _group(size), experiments).startswith(want)


def _call(fits: bool) -> moe_peer.PeerCall:
    return moe_peer.PeerCall(None, None, _group(), torch.device("cpu"), 4096, fits, 300)


def test_an_outgrown_block_fails_the_premise_and_reports_its_rows():
    assert _call(True).facts(None) is None
    v = _call(False).facts(None).tolist()
    assert v[moe_settle.ROWS] == 300 and moe_settle.verdicts(v) == (False, False, True)
    facts = torch.tensor([0, 64, 63, 0, 0, 0, 64, 0])  # a whole-block call whose premise held
    assert moe_settle.verdicts(facts.tolist()) == (False, False, False)
    marked = _call(False).facts(facts).tolist()
    assert marked[moe_settle.ROWS] == 64 and moe_settle.verdicts(marked) == (False, False, True)
    assert facts.tolist()[moe_settle.UNNAMED] == 0  # the routing facts themselves are not changed


def test_the_rows_bound_only_grows_and_is_kept_per_group():
    g, h = _group(name="bound-g"), _group(name="bound-h")
    assert moe_settle.rows_bound(g) is None
    assert moe_settle.raise_rows_bound(g, 100) == 100
    assert moe_settle.raise_rows_bound(g, 40) == 100 and moe_settle.rows_bound(h) is None
    moe_settle.forget()
    assert moe_settle.rows_bound(g) is None
