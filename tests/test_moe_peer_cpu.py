"""``routes/moe_peer.py``'s host rules, on the CPU (the transfers themselves: ``tests/test_gpu_moe_peer.py``): the
choice declines alike on every rank for shared reasons (the experiment, the device, the world size, the dtype; not
the deferred settle); a block past its slot is written to and read from rows of its own (spilled), the others in
their slots; the group's rows bound only grows and is learned from every rank's vector alike, by either settle; a
fault block's code on the device is folded into the rank's settle vector."""

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
    (frozenset({moe_peer.EXPERIMENT}), 2, torch.float64, "dtype")])
def test_shared_reasons_decline(monkeypatch, experiments, size, dtype, want):
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)
    assert moe_peer.static_issue(x, _group(size), experiments).startswith(want)


def test_the_deferred_settle_is_no_reason_to_decline(monkeypatch):
    monkeypatch.setattr(moe_peer.compat, "is_capturing", lambda: False)
    monkeypatch.setattr(moe_peer.kernels, "available", lambda: True)
    x = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert moe_peer.static_issue(x, _group(), frozenset({moe_peer.EXPERIMENT, "moe_settle_deferred"})) is None


SLOT = 4096  # bytes: 256 rows of 8 bf16 elements


def _call(rank: int = 0, world: int = 3) -> moe_peer.PeerCall:
    ws = SimpleNamespace(views=[torch.full((world * SLOT,), r, dtype=torch.uint8) for r in range(world)])
    group = SimpleNamespace(size=lambda: world, rank=lambda: rank, group_name="g")
    call = moe_peer.PeerCall(None, ws, group, torch.device("cpu"), SLOT)
    call.begun = True
    return call


def test_the_combine_writes_blocks_that_fit_into_their_slots_and_spills_the_rest():
    call = _call(rank=1)
    targets = call.targets([300, 7, 256], 8, torch.bfloat16)  # to rank 0: past the slot; rank 2: exactly fits
    assert targets[1] is None and call.direct == frozenset({2})
    slot = targets[2]
    assert slot.shape == (256, 8) and slot.dtype == torch.bfloat16
    assert slot.data_ptr() == call.ws.views[2].data_ptr() + 1 * SLOT  # slot ``rank`` of rank 2's buffer
    assert targets[0].shape == (300, 8) and all(targets[0].data_ptr() != v.data_ptr() for v in call.ws.views)
    pushed = call.to_push(targets)
    assert pushed[0] is targets[0] and pushed[1] is None and pushed[2] is None


def test_the_dispatch_reads_blocks_that_fit_in_their_slots():
    call = _call(rank=0)
    slots = call.slots([9, 12, 257], 8, torch.bfloat16)  # own, fits, past the slot
    assert slots[0] is None and slots[2] is None
    assert slots[1].shape == (12, 8) and slots[1].data_ptr() == call.ws.views[0].data_ptr() + SLOT


def test_the_push_experiment_keeps_the_send_rows():
    from flashoverlap_inductor import config

    with config.patch(experiments={moe_peer.EXPERIMENT, moe_peer.PUSH_EXPERIMENT}):
        assert _call().targets([1, 2, 3], 8, torch.bfloat16) is None


def test_a_fault_code_on_the_device_fails_the_rank_in_its_vector():
    facts = torch.tensor([0, 64, 63, 0, 0, 0, 64, 0])
    dev = torch.device("cpu")
    clean = moe_settle.local_vector(None, facts.clone(), dev, 2, torch.zeros(1, dtype=torch.int32))
    assert clean.tolist() == facts.tolist()
    faulted = moe_settle.local_vector(None, facts.clone(), dev, 2, torch.tensor([5], dtype=torch.int32))
    assert faulted[moe_settle.FAIL] == 3 and faulted[1:].tolist() == facts[1:].tolist()
    assert moe_settle.local_vector(ValueError(), None, dev, 1, None).tolist() == [2] + [0] * 7


def test_either_settle_teaches_the_rows_bound_only_to_groups_with_peer_transfers():
    g, h = _group(name="learn-g"), _group(name="learn-h")
    moe_settle.raise_rows_bound(g, 10)
    moe_settle.learn_rows(g, [[0, 64, 0, 0, 0, 0, 64, 0], [0, 300, 0, 0, 0, 0, 300, 0]])
    moe_settle.learn_rows(h, [[0, 64, 0, 0, 0, 0, 64, 0]])
    assert moe_settle.rows_bound(g) == 300 and moe_settle.rows_bound(h) is None
    moe_settle.forget()


def test_the_rows_bound_only_grows_and_is_kept_per_group():
    g, h = _group(name="bound-g"), _group(name="bound-h")
    assert moe_settle.rows_bound(g) is None
    assert moe_settle.raise_rows_bound(g, 100) == 100
    assert moe_settle.raise_rows_bound(g, 40) == 100 and moe_settle.rows_bound(h) is None
    moe_settle.forget()
    assert moe_settle.rows_bound(g) is None
