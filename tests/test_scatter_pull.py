"""``routes/scatter_pull.py`` on the CPU: which calls it declines (pure, the experiment first), where the registry puts
it, the bias forms, and the halves' arithmetic (each rank's own half plus the peer's part of it is that half of the
reduce_scatter of every rank's ``a @ b (+ bias)``) with the route's own ``half_gemm``."""

from __future__ import annotations

import pytest
import torch

from flashoverlap_inductor import config, routes
from flashoverlap_inductor.native import kernels
from flashoverlap_inductor.routes import scatter_pull


def _call(collective="reduce_scatter", rows=256, world=2, dtype=torch.bfloat16, device="cuda", compile_time=False):
    return routes.Call(collective, rows, 128, 64, dtype, world, 0, device, None, "auto", group_name="g",
                       compile_time=compile_time)


ON = config.current().replace(experiments=frozenset({"scatter_pull"}))


def test_which_calls_it_takes(monkeypatch):
    """Pure declines; ``scatter_route``: "peer" none (but the experiment's staged sums), "pull" every 2-rank call,
    "auto" where the cost model prefers it (not under ring="all"); the same at compile time."""
    monkeypatch.setattr(kernels, "available", lambda: True)
    pull, peer = config.current().replace(scatter_route="pull"), config.current().replace(scatter_route="peer")
    assert "'peer'" in scatter_pull.unsupported(_call(), peer)
    assert scatter_pull.unsupported(_call(), peer.replace(experiments=frozenset({"scatter_pull"}))) is None
    assert scatter_pull.unsupported(_call(), pull) is None
    assert scatter_pull.unsupported(_call(compile_time=True), pull) is None  # the pass predicts the route that runs
    for settings in (pull, ON):
        assert "all_reduce" in scatter_pull.unsupported(_call("all_reduce"), settings)
        assert "world size 3" in scatter_pull.unsupported(_call(world=3), settings)
        assert "halves" in scatter_pull.unsupported(_call(rows=255), settings)
        assert "dtype" in scatter_pull.unsupported(_call(dtype=torch.int8), settings)
        assert "nccl" in scatter_pull.unsupported(_call(), settings.replace(transport="nccl"))
    auto = config.current()
    assert auto.tuning.scatter_route == "auto"
    from flashoverlap_inductor.cost_model import pull as pull_model
    from flashoverlap_inductor.routes import peer as peer_route

    monkeypatch.setattr(pull_model, "prefers_pull", lambda *args: False)
    assert scatter_pull.takes_plain(_call(), auto)  # the peer route cannot take it here (no kernels): nothing to weigh
    monkeypatch.setattr(peer_route.ROUTE, "unsupported", lambda call, settings: None)
    assert "predicts the peer route faster" in scatter_pull.unsupported(_call(), auto)
    assert scatter_pull.unsupported(_call(), ON) is None  # the experiment's staged sums still come here
    assert not scatter_pull.takes_plain(_call(), ON)  # ... but a plain call of that shape goes on (make_launch)
    assert "predicts" in scatter_pull.unsupported(_call(compile_time=True), ON)  # the pass predicts where it runs

    def broken(*args):
        raise ValueError("a broken data file")

    monkeypatch.setattr(pull_model, "prefers_pull", broken)
    assert not scatter_pull.takes_plain(_call(), auto)  # a cost-model failure: the peer route, no error
    monkeypatch.setattr(pull_model, "prefers_pull", lambda *args: True)
    assert scatter_pull.unsupported(_call(), auto) is None and scatter_pull.takes_plain(_call(), auto)
    assert "predicts" in scatter_pull.unsupported(_call(), auto.replace(ring="all"))  # the ring asked for
    assert not scatter_pull.takes_plain(_call(dtype=torch.float16), auto)  # auto: bf16, the dtype it was measured in
    assert scatter_pull.takes_plain(_call(dtype=torch.float16), pull)
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert "library" in scatter_pull.unsupported(_call(), pull)


