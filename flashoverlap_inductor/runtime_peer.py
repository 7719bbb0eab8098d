"""The peer-route dispatch of the overlapped CUDA path: a fused op on ``peer_route`` (two ranks) or ``ring_route``
(where ``ring_route.enabled``: partial sums passed around the ranks), the GEMM's tiles pushed or pulled between the
group's GPUs directly, instead of the NCCL route of ``runtime_gpu``. Both share the dispatch below, the call
ordering and the statistics (``route:peer`` / ``route:ring``; ``captured:peer`` counts both).

``runtime_gpu._run`` calls ``run`` first when ``peer_route.TRANSPORT == "peer"``; ``run`` returns the output tensor,
or None when the call must take the NCCL route.

Invariants:

- The peer calls of a group on a device share one set of flags and buffers, so they run one after another: an
  eager call from another stream than the last one waits for it (``peer_route.order_after_last``). A graph that
  holds peer calls replays on the stream current at replay time, which must be the one that runs the group's eager
  peer calls (as torch.compile's CUDA graphs do). Host threads issue peer calls one at a time (``_issue``).
- Under capture the route runs only where this call shape already ran eagerly (its launch is memoized) and the
  workspace is large enough (``peer_route.workspace``); otherwise the NCCL route. Ranks share the call history, so
  they agree. A call by pull (counters) takes a counter slot of its own (``res.slot(..., dedicated=True)``), as on the
  NCCL route.
- A call the peer route cannot take (its shape, dtype, B layout or configuration, memoized per call shape in
  ``launches``; a new shape or too small a workspace inside a capture) returns None, is counted in
  ``runtime_gpu.stats["peer_skip"]`` and is logged once per reason.
- Settings (``runtime_gpu.KERNEL``, ``SWIZZLE``, ``RASTER``, ``SIGNAL_MODE``, ``GEMM_GRID``, ``SM_RESERVE``) and
  helpers are read through the ``runtime_gpu`` module at call time: tests and benchmarks reassign them.
- ``launches`` is the same dict as ``runtime_gpu._peer_launches``; ``runtime_gpu.reset()`` clears it. A peer call
  sets ``runtime_gpu.last_launch`` to its ``peer_route.PeerLaunch``.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from . import config, kernels, peer_route, ring_route, streams
from .kernel_select import Operands

# peer_route launches (with their B choice) or ("peer", why not), per call shape
launches: dict[tuple, tuple] = {}
_issue = threading.Lock()


def run(collective: str, opnd: Operands, out_shape: list[int], group: dist.ProcessGroup,
        res: streams.DeviceResources, key: tuple, layout: str | None, capturing: bool) -> torch.Tensor | None:
    """The call on ``peer_route``: returns the output tensor, or None when the call must take the NCCL route (the
    route cannot take this call shape, or, inside a capture, the shape is new or needs a larger workspace; logged
    once per reason, counted in ``runtime_gpu.stats["peer_skip"]``). ``key`` is ``runtime_gpu``'s launch key;
    ``capturing``: the caller's stream is capturing a CUDA graph (``runtime_gpu`` has asked already)."""
    from . import runtime_gpu as rt  # at call time: runtime_gpu imports this module

    a, b = opnd.a, opnd.b
    n = b.shape[1]
    ring = ring_route.enabled(group.size())
    pkey = ("peer", peer_route.ADD_KERNEL, peer_route.GROUPS, peer_route.PARTIAL, ring_route.RING,
            ring_route.ROUNDS, *key)
    launch = launches.get(pkey)
    if launch is None and capturing:
        return _skip(collective, "peer:capture-new", "a new call shape first seen inside a CUDA-graph capture")
    if launch is None:
        launch = launches[pkey] = _make(collective, opnd, group, res, layout, ring)
    if launch[0] == "peer":
        return _skip(collective, f"peer:{launch[1]}", launch[1])
    plaunch, choice = launch
    cur = torch.cuda.current_stream(a.device)
    ringed = isinstance(plaunch, ring_route.RingLaunch)
    with _issue:  # host threads: one peer call at a time (workspaces are made collectively, in one order)
        if ringed:
            ws = ring_route.workspace(group, a.device, plaunch.need, capturing)
        else:
            ws = peer_route.workspace(group, a.device, peer_route.region_bytes(plaunch, n, a.element_size()),
                                      capturing)
        if ws is None:
            return _skip(collective, "peer:capture-grow", "its workspace would have to grow inside a CUDA-graph "
                         "capture")
        slot = res.slot(cur, dedicated=capturing) if not ringed and plaunch.groups else 0  # all_reduce by pull only
        if slot is None:
            return _skip(collective, "peer:slots", "no counter slot left")
        out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
        b_in, ldb = rt._kernel_b(b, choice)
        if not capturing:
            peer_route.order_after_last(group, a.device, cur)
        settings = (kernels.SIGNAL_MODES[rt.SIGNAL_MODE], kernels.RASTERS[rt.RASTER], rt.SWIZZLE,
                    max(1, int(config.wait_timeout_ms * 1e6)))
        if ringed:
            ring_route.execute(plaunch, ws, rt._row_major(a), b_in, ldb, opnd.bias, out, res, cur, *settings)
        else:
            peer_route.execute(plaunch, ws, rt._row_major(a), b_in, ldb, opnd.bias, out, res, slot, cur, *settings)
    rt.last_launch = plaunch
    rt.stats[f"fused:{collective}"] += 1
    rt.stats["route:ring" if ringed else "route:peer"] += 1
    if capturing:
        rt.stats["captured"] += 1
        rt.stats["captured:peer"] += 1
    return out


