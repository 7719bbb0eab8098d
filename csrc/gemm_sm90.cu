// One sm90 signal-GEMM configuration, assembled from CUTLASS CollectiveBuilder parts (examples 48/49 style).
//
// Compiled once per configuration by flashoverlap_inductor/build.py, which defines the FO_* macros:
//   FO_NAME "coop_128x256x64_c2x1"   configuration name (without dtype / B layout)
//   FO_SCHED 0|1                      0 = cooperative (2 consumer warpgroups share a tile), 1 = ping-pong
//   FO_TM FO_TN FO_TK                 CTA tile
//   FO_CM FO_CN                       cluster shape (TMA multicast)
//   FO_STAGES                         mainloop stages, 0 = as many as fit next to the epilogue
//   FO_EPI_M FO_EPI_N                 epilogue subtile, 0 = CUTLASS's choice
//   FO_DTYPE 0|1                      bf16 | fp16 inputs and output, fp32 accumulation
//   FO_BLAYOUT 0|1                    B as [N,K] (K contiguous, a Linear weight) | [K,N] (N contiguous)
//   FO_ADD_C 0|1|2|3                  1: D = round(A @ B (+ bias)) + C, C a [M,N] row-major operand of the output
//                                     type read by TMA (the peer route's second GEMM: C is the peer's partial sum,
//                                     read straight from its memory over NVLink); 2 and 3: also store D a second
//                                     time, to an aux [M,N] tensor (the peer's memory: all_reduce's other half),
//                                     2 through shared memory and TMA, 3 straight from registers (no shared memory)
//
// D = A @ B (+ bias), then the tile-signal EVT node (tile_signal.hpp). The bias is a row broadcast with a
// nullptr fallback, so one kernel serves both. A persistent tile scheduler walks the tiles in the raster order
// and swizzle given at launch, its tile-rows in the launch's tile-row order (tile_order.hpp; nullptr = natural);
// hw_info.sm_count limits the SMs it uses.
#include <cstdio>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "registry.hpp"
#include "tile_order.hpp"
#include "tile_signal.hpp"

#if !defined(FO_NAME) || !defined(FO_SCHED) || !defined(FO_TM) || !defined(FO_TN) || !defined(FO_TK) || \
    !defined(FO_CM) || !defined(FO_CN) || !defined(FO_DTYPE) || !defined(FO_BLAYOUT)
#error "gemm_sm90.cu is compiled by flashoverlap_inductor/build.py, which defines the FO_* configuration macros"
#endif
#ifndef FO_STAGES
#define FO_STAGES 0
#endif
#ifndef FO_EPI_M
#define FO_EPI_M 0
#define FO_EPI_N 0
#endif
#ifndef FO_ADD_C
#define FO_ADD_C 0
#endif