def test_auto_prefers_it_where_its_model_is_within_the_tolerance():
    """H200 data. With the host floors (eager calls), a route's cost is its GPU time plus its floor: the pull route
    keeps only the largest outputs, where its GPU edge exceeds the floors' difference (16384 x 8192 at K 7168 per
    rank), not down_proj of Llama-3-8B TP2 at 4096 rows (4096 x 4096 at K 7168: 0.33 ms of host per call, 0.25 as
    one library call, against the peer route's 0.11, which made the TP prefill host-paced, 40th session), nor
    o_proj (K 2048). Without the floors
    (GPU times alone) it takes the shapes it runs faster (down_proj's) and not those it does not (o_proj's is within
    the model's error of the peer route's, inside the tolerance). False without data for the dtype."""
    from flashoverlap_inductor.cost_model import pull, registry

    # 8192 x 8192 at K 7168 since the library call's lower floor (0.25 ms, 42nd session)
    for rows, n, k in ((16384, 8192, 7168), (16384, 8192, 14336), (32768, 4096, 7168), (8192, 8192, 7168)):
        assert pull.prefers_pull(rows, n, k, "bfloat16", "NVIDIA H200")
    for rows, n, k in ((4096, 4096, 7168), (2048, 8192, 7168), (8192, 4096, 4096),
                       (4096, 4096, 4096), (4096, 4096, 2048), (2048, 4096, 4096)):
        assert not pull.prefers_pull(rows, n, k, "bfloat16", "NVIDIA H200")
    for rows, n, k in ((4096, 4096, 7168), (8192, 8192, 7168), (2048, 8192, 7168), (4096, 4096, 2048)):
        assert pull.prefers_pull(rows, n, k, "bfloat16", "NVIDIA H200", host_floors=False)
    model, _ = registry.model_for("NVIDIA H200")
    floor = model.gemm.scatter_pull.host_floor_ms
    peer_floor = model.gemm.peer.terms["reduce_scatter"].host_floor_ms
    gpu = pull.pull_gpu_ms(model, 4096, 4096, 7168, "bfloat16", None)
    peer = model.peer_ms("reduce_scatter", 4096, 4096, 7168, "bfloat16", 2, host_bound=False)
    assert floor < gpu < peer  # each call alone GPU-bound, the pull route the faster on the GPU ...
    assert gpu + floor > (1 + pull.TOLERANCE) * (peer + peer_floor)  # ... but not by the host time it adds
    assert not pull.prefers_pull(4096, 4096, 7168, "int8", "NVIDIA H200")
    assert pull.pull_ms(model, 256, 256, 256, "bfloat16", None) == floor
    assert pull.pull_ms(model, 256, 256, 256, "bfloat16", None, host_bound=False) < floor


