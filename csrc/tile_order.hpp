// Tile-row order for the sm90 persistent tile scheduler (ours): the GEMM computes its tile-rows in a per-launch
// order, so a wave group can be any set of tile-rows while A and D keep their natural row order.
//
// The scheduler walks tiles exactly as CUTLASS's PersistentTileSchedulerSm90 does (raster order, swizzle,
// clusters, persistent or one CTA per tile), producing a *scheduled* tile-row s; before the work tile reaches the
// kernel, s is replaced by the physical tile-row
//
//     M_idx := tile_row_order[s]        (0 <= s < tile_rows; nullptr = identity, padding tiles s >= tile_rows kept)
//
// Invariants the caller guarantees (plan.py builds the table): tile_row_order is a permutation of
// [0, tile_rows), tile_rows = ceil(M / tile_m), and the table lives in device memory for the whole launch.
// Everything downstream -- the mainloop's A loads, the epilogue's D stores and the signal node's group lookup --
// reads the remapped M_idx, so loads, stores and counters stay consistent. CTAs of one cluster keep their common
// N_idx (B multicast) and, for clusters along N, their common scheduled s and hence physical row (A multicast).
//
// Only the work-producing entry points are shadowed: initial_work_tile_info, get_current_work and both
// fetch_next_work overloads (the CRTP base calls its own get_current_work_for_linear_idx, whose result is
// remapped here). is_last_tile and the other helpers only test validity, which the remap does not change.
#pragma once

#include "cutlass/gemm/kernel/tile_scheduler.hpp"

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
  };

  struct Params : BaseParams {
    int const* tile_row_order = nullptr;
    int tile_rows = 0;
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
    return p;
  }

  CUTLASS_HOST_DEVICE RowOrderTileSchedulerSm90() {}
  CUTLASS_DEVICE explicit RowOrderTileSchedulerSm90(Params const& p)
      : Base(p), order_(p.tile_row_order), tile_rows_(p.tile_rows) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape cluster_shape) {
    return remap(Base::initial_work_tile_info(cluster_shape));
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return remap(Base::get_current_work()); }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    auto next = Base::fetch_next_work(work_tile_info);  // (work, increment_pipe); never "continues" a tile
    return cute::make_tuple(remap(cute::get<0>(next)), cute::get<1>(next));
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo remap(WorkTileInfo w) const {
    if (order_ != nullptr && w.is_valid() && w.M_idx >= 0 && w.M_idx < tile_rows_) {
      w.M_idx = __ldg(order_ + w.M_idx);
    }
    return w;
  }

  int const* order_ = nullptr;
  int tile_rows_ = 0;
};

}  // namespace flashoverlap

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<flashoverlap::RowOrderScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = flashoverlap::RowOrderTileSchedulerSm90;
};

}  // namespace cutlass::gemm::kernel::detail
