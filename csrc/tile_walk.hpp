// Which work unit a CTA of an oversubscribed grid computes at each step (ours; no CUTLASS dependency, so the CPU
// tests compile it with the host compiler).
//
// CUTLASS's persistent scheduler hands CTA u the units u, u + U, u + 2U, ... (U = CTAs in the grid, counted in
// clusters): with one CTA per SM that walks the problem in waves, which keeps tile-rows -- hence wave groups --
// completing in order. When the grid has more CTAs than the GPU has SMs (the fused GEMM's "tilesK" grids), CTAs
// run in launch order instead, and the strided walk would give the first resident CTAs units from the far end of
// the problem. There, CTA u takes k consecutive units instead:
//
//     step i of CTA u  ->  unit  u * k + i                      for u <  r
//                               r * k + (u - r) * (k - 1) + i   for u >= r
//     k = ceil(P / U), r = P - (k - 1) * U   (P = units in the problem; CTAs u >= r take k - 1 units)
//
// Invariants: with strided index s = u + i * U, the map s -> unit is a bijection of [0, P) onto itself (every
// unit is computed exactly once, and a step is valid iff s < P, as in CUTLASS), the identity when U >= P, and the
// units of one CTA are consecutive. The scheduler applies it to cluster units, before raster order and swizzle.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FO_HOST_DEVICE __host__ __device__
#else
#define FO_HOST_DEVICE
#endif

namespace flashoverlap {

// Unit computed at strided index s (= u + i * grid_units) by a grid of grid_units CTAs over problem_units units;
// indices s >= problem_units are returned unchanged (they are invalid either way).
FO_HOST_DEVICE inline uint64_t consecutive_unit(uint64_t s, uint64_t grid_units, uint64_t problem_units) {
  if (grid_units == 0 || grid_units >= problem_units || s >= problem_units) {
    return s;
  }
  uint64_t const k = (problem_units + grid_units - 1) / grid_units;
  uint64_t const r = problem_units - (k - 1) * grid_units;
  uint64_t const u = s % grid_units;
  uint64_t const i = s / grid_units;
  return u < r ? u * k + i : r * k + (u - r) * (k - 1) + i;
}

}  // namespace flashoverlap