def test_the_registry_puts_it_first(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert routes.REGISTRY[0] is scatter_pull.ROUTE
    assert routes.select(_call(), ON).name == "scatter_pull"
    assert routes.select(_call(), config.current().replace(scatter_route="peer")).name != "scatter_pull"
    assert routes.select(_call(compile_time=True), config.current().replace(scatter_route="pull")).name == \
        "scatter_pull"
    assert routes.select(_call(device="cpu"), ON).name == "cpu"


def test_push_schedule_only_where_its_buffer_fits(monkeypatch):
    """Under ``scatter_start="push"`` the launch takes the push schedule (``SLOT_SETS`` x 2 shards per
    rank) unless that buffer would pass ``gather_push_max_mb``, then the handshake (one shard), saying so; under
    ``"handshake"`` the handshake; the tuning rows tell the push schedule's launches from the pull's."""
    from types import SimpleNamespace

    from flashoverlap_inductor.routes import gather_peer, gather_start
    from flashoverlap_inductor.tune import rows

    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(scatter_pull.compat, "group_timeout_ms", lambda g: 1000.0)
    rows_, n, k = 4096, 4096, 512  # halves of 2048 x 4096 bf16: 16 MiB shards, a 64 MiB push buffer
    call = routes.Call("reduce_scatter", rows_, n, k, torch.bfloat16, 2, 0, "cuda", None, "auto", group_name="g")
    ctx = SimpleNamespace(b=torch.zeros(k, n), bias=None, y_shape=[rows_, n], group=None)
    assert config.current().tuning.scatter_start == "push"  # the default
    base = config.current().replace(scatter_route="pull", scatter_start="handshake")
    shard = 2048 * n * 2
    plain = scatter_pull.make_launch(call, base, ctx)
    assert plain.options == gather_start.GEMM_AFTER_HANDSHAKE and plain.buffer_bytes == shard
    assert rows.route_of_launch(plain.description) == "pull"
    push = base.replace(scatter_start="push")
    launch = scatter_pull.make_launch(call, push, ctx)
    assert launch.options == gather_start.PUSH and launch.buffer_bytes == gather_start.SLOT_SETS * 2 * shard
    assert rows.route_of_launch(launch.description) == "push"
    for cap in (0, 63):
        fallback = scatter_pull.make_launch(call, push.replace(gather_push_max_mb=cap), ctx)
        assert fallback.options == gather_start.GEMM_AFTER_HANDSHAKE and fallback.buffer_bytes == shard
        assert "handshake schedule" in fallback.description and rows.route_of_launch(fallback.description) == "pull"
    assert scatter_pull.make_launch(call, push.replace(gather_push_max_mb=64), ctx).options == gather_start.PUSH


def test_bias_forms():
    y = [4, 64, 128]
    assert scatter_pull.bias_form(None, y) is None
    assert scatter_pull.bias_form(torch.zeros(128), y) == "row"
    assert scatter_pull.bias_form(torch.zeros(1, 128), y) == "row"
    assert scatter_pull.bias_form(torch.zeros(4, 64, 128), y) == "full"
    assert scatter_pull.bias_form(torch.zeros(4, 1, 128), y) == "other"
    assert scatter_pull.bias_form(torch.zeros(()), y) == "row" and scatter_pull.bias_form(torch.zeros(1), y) == "row"
    assert scatter_pull.bias_form(torch.zeros(()), [4, 1]) == "row"  # a 0-d bias with N = 1


@pytest.mark.parametrize("form", [None, "row", "full"])
def test_halves_sum_to_the_reduce_scatter(form):
    gen = torch.Generator().manual_seed(3)
    rows, k, n = 16, 8, 12
    a = [torch.randn(rows, k, generator=gen, dtype=torch.float64) for _ in range(2)]
    b = [torch.randn(k, n, generator=gen, dtype=torch.float64) for _ in range(2)]
    c = [None if form is None else torch.randn(n if form == "row" else (rows, n), generator=gen,
                                               dtype=torch.float64) for _ in range(2)]
    full = sum(x @ w + (0 if cc is None else cc) for x, w, cc in zip(a, b, c, strict=True))
    half = rows // 2

    def bias_rows(cc, h):
        return None if cc is None else cc if form == "row" else cc[h * half:(h + 1) * half]

    for rank in range(2):
        peer = 1 - rank
        part_from_peer = scatter_pull.half_gemm(a[peer][rank * half:(rank + 1) * half], b[peer],
                                                bias_rows(c[peer], rank))
        out = torch.empty(half, n, dtype=torch.float64)
        scatter_pull.half_gemm(a[rank][rank * half:(rank + 1) * half], b[rank], bias_rows(c[rank], rank), out=out)
        out.add_(part_from_peer)
        torch.testing.assert_close(out, full[rank * half:(rank + 1) * half])


class _Probe:
    """The timeline tool's probe, faked: the names marked (``mark`` and ``events_for``) in order."""

    def __init__(self):
        self.names = []

    def mark(self, name, stream, lane="compute"):
        self.names.append(name)

    def events_for(self, names, lane):
        from types import SimpleNamespace

        self.names += names
        return [SimpleNamespace(cuda_event=1000 + i) for i, _ in enumerate(names)]  # "pointers" 1000 + rank


@pytest.mark.parametrize("probed", [False, True])
@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("form", [None, "full"])
def test_execute_pulls_the_peers_part_into_the_right_rows(monkeypatch, form, push, probed):
    """``execute`` itself for both ranks of a simulated pair on the CPU: the library's calls faked (the pull writes the
    peer's part for this rank's rows where the protocol's slot ``peer`` lies: ``p.staging + peer * shard_bytes``;
    under ``scatter_start="push"`` the peer's push lands in slot ``peer`` of the call's set in this rank's receive
    buffer, two calls per rank alternating the sets), the stream wait a no-op. Each rank's result must be its half of
    the reduce_scatter. ``probed``: the timeline tool's probe on every call: its marks in order, the library given the
    probe's arrival event, and the memoized struct given the flags' events back after the call."""
    import ctypes
    from types import SimpleNamespace

    from flashoverlap_inductor.routes import gather_peer, gather_protocol, gather_start

    gen = torch.Generator().manual_seed(5)
    rows, k, n = 8, 16, 24  # a: [2, 4, k] per rank (3-D: halves are whole dim-0 elements)
    a = [torch.randn(2, rows // 2, k, generator=gen) for _ in range(2)]
    b = [torch.randn(k, n, generator=gen) for _ in range(2)]
    c = [None if form is None else torch.randn(2, rows // 2, n, generator=gen) for _ in range(2)]
    full = sum(x.reshape(rows, k) @ w + (0 if cc is None else cc.reshape(rows, n)) for x, w, cc in zip(a, b, c))
    half = rows // 2
    on = config.current().replace(experiments=frozenset({"scatter_pull"}), scatter_route="pull",
                                  scatter_start="push" if push else "handshake")
    monkeypatch.setattr(gather_peer, "group_issue", lambda g: None)
    monkeypatch.setattr(gather_peer, "_push_calls", {})
    monkeypatch.setattr(scatter_pull.compat, "group_timeout_ms", lambda g: 1000.0)
    monkeypatch.setattr(scatter_pull.compat, "current_raw_stream", lambda i: 0)
    monkeypatch.setattr(scatter_pull, "_wait", lambda d, e: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)  # the probe's marks' stream
    monkeypatch.setattr(scatter_pull.symmetric, "order_after_last", lambda g, d, s: None)
    flags = SimpleNamespace(views=[torch.zeros(4)] * 2, events=[SimpleNamespace(cuda_event=None)] * 2,
                            epoch=torch.zeros(1), fault=SimpleNamespace(block_ptr=None, mirror_ptr=None),
                            copy=SimpleNamespace(cuda_stream=None))
    shard_bytes = half * n * 4
    calls = {0: 0, 1: 0}  # push calls per simulated rank
    # the workspace has room to spare: the sets lie capacity / SLOT_SETS apart, not two shards apart
    receive = [torch.full((gather_start.SLOT_SETS * (2 * shard_bytes + 64),), 255, dtype=torch.uint8) for _ in range(2)]
    for rank in range(2):
        peer = 1 - rank
        ws = SimpleNamespace(flags=flags, views=receive if push else [torch.zeros(4)] * 2, serial=-1,
                             capacity=receive[0].numel())
        monkeypatch.setattr(gather_peer, "workspace", lambda *args, ws=ws: ws)
        sent = scatter_pull.half_gemm(a[peer].reshape(rows, k)[rank * half:(rank + 1) * half], b[peer],
                                      None if c[peer] is None else c[peer].reshape(rows, n)[rank * half:][:half])

        def gather_call(pp, rank=rank, peer=peer, sent=sent):
            p = pp._obj
            assert p.shard_events[peer] == (1000 + peer if probed else None)  # the probe's arrival event
            assert p.rank == rank and p.copy_own == 0 and p.shard_bytes == sent.numel() * sent.element_size()
            assert bool(p.options & gather_start.PUSH) == push
            if push:  # the peer's push: slot ``peer`` of set ``slot_set`` in this rank's buffer
                assert p.staging is None and p.slot_set == calls[rank] % gather_start.SLOT_SETS
                calls[rank] += 1
                assert p.set_bytes == receive[rank].numel() // gather_start.SLOT_SETS
                where = receive[rank].data_ptr() + p.slot_set * p.set_bytes + peer * p.shard_bytes
                ctypes.memmove(where, sent.data_ptr(), p.shard_bytes)
                other = (1 - p.slot_set) * p.set_bytes + peer * p.shard_bytes  # the other set's slot: NaN (0xff)
                receive[rank][other:other + p.shard_bytes] = 255
            else:
                ctypes.memmove(p.staging + peer * p.shard_bytes, sent.data_ptr(), p.shard_bytes)
            return 0

        lib = SimpleNamespace(fo_gather_call=gather_call, fo_gather_finish=lambda pp: 0)
        monkeypatch.setattr(scatter_pull.kernels, "library", lambda lib=lib: lib)
        call = routes.Call("reduce_scatter", rows, n, k, torch.float32, 2, rank, "cuda", None, "auto",
                           group_name="g")
        group = SimpleNamespace(group_name=f"g{rank}")  # each simulated rank its own push-call counter
        ctx = SimpleNamespace(a=a[rank], b=b[rank], bias=c[rank], group=group, y_shape=[2, half, n],
                              out_shape=[1, half, n], capturing=False, probe=None)
        launch = scatter_pull.make_launch(call, on, ctx)
        assert launch.buffer_bytes == (gather_start.SLOT_SETS * 2 * shard_bytes if push else shard_bytes)
        launch.args.clear()
        for _ in range(3 if push else 1):  # push: sets 0, 1, then 0 again
            ctx.probe = _Probe() if probed else None
            out = scatter_pull.ROUTE.execute(launch, ctx)
            torch.testing.assert_close(out.reshape(half, n), full[rank * half:(rank + 1) * half])
            if probed:
                assert ctx.probe.names == ["start", "part", "pull:0", "pull:1", "own_start", "own", "arrived",
                                           "add", "end"]
                assert list(launch.args[-1].shard_events) == [None] * gather_protocol.MAX_WORLD  # the flags' again
    assert calls == ({0: 3, 1: 3} if push else {0: 0, 1: 0})