namespace {

// No `using namespace cute`: it would make cute's own anonymous namespace ambiguous with this one in the
// host stub nvcc generates for device_kernel<GemmKernel>.
using cute::_0;
using cute::_1;
using cute::get;
using cute::Int;
using cute::Shape;
using cute::Stride;
namespace fus = cutlass::epilogue::fusion;

#if FO_DTYPE == 0
using Element = cutlass::bfloat16_t;
#else
using Element = cutlass::half_t;
#endif
using LayoutA = cutlass::layout::RowMajor;
#if FO_BLAYOUT == 0
using LayoutB = cutlass::layout::ColumnMajor;  // B(k, n) at n * ldb + k: the [N,K] weight
#else
using LayoutB = cutlass::layout::RowMajor;  // B(k, n) at k * ldb + n
#endif
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA alignment

using TileShape = Shape<Int<FO_TM>, Int<FO_TN>, Int<FO_TK>>;
using ClusterShape = Shape<Int<FO_CM>, Int<FO_CN>, _1>;

#if FO_SCHED == 0
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#else
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#endif

#if FO_EPI_N > 0
using EpilogueTile = Shape<Int<FO_EPI_M>, Int<FO_EPI_N>>;
#else
using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
#endif

// acc + bias[n] in fp32, rounded to the output type, then the signal node (identity on values).
using Bias = fus::Sm90RowBroadcast<0, TileShape, Element, float, Stride<_0, _1, _0>, kAlign>;
using AddBias = fus::Sm90EVT<fus::Sm90Compute<cutlass::plus, Element, float, cutlass::FloatRoundStyle::round_to_nearest>,
                             fus::Sm90AccFetch, Bias>;
#if FO_ADD_C
// (acc + bias) is rounded to the output type first, then C is added in fp32 and the sum rounded once more: for two
// ranks this is exactly the bf16/fp16 sum NCCL forms of the two rounded partials.
using AddPeer = fus::Sm90EVT<fus::Sm90Compute<cutlass::plus, Element, float, cutlass::FloatRoundStyle::round_to_nearest>,
                             AddBias, fus::Sm90SrcFetch<Element>>;
#if FO_ADD_C >= 2
using StrideAux = cutlass::gemm::TagToStrideC_t<LayoutD>;
namespace epi_detail = cutlass::epilogue::collective::detail;
#if FO_ADD_C == 2
using AuxAtom = decltype(epi_detail::sm90_get_epilogue_smem_swizzle_layout_atom<StrideAux, Element, EpilogueTile>());
using AuxR2S = decltype(epi_detail::sm90_get_smem_store_op_for_accumulator<StrideAux, Element, EpilogueTile>());
using AuxStore = fus::Sm90AuxStore<2, EpilogueTile, Element, cutlass::FloatRoundStyle::round_to_nearest, StrideAux,
                                   AuxAtom, AuxR2S, kAlign>;
#else
using AuxStore = fus::Sm90AuxStore<0, EpilogueTile, Element, cutlass::FloatRoundStyle::round_to_nearest, StrideAux,
                                   void, void, kAlign>;
#endif
using Fusion = fus::Sm90EVT<flashoverlap::Sm90TileSignal, fus::Sm90EVT<AuxStore, AddPeer>>;
#else
using Fusion = fus::Sm90EVT<flashoverlap::Sm90TileSignal, AddPeer>;
#endif
using ElementC = Element;
#else
using Fusion = fus::Sm90EVT<flashoverlap::Sm90TileSignal, AddBias>;
using ElementC = void;  // no C operand
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, float, float,
    ElementC, LayoutD, kAlign,
    Element, LayoutD, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;

#if FO_STAGES > 0
using StageCount = cutlass::gemm::collective::StageCount<FO_STAGES>;
#else
using StageCount = cutlass::gemm::collective::StageCountAutoCarveout<
    static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;
#endif

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign, float,
    TileShape, ClusterShape, StageCount, MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue, flashoverlap::RowOrderScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using RasterOrder = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;

int device_sm_count(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    cached[device] = v;
  }
  return cached[device];
}

bool make_arguments(flashoverlap::GemmCall const& c, typename Gemm::Arguments& args, std::string& err) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    err = std::string("cudaGetDevice: ") + cudaGetErrorString(e);
    return false;
  }
  int total = device_sm_count(device);
  if (total <= 0) {
    err = "could not read the device's multiprocessor count";
    return false;
  }
  int64_t const M = c.m, N = c.n;
  typename GemmKernel::StrideA sA{};
  get<0>(sA) = c.lda;
  get<2>(sA) = M * c.lda;
  typename GemmKernel::StrideB sB{};
#if FO_BLAYOUT == 0
  get<0>(sB) = c.ldb;
  get<2>(sB) = N * c.ldb;
#else
  get<1>(sB) = c.ldb;
  get<2>(sB) = int64_t(c.k) * c.ldb;
#endif
  typename GemmKernel::StrideD sD{};
  get<0>(sD) = c.ldd;
  get<2>(sD) = M * c.ldd;
#if FO_ADD_C
  if (c.c == nullptr) {
    err = std::string(FO_NAME) + ": this configuration adds a C operand, and none was given";
    return false;
  }
  typename GemmKernel::StrideC sC{};
  get<0>(sC) = c.ldc;
  get<2>(sC) = M * c.ldc;
#else
  if (c.c != nullptr) {
    err = std::string(FO_NAME) + ": this configuration has no C operand (use an _addc configuration)";
    return false;
  }
#endif
#if FO_ADD_C >= 2
  if (c.aux == nullptr) {
    err = std::string(FO_NAME) + ": this configuration stores an aux copy of D, and no aux tensor was given";
    return false;
  }
  StrideAux sAux{};
  get<0>(sAux) = c.ldaux;
  get<2>(sAux) = M * c.ldaux;
#else
  if (c.aux != nullptr) {
    err = std::string(FO_NAME) + ": this configuration has no aux output";
    return false;
  }
