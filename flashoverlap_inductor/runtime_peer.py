"""The peer-route dispatch of the overlapped CUDA path: a fused op on ``peer_route`` (the GEMM's tiles pushed or
pulled between the group's GPUs directly) instead of the NCCL route of ``runtime_gpu``.

``runtime_gpu._run`` calls ``run`` first when ``peer_route.TRANSPORT == "peer"`` and it is not capturing; ``run``
returns the output tensor, or None when the call must take the NCCL route.

Invariants:

- One caller stream per device and group: the peer route's flags and buffers belong to the first caller stream
  (``peer_route.owns``); a call from another stream takes the NCCL route.
- A call the peer route cannot take (its shape, dtype, B layout or configuration, memoized per call shape in
  ``launches``; or another caller stream) returns None, is counted in ``runtime_gpu.stats["peer_skip"]`` and is
  logged once per reason.
- Settings (``runtime_gpu.KERNEL``, ``SWIZZLE``, ``RASTER``, ``SIGNAL_MODE``, ``GEMM_GRID``, ``SM_RESERVE``) and
  helpers are read through the ``runtime_gpu`` module at call time: tests and benchmarks reassign them.
- ``launches`` is the same dict as ``runtime_gpu._peer_launches``; ``runtime_gpu.reset()`` clears it. A peer call
  sets ``runtime_gpu.last_launch`` to its ``peer_route.PeerLaunch``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from . import config, kernels, peer_route, streams
from .kernel_select import Operands

# peer_route launches (with their B choice) or ("peer", why not), per call shape
launches: dict[tuple, tuple] = {}


def run(collective: str, opnd: Operands, out_shape: list[int], group: dist.ProcessGroup,
        res: streams.DeviceResources, key: tuple, layout: str | None) -> torch.Tensor | None:
    """The call on ``peer_route``: returns the output tensor, or None when the call must take the NCCL route (this
    call shape or caller stream cannot take the peer route; logged once per reason, counted in
    ``runtime_gpu.stats["peer_skip"]``). ``key`` is ``runtime_gpu``'s launch key of the call."""
    from . import runtime_gpu as rt  # at call time: runtime_gpu imports this module

    a, b = opnd.a, opnd.b
    (rows, k), n = a.shape, b.shape[1]
    pkey = ("peer", peer_route.ADD_KERNEL, peer_route.GROUPS, peer_route.PARTIAL, *key)
    launch = launches.get(pkey)
    if launch is None:
        dname = str(a.dtype).removeprefix("torch.")
        why = peer_route.unsupported(collective, rows, n, k, a.dtype, group.size(), layout,
                                     kernels.configs(add_c=True))
        choice = None if why else rt.choose_kernel(rt._kernel_infos(), rt.KERNEL or "", None, dname, layout, {})
        if why is None and (choice is None or choice.convert_b):
            why = f"no plain configuration compiled for {dname} with B as {layout}"
        if why:
            launch = ("peer", why)
        else:
            plain = streams.kernel_lib().config_index(choice.name, a.dtype, choice.b_layout)
            launch = peer_route.make_launch(
                collective, rows, n, k, a.dtype, group.rank(), plain, (choice.tile_m, choice.tile_n), res,
                lambda tiles: rt.grid_ctas(rt.gemm_grid(res.name, rt.GEMM_GRID), res.sm_count, tiles,
                                           rt.sm_reserve(res.name, rt.SM_RESERVE, rt.nccl_max_ctas(group))),
                rt.SWIZZLE, kernels.RASTERS[rt.RASTER], choice.b_layout, a.device)
            launch = (launch, choice)
        launches[pkey] = launch
    if launch[0] == "peer":
        rt.stats["peer_skip"] += 1
        rt._note(f"peer:{launch[1]}", logging.INFO, "flashoverlap: %s takes the NCCL route: %s", collective, launch[1])
        return None
    plaunch, choice = launch
    cur = torch.cuda.current_stream(a.device)
    slot = res.slot(cur)
    if slot is None or not peer_route.owns(group, a.device, cur):
        rt.stats["peer_skip"] += 1
        rt._note("peer:stream", logging.INFO, "flashoverlap: %s takes the NCCL route: the peer route runs on one "
                 "caller stream per device and group", collective)
        return None
    out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    b_in, ldb = rt._kernel_b(b, choice)
    peer_route.execute(plaunch, rt._row_major(a), b_in, ldb, opnd.bias, out, group, res, slot, cur,
                       kernels.SIGNAL_MODES[rt.SIGNAL_MODE], kernels.RASTERS[rt.RASTER], rt.SWIZZLE,
                       max(1, int(config.wait_timeout_ms * 1e6)))
    rt.last_launch = plaunch
    rt.stats[f"fused:{collective}"] += 1
    rt.stats["route:peer"] += 1
    return out