def _make(collective: str, opnd: Operands, group: dist.ProcessGroup, res: streams.DeviceResources,
          layout: str | None, ring: bool) -> tuple:
    """The memoized entry of a call shape: (launch, B choice), or ("peer", why the route cannot take it)."""
    from . import runtime_gpu as rt

    a, b = opnd.a, opnd.b
    (rows, k), n = a.shape, b.shape[1]
    world = group.size()
    dname = str(a.dtype).removeprefix("torch.")
    add = kernels.configs(add_c=True)
    why = (ring_route.unsupported(collective, rows, world, a.dtype, layout, add) if ring
           else peer_route.unsupported(collective, rows, n, k, a.dtype, world, layout, add))
    choice = None if why else rt.choose_kernel(rt._kernel_infos(), rt.KERNEL or "", None, dname, layout, {})
    if why is None and (choice is None or choice.convert_b):
        why = f"no plain configuration compiled for {dname} with B as {layout}"
    if why:
        return ("peer", why)
    plain = streams.kernel_lib().config_index(choice.name, a.dtype, choice.b_layout)

    def grid(tiles: int) -> int:
        return rt.grid_ctas(rt.gemm_grid(res.name, rt.GEMM_GRID), res.sm_count, tiles,
                            rt.sm_reserve(res.name, rt.SM_RESERVE, rt.nccl_max_ctas(group)))

    if ring:
        return (ring_route.make_launch(collective, rows, n, k, a.dtype, group.rank(), world,
                                       kernels.config_info(choice.name), grid, rt.SWIZZLE,
                                       kernels.RASTERS[rt.RASTER], choice.b_layout), choice)
    tile = (choice.tile_m, choice.tile_n)
    return (peer_route.make_launch(collective, rows, n, k, a.dtype, group.rank(), plain, tile, res, grid, rt.SWIZZLE,
                                   kernels.RASTERS[rt.RASTER], choice.b_layout, a.device), choice)


def _skip(collective: str, key: str, why: str) -> None:
    """Count and log (once per ``key``) a call that takes the NCCL route instead."""
    from . import runtime_gpu as rt

    rt.stats["peer_skip"] += 1
    rt._note(key, logging.INFO, "flashoverlap: %s takes the NCCL route: %s", collective, why)
    return None
