// Which work unit a CTA of an oversubscribed grid computes at each step (ours; no CUTLASS dependency, so the CPU
// tests compile it with the host compiler).
//
// CUTLASS's persistent scheduler hands CTA u the units u, u + U, u + 2U, ... (U = CTAs in the grid, counted in
// units of one cluster): with one CTA per SM that walks the problem in waves, which keeps tile-rows -- hence wave
// groups -- completing in order, and the tiles in flight in one compact band (L2 reuse). When the grid has more
// CTAs than the GPU has SMs (the fused GEMM's "tiles<k>" grids), CTAs run in launch order, a block of about W (one
// wave) at a time, and the strided walk would give the first resident CTAs units from the far end of the problem.
// There, each block of W consecutive CTAs walks its own k * W units in waves:
//
//     step i of CTA u  ->  unit  b * W * k + i * c + p        b = u / W, p = u % W, c = min(W, U - b * W)
//     k = ceil(P / U)                                          (P = units in the problem)
//
// A unit >= P is invalid (the CTA is done), as in CUTLASS. Invariants: the valid (CTA, step) pairs hit every unit of
// [0, P) exactly once; a CTA's units increase with its steps (so a CTA stops at its first invalid step); W >= U
// gives CUTLASS's strided walk, W = 1 k consecutive units per CTA, U >= P the identity (one unit per CTA).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FO_HOST_DEVICE __host__ __device__
#else
#define FO_HOST_DEVICE
#endif

namespace flashoverlap {

// Unit computed at strided index s (= u + i * grid_units) by a grid of grid_units CTAs, in blocks of block_units
// CTAs, over problem_units units (see above); >= problem_units means no work.
FO_HOST_DEVICE inline uint64_t blocked_unit(uint64_t s, uint64_t grid_units, uint64_t problem_units,
                                            uint64_t block_units) {
  if (grid_units == 0 || block_units == 0 || grid_units >= problem_units) {
    return s;
  }
  uint64_t const k = (problem_units + grid_units - 1) / grid_units;
  uint64_t const u = s % grid_units;
  uint64_t const i = s / grid_units;
  if (i >= k) {
    return grid_units * k;  // past every block: invalid (>= problem_units)
  }
  uint64_t const b = u / block_units;
  uint64_t const p = u - b * block_units;
  uint64_t const rest = grid_units - b * block_units;
  uint64_t const c = rest < block_units ? rest : block_units;
  return b * block_units * k + i * c + p;
}

}  // namespace flashoverlap
