// Tile-row order for the sm90 persistent tile scheduler (ours): the GEMM computes its tile-rows in a per-launch
// order, so a wave group can be any set of tile-rows while A and D keep their natural row order.
//
// The scheduler walks tiles as CUTLASS's PersistentTileSchedulerSm90 does (raster order, swizzle, clusters),
// producing a *scheduled* tile-row s; before the work tile reaches the kernel, s is replaced by the physical
// tile-row
//
//     M_idx := tile_row_order[s]        (0 <= s < tile_rows; nullptr = identity, padding tiles s >= tile_rows kept)
//
// Invariants the caller guarantees (plan.py builds the table): tile_row_order is a permutation of
// [0, tile_rows), tile_rows = ceil(M / tile_m), and the table lives in device memory for the whole launch.
// Everything downstream -- the mainloop's A loads, the epilogue's D stores and the signal node's group lookup --
// reads the remapped M_idx, so loads, stores and counters stay consistent. CTAs of one cluster keep their common
// N_idx (B multicast) and, for clusters along N, their common scheduled s and hence physical row (A multicast).
//
// The walk itself: CUTLASS's strided walk (CTA u takes units u, u + U, ...), or, in a grid of more CTAs than SMs
// (Arguments::block_ctas = the SM count), blocks of one wave of CTAs each walking their own tiles in waves
// (tile_walk.hpp), so the CTAs resident at one time compute one compact band and tile-rows complete in order. A unit
// is one cluster: its CTAs stay together.
//
// Every work-producing entry point the sm90 kernels call is shadowed and runs on this class's own linear index:
// the constructor, initial_work_tile_info, get_current_work, advance_to_next_work, both fetch_next_work overloads
// and is_last_tile. The base's (private) index is never read. The static helpers are the base's.
#pragma once

#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "tile_walk.hpp"

namespace flashoverlap {

// Tile-scheduler tag for GemmUniversal<..., RowOrderScheduler>.
struct RowOrderScheduler {};

class RowOrderTileSchedulerSm90 : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using BaseParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  using BaseArguments = typename Base::Arguments;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;

  struct Arguments : BaseArguments {
    int const* tile_row_order = nullptr;  // int32 [tile_rows] on the device; nullptr = natural order
    int block_ctas = 0;                   // > 0: CTAs per block of the blocked walk (tile_walk.hpp); 0 = strided
  };

  struct Params : BaseParams {
    int const* tile_row_order = nullptr;
    int tile_rows = 0;
    int block_ctas = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape, class... Rest>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, Rest... rest) {
    BaseArguments const& base_args = args;
    Params p;
    BaseParams& base_params = p;
    base_params = Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base_args,
                                                rest...);
    p.tile_row_order = args.tile_row_order;
    int const m = int(cute::get<0>(problem_shape_mnkl));
    int const tile_m = int(cute::size<0>(tile_shape));
    p.tile_rows = (m + tile_m - 1) / tile_m;
    p.block_ctas = args.block_ctas;
    return p;
  }

  CUTLASS_HOST_DEVICE RowOrderTileSchedulerSm90() {}
  CUTLASS_DEVICE explicit RowOrderTileSchedulerSm90(Params const& p)
      : Base(p), order_(p.tile_row_order), tile_rows_(p.tile_rows) {
#if defined(__CUDA_ARCH__)
    // The same linear index and grid size as the base's constructor.
    if (p.raster_order_ == RasterOrder::AlongN) {
      linear_ = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x);
    } else {
      linear_ = uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
    }
    total_ = uint64_t(gridDim.x) * uint64_t(gridDim.y) * uint64_t(gridDim.z);
    // A unit is one cluster (consecutive linear indices): its CTAs keep the base's offsets within the cluster.
    uint64_t const cluster = uint64_t(p.divmod_cluster_shape_minor_.divisor) * p.divmod_cluster_shape_major_.divisor;
    unit_ = p.block_ctas > 0 ? cluster : 0;
    block_ = uint64_t(p.block_ctas) / cluster;
    problem_ = p.blocks_per_problem_;
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    return remap(Base::get_current_work_for_linear_idx(walk(linear_)));
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) { linear_ += total_ * uint64_t(advance_count); }

  // This scheduler never splits a tile (no split-K / stream-K): the next work is always the next step's.
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return !Base::get_current_work_for_linear_idx(walk(linear_ + total_ * uint64_t(advance_count))).is_valid();
  }

 private:
  // Strided linear index -> the linear index of the unit computed there (identity for the strided walk); an index
  // >= problem_ is invalid work.
  CUTLASS_DEVICE uint64_t walk(uint64_t linear) const {
    if (unit_ == 0 || block_ == 0) {
      return linear;
    }
    uint64_t const offset = linear % unit_;  // CTA within the cluster
    return blocked_unit(linear / unit_, total_ / unit_, problem_ / unit_, block_) * unit_ + offset;
  }

  CUTLASS_DEVICE WorkTileInfo remap(WorkTileInfo w) const {
    if (order_ != nullptr && w.is_valid() && w.M_idx >= 0 && w.M_idx < tile_rows_) {
      w.M_idx = __ldg(order_ + w.M_idx);
    }
    return w;
  }

  int const* order_ = nullptr;
  int tile_rows_ = 0;
  uint64_t linear_ = 0;
  uint64_t total_ = 0;
  uint64_t unit_ = 0;   // CTAs per unit (one cluster) for the blocked walk; 0 = CUTLASS's strided walk
  uint64_t block_ = 0;  // units per block
  uint64_t problem_ = 0;
};

}  // namespace flashoverlap

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<flashoverlap::RowOrderScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = flashoverlap::RowOrderTileSchedulerSm90;
};

}  // namespace cutlass::gemm::kernel::detail