#endif

  args = typename Gemm::Arguments{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {c.m, c.n, c.k, 1};
  args.mainloop.ptr_A = static_cast<Element const*>(c.a);
  args.mainloop.dA = sA;
  args.mainloop.ptr_B = static_cast<Element const*>(c.b);
  args.mainloop.dB = sB;
  args.epilogue.ptr_D = static_cast<Element*>(c.d);
  args.epilogue.dD = sD;
#if FO_ADD_C
  args.epilogue.ptr_C = static_cast<Element const*>(c.c);
  args.epilogue.dC = sC;
#if FO_ADD_C >= 2
  auto& bias_args = args.epilogue.thread.op_0.op_0.op_0.op_1;  // (AddPeer = (AddBias, SrcFetch, plus), AuxStore)
  args.epilogue.thread.op_0.op_1.ptr_aux = static_cast<Element*>(c.aux);
  args.epilogue.thread.op_0.op_1.dAux = sAux;
#else
  auto& bias_args = args.epilogue.thread.op_0.op_0.op_1;  // AddPeer = (AddBias, SrcFetch, plus)
#endif
#else
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = sD;
  auto& bias_args = args.epilogue.thread.op_0.op_1;  // AddBias = (AccFetch, Bias, plus)
#endif
  bias_args.ptr_row = static_cast<Element const*>(c.bias);
  bias_args.null_default = Element(0);
  auto& signal_args = args.epilogue.thread.op_1;  // Fusion = (AddBias, TileSignal)
  signal_args.counters = c.counters;
  signal_args.group_of_tile_row = c.group_of_tile_row;
  signal_args.mode = c.signal_mode;
  signal_args.gate_flag = c.gate_flag;
  signal_args.gate_target = c.gate_target;
  signal_args.gate_timeout_ns = c.gate_timeout_ns;
  signal_args.gate_error_record = c.gate_error_record;
  signal_args.gate_tag = c.gate_tag;
#if !FO_ADD_C
  if (c.gate_flag != nullptr) {
    err = std::string(FO_NAME) + ": a peer gate needs an _addc configuration (it guards the C load)";
    return false;
  }
#endif
  args.hw_info.device_id = device;
  // sm_count > total launches more CTAs than SMs: with sm_count >= tiles every CTA owns one tile (not persistent),
  // so the hardware hands SMs freed by finished tiles to higher-priority kernels (NCCL) first.
  args.hw_info.sm_count = c.sm_count > 0 ? c.sm_count : total;
  args.scheduler.max_swizzle_size = c.swizzle > 0 ? c.swizzle : 1;
  args.scheduler.tile_row_order = c.tile_row_order;
  args.scheduler.raster_order = c.raster == 1   ? RasterOrder::AlongM
                                : c.raster == 2 ? RasterOrder::AlongN
                                                : RasterOrder::Heuristic;
  return true;
}

size_t workspace_size(flashoverlap::GemmCall const& c) {
  typename Gemm::Arguments args;
  std::string err;
  if (!make_arguments(c, args, err)) return 0;
  return Gemm::get_workspace_size(args);
}

int run(flashoverlap::GemmCall const& c, std::string& err) {
  typename Gemm::Arguments args;
  if (!make_arguments(c, args, err)) return 2;
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
    err = std::string(FO_NAME) +
          ": CUTLASS cannot implement this problem (K, N and every row stride must be multiples of 8 elements and "
          "every pointer 16-byte aligned)";
    return 3;
  }
  size_t need = Gemm::get_workspace_size(args);
  if (need > c.workspace_bytes || (need > 0 && c.workspace == nullptr)) {
    err = std::string(FO_NAME) + ": workspace too small: need " + std::to_string(need) + " bytes";
    return 4;
  }
  Gemm gemm;
  cutlass::Status s = gemm.initialize(args, c.workspace, c.stream);
  if (s != cutlass::Status::kSuccess) {
    cudaError_t e = cudaGetLastError();
    err = std::string(FO_NAME) + ": initialize failed: " + cutlassGetStatusString(s) + " / " + cudaGetErrorString(e);
    return 5;
  }
  s = gemm.run(c.stream);
  cudaError_t e = cudaGetLastError();
  if (s != cutlass::Status::kSuccess || e != cudaSuccess) {
    err = std::string(FO_NAME) + ": launch failed: " + cutlassGetStatusString(s) + " / " + cudaGetErrorString(e);
    return 6;
  }
  return 0;
}

int preload(std::string& err) {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, cutlass::device_kernel<GemmKernel>);
  if (e == cudaSuccess && GemmKernel::SharedStorageSize >= (48 << 10)) {
    e = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(GemmKernel::SharedStorageSize));
  }
  if (e != cudaSuccess) {
    err = std::string(FO_NAME) + ": loading the kernel failed: " + cudaGetErrorString(e);
    return 7;
  }
  return 0;
}

struct Registrar {
  Registrar() {
    flashoverlap::GemmConfig cfg{FO_NAME,  FO_TM,      FO_TN,           FO_TK, FO_CM, FO_CN, FO_SCHED, FO_STAGES,
                                 FO_EPI_M, FO_EPI_N,   FO_DTYPE,        FO_BLAYOUT, FO_ADD_C, &workspace_size,
                                 &run,     &preload};
    flashoverlap::register_config(cfg);
  }
};
Registrar registrar;

}  // namespace
