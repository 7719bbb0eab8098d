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


ROW = 16  # bytes: 8 bf16 elements


def _call(rank: int = 0, world: int = 3, ins=(), outs=()) -> moe_peer.PeerCall:
    """A begun call of ``rank`` whose split sizes are ``ins`` / ``outs`` (its spill plan), on CPU stand-ins."""
    ws = SimpleNamespace(views=[torch.full((world * SLOT,), r, dtype=torch.uint8) for r in range(world)],
                         flags=SimpleNamespace(copy=None, events=[None] * world))
    group = SimpleNamespace(size=lambda: world, rank=lambda: rank, group_name="g")
    call = moe_peer.PeerCall(None, ws, group, torch.device("cpu"), SLOT, ROW, torch.bfloat16,
                             *moe_peer.spill_plan(ins or [0] * world, outs or [0] * world, rank, ROW, SLOT))
    call.begun = True
    return call


def test_the_spill_plan_is_the_pairs_own():
    ins = {0: [5, 300, 256], 1: [257, 7, 9], 2: [0, 4096, 3]}  # rank -> rows to each rank
    outs = {r: [ins[s][r] for s in range(3)] for r in range(3)}  # what each rank receives: the same pairs
    plans = {r: moe_peer.spill_plan(ins[r], outs[r], r, ROW, SLOT) for r in range(3)}
    assert plans[0] == ({1: 300}, {1: 257}) and plans[1] == ({0: 257}, {0: 300, 2: 4096}) and plans[2] == ({1: 4096},
                                                                                                            {})
    for r in range(3):  # every block one end sends past the slot, the other end receives past it
        assert all(plans[j][1][r] == rows for j, rows in plans[r][0].items())


def test_the_combine_writes_blocks_that_fit_into_their_slots_and_spills_the_rest():
    call = _call(rank=1, ins=[300, 7, 256])
    targets = call.targets([300, 7, 256], 8, torch.bfloat16)  # to rank 0: past the slot; rank 2: exactly fits
    assert targets[1] is None and call.direct == frozenset({2})
    slot = targets[2]
    assert slot.shape == (256, 8) and slot.dtype == torch.bfloat16
    assert slot.data_ptr() == call.ws.views[2].data_ptr() + 1 * SLOT  # slot ``rank`` of rank 2's buffer
    assert targets[0].shape == (300, 8) and all(targets[0].data_ptr() != v.data_ptr() for v in call.ws.views)
    pushed = call.to_push(targets)
    assert pushed[0] is targets[0] and pushed[1] is None and pushed[2] is None


def test_the_dispatch_reads_blocks_that_fit_in_their_slots():
    call = _call(rank=0, outs=[9, 12, 257])
    slots = call.slots([9, 12, 257], 8, torch.bfloat16)  # own, fits, past the slot
    assert slots[0] is None and slots[2] is None
    assert slots[1].shape == (12, 8) and slots[1].data_ptr() == call.ws.views[0].data_ptr() + SLOT


def test_the_push_experiment_keeps_the_send_rows():
    from flashoverlap_inductor import config

    with config.patch(experiments={moe_peer.EXPERIMENT, moe_peer.PUSH_EXPERIMENT}):
        assert _call().targets([1, 2, 3], 8, torch.bfloat16) is None


class _Step:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True


def _stub_transfers(monkeypatch, call) -> list:
    """The library's calls stubbed out and ``exchange_blocks`` recorded (its one step returned): the exchanges."""
    from flashoverlap_inductor.routes import moe_nccl, moe_peer_call

    seen = []

    def exchange(sends, recvs, group, what, tag):
        seen.append(([(j, t.shape, bool(t.isnan().all()), ev) for j, t, ev in sends],
                     [(j, t.shape) for j, t in recvs], _Step()))
        return {j: seen[-1][2] for j, _ in recvs}, [seen[-1][2]]

    monkeypatch.setattr(moe_nccl, "exchange_blocks", exchange)
    monkeypatch.setattr(moe_peer_call.PeerCall, "_enqueue", lambda self, phase: None)
    monkeypatch.setattr(moe_peer_call.gather_protocol, "finish", lambda *args: 0)
    monkeypatch.setattr(moe_peer_call.kernels, "library", lambda: None)
    call.p = SimpleNamespace(blocks=[None] * 3, block_bytes=[0] * 3, block_events=[None] * 3, recv=[None] * 3,
                             recv_bytes=[0] * 3, outputs=[0] * 8, output_numel=[0] * 8, num_outputs=0)
    call.lock = SimpleNamespace(release=lambda: None)
    return seen


def test_a_rank_that_only_sends_spilled_rows_waits_for_them_before_its_call_ends(monkeypatch):
    call = _call(rank=0, ins=[0, 300, 0])
    seen = _stub_transfers(monkeypatch, call)
    block = torch.ones(300, 8, dtype=torch.bfloat16)
    landed = call.send([None, block, None], [None, None, None])
    assert [src for src, _ in landed] == [2, 1] and len(seen) == 1  # the library's arrival order, one exchange
    assert seen[0][0] == [(1, (300, 8), False, None)] and seen[0][1] == []
    assert call.finish([], None) is None and seen[0][2].waited == 1  # no source to wait on: the finish waits


def test_a_call_that_never_sent_still_makes_its_planned_spills_with_nan_rows(monkeypatch):
    call = _call(rank=2, ins=[400, 1, 0], outs=[0, 500, 0])
    seen = _stub_transfers(monkeypatch, call)
    assert isinstance(call.finish([], RuntimeError("before the send")), RuntimeError)
    assert len(seen) == 1 and seen[0][0] == [(0, (400, 8), True, None)] and seen[0][1] == [(1, (500, 8))]
    assert seen[0][2].waited == 1


def test_a_block_of_another_size_than_planned_travels_as_nan_and_fails_the_call(monkeypatch):
    call = _call(rank=0, ins=[0, 300, 0])
    seen = _stub_transfers(monkeypatch, call)
    call.send([None, torch.ones(299, 8, dtype=torch.bfloat16), None], [None, None, None])
    assert seen[0][0] == [(1, (300, 8), True, None)] and isinstance(call.failure, ValueError)


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
