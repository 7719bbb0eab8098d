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
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

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

// ---------------------------------------------------------------------------------------------------------------
// Host side: a GemmCall -> the kernel's Params -> one launch, with a per-configuration cache of built Params.
//
// Building Params per launch costs host time the fused ops pay on every call: to_underlying_arguments encodes one
// TMA descriptor per operand (A, B, D, C, aux: a driver entry-point lookup and cuTensorMapEncodeTiled each),
// can_implement checks the problem, and GemmUniversalAdapter's initialize / ClusterLauncher call
// cudaFuncSetAttribute twice per launch. Here a launch looks its key up first and, on a hit, launches with the
// Params built for that key earlier; on a miss it builds them as CUTLASS does and stores them.
//
// The invariant that makes a stale hit impossible: LaunchKey holds every input of the Params, and make_arguments
// reads the key only (never the GemmCall), so the Arguments -- and the Params, which to_underlying_arguments derives
// from the Arguments and the workspace pointer (also in the key) alone: TMA descriptors encode addresses, shapes and
// strides, nothing else -- are a function of the key. Equal keys (compared byte for byte: the key has no padding)
// give equal Params. A new GemmCall field has to go through the key to reach make_arguments (the static_assert on
// sizeof(GemmCall) below points here). The stream is not in the key: it is a launch setting, not a parameter.
// What a launch needs besides the Params is redone on every launch, hit or miss: GemmKernel::initialize_workspace
// (a no-op for this kernel -- PersistentTileSchedulerSm90 and the epilogue nodes need no workspace -- but called as
// GemmUniversalAdapter::initialize calls it, on the launch's stream) and the launch itself. The kernel's function
// attributes (dynamic shared memory size, non-portable cluster size) are set once per device and process
// (preload, or the first launch on the device) instead of at every launch, and the kernel's CUfunction is looked
// up then, for launches through the driver (launch()); a failed launch drops its cache entry and that per-device
// state, so the next launch rebuilds everything.

constexpr int kMaxDevices = 64;
constexpr int kClusterSize = FO_CM * FO_CN;

std::atomic<int> sm_counts[kMaxDevices];           // 0: not read yet
std::atomic<bool> attributes_set[kMaxDevices];     // the kernel's function attributes are set on this device
std::atomic<CUfunction> functions[kMaxDevices];    // the kernel on this device (null: launch through the runtime)

// cuLaunchKernelEx, reached through the runtime once per process (null: unavailable, launch through the runtime).
// Launching the kernel's CUfunction directly takes about 1.5-2 us less host time than cudaLaunchKernelEx with its
// host stub (measured on an H100 host: 3.2-3.9 us against 4.7-5.8 us for this kernel), the same launch otherwise.
using LaunchKernelExFn = CUresult (*)(CUlaunchConfig const*, CUfunction, void**, void**);
LaunchKernelExFn driver_launch() {
  static LaunchKernelExFn const fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<LaunchKernelExFn>(p);
  }();
  return fn;
}

int device_sm_count(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  int v = sm_counts[device].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
    sm_counts[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

// What GemmUniversalAdapter::initialize (smem >= 48 KB) and ClusterLauncher::launch (clusters) set per launch.
cudaError_t set_attributes() {
  auto const kernel = cutlass::device_kernel<GemmKernel>;
  cudaError_t e = cudaSuccess;
  if (GemmKernel::SharedStorageSize >= (48 << 10)) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(GemmKernel::SharedStorageSize));
  }
  if (e == cudaSuccess && kClusterSize > 1) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  }
  if (e != cudaSuccess) cudaGetLastError();  // clear the error state, as CUTLASS does
  return e;
}

// Once per device (the current one): the function attributes, and the kernel's CUfunction for driver launches.
cudaError_t prepare_device(int device) {
  cudaError_t e = set_attributes();
  if (e != cudaSuccess) return e;
  cudaFunction_t f = nullptr;
  if (cudaGetFuncBySymbol(&f, reinterpret_cast<void const*>(&cutlass::device_kernel<GemmKernel>)) != cudaSuccess) {
    cudaGetLastError();
    f = nullptr;  // launches go through the runtime
  }
  functions[device].store(f, std::memory_order_relaxed);
  attributes_set[device].store(true, std::memory_order_release);
  return cudaSuccess;
}

cudaError_t ensure_attributes(int device) {
  return attributes_set[device].load(std::memory_order_acquire) ? cudaSuccess : prepare_device(device);
}

// Everything the Params are built from (see above): GemmCall but the stream, plus the device and its SM count.
struct LaunchKey {
  void const* a;
  void const* b;
  void const* bias;
  void* d;
  void const* c;
  void* aux;
  int* counters;
  int const* group_of_tile_row;
  int const* tile_row_order;
  int const* gate_flag;
  int const* gate_target;
  int* gate_error_record;
  void* workspace;
  size_t workspace_bytes;
  int64_t lda, ldb, ldd, ldc, ldaux;
  long long gate_timeout_ns;
  int m, n, k;
  int signal_mode;
  int sm_count;  // as launched: GemmCall::sm_count, or the device's SM count when that is 0
  int raster, swizzle;
  int gate_tag;
  int device;    // the current device at the call (hw_info.device_id)
  int zero;      // always 0: keeps the struct free of padding
};
static_assert(std::has_unique_object_representations_v<LaunchKey>,
              "LaunchKey is hashed and compared byte for byte: it must have no padding");
static_assert(sizeof(LaunchKey) % sizeof(uint64_t) == 0, "LaunchKey is hashed as 64-bit words");
static_assert(sizeof(flashoverlap::GemmCall) == 208,
              "GemmCall changed: put every new field that reaches the kernel into LaunchKey (make_key, "
              "make_arguments), then update this size");

bool make_key(flashoverlap::GemmCall const& c, LaunchKey& key, std::string& err) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    err = std::string("cudaGetDevice: ") + cudaGetErrorString(e);
    return false;
  }
  int const total = device_sm_count(device);
  if (total <= 0) {
    err = "could not read the device's multiprocessor count";
    return false;
  }
  key = LaunchKey{};
  key.a = c.a, key.b = c.b, key.bias = c.bias, key.d = c.d, key.c = c.c, key.aux = c.aux;
  key.counters = c.counters, key.group_of_tile_row = c.group_of_tile_row, key.tile_row_order = c.tile_row_order;
  key.gate_flag = c.gate_flag, key.gate_target = c.gate_target, key.gate_error_record = c.gate_error_record;
  key.workspace = c.workspace, key.workspace_bytes = c.workspace_bytes;
  key.lda = c.lda, key.ldb = c.ldb, key.ldd = c.ldd, key.ldc = c.ldc, key.ldaux = c.ldaux;
  key.gate_timeout_ns = c.gate_timeout_ns;
  key.m = c.m, key.n = c.n, key.k = c.k;
  key.signal_mode = c.signal_mode;
  // sm_count > total launches more CTAs than SMs: with sm_count >= tiles every CTA owns one tile (not persistent),
  // so the hardware hands SMs freed by finished tiles to higher-priority kernels (NCCL) first.
  key.sm_count = c.sm_count > 0 ? c.sm_count : total;
  key.raster = c.raster, key.swizzle = c.swizzle;
  key.gate_tag = c.gate_tag;
  key.device = device;
  return true;
}

// The Arguments of a launch, from its key alone (the cache's invariant: nothing else may be read here).
bool make_arguments(LaunchKey const& c, typename Gemm::Arguments& args, std::string& err) {
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
  args.hw_info.device_id = c.device;
  args.hw_info.sm_count = c.sm_count;
  args.scheduler.max_swizzle_size = c.swizzle > 0 ? c.swizzle : 1;
  args.scheduler.tile_row_order = c.tile_row_order;
  args.scheduler.raster_order = c.raster == 1   ? RasterOrder::AlongM
                                : c.raster == 2 ? RasterOrder::AlongN
                                                : RasterOrder::Heuristic;
  return true;
}

// One built launch: what the cache keeps per key (immutable once built; shared with launches in flight on other
// threads, so a hit neither copies it nor holds the cache's lock while it launches).
struct Launch {
  typename Gemm::Arguments args;  // for initialize_workspace, which runs at every launch
  typename GemmKernel::Params params;
  dim3 grid;
};
using LaunchPtr = std::shared_ptr<Launch const>;

// A miss: validate and build as GemmUniversalAdapter::initialize does (the function attributes once per device).
int prepare(LaunchKey const& key, Launch& l, std::string& err) {
  if (!make_arguments(key, l.args, err)) return 2;
  if (Gemm::can_implement(l.args) != cutlass::Status::kSuccess) {
    err = std::string(FO_NAME) +
          ": CUTLASS cannot implement this problem (K, N and every row stride must be multiples of 8 elements and "
          "every pointer 16-byte aligned)";
    return 3;
  }
  size_t need = Gemm::get_workspace_size(l.args);
  if (need > key.workspace_bytes || (need > 0 && key.workspace == nullptr)) {
    err = std::string(FO_NAME) + ": workspace too small: need " + std::to_string(need) + " bytes";
    return 4;
  }
  cudaError_t e = ensure_attributes(key.device);
  if (e != cudaSuccess) {
    err = std::string(FO_NAME) + ": initialize failed: setting the kernel's attributes: " + cudaGetErrorString(e);
    return 5;
  }
  l.params = GemmKernel::to_underlying_arguments(l.args, key.workspace);
  l.grid = GemmKernel::get_grid_shape(l.params);
  if (l.grid.x % unsigned(FO_CM) != 0 || l.grid.y % unsigned(FO_CN) != 0) {  // ClusterLauncher's check
    err = std::string(FO_NAME) + ": launch failed: the grid is not a whole number of clusters";
    return 6;
  }
  return 0;
}

// Every launch, hit or miss: the workspace initialization, then the launch GemmUniversalAdapter::run makes (grid,
// block, dynamic shared memory, the cluster dimension unless 1x1x1, no PDL): by the driver with the kernel's
// CUfunction on `device` when there is one, else -- or when that fails, e.g. no context is current on this thread
// yet -- as CUTLASS makes it (a plain launch for 1x1x1 clusters, else cudaLaunchKernelEx), which also reports the
// error.
int launch(Launch const& l, int device, void* workspace, cudaStream_t stream, std::string& err) {
  cutlass::Status s = GemmKernel::initialize_workspace(l.args, workspace, stream);
  if (s != cutlass::Status::kSuccess) {
    cudaError_t e = cudaGetLastError();
    err = std::string(FO_NAME) + ": initialize failed: " + cutlassGetStatusString(s) + " / " + cudaGetErrorString(e);
    return 5;
  }
  dim3 const block = GemmKernel::get_block_shape();
  int const smem = int(GemmKernel::SharedStorageSize);
  void* kernel_params[] = {const_cast<typename GemmKernel::Params*>(&l.params)};  // read only
  CUfunction const function = functions[device].load(std::memory_order_relaxed);
  LaunchKernelExFn const driver = driver_launch();
  if (function != nullptr && driver != nullptr) {
    CUlaunchAttribute attr[1];
    attr[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr[0].value.clusterDim.x = FO_CM;
    attr[0].value.clusterDim.y = FO_CN;
    attr[0].value.clusterDim.z = 1;
    CUlaunchConfig cfg{};
    cfg.gridDimX = l.grid.x, cfg.gridDimY = l.grid.y, cfg.gridDimZ = l.grid.z;
    cfg.blockDimX = block.x, cfg.blockDimY = block.y, cfg.blockDimZ = block.z;
    cfg.sharedMemBytes = unsigned(smem);
    cfg.hStream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = kClusterSize > 1 ? 1 : 0;
    if (driver(&cfg, function, kernel_params, nullptr) == CUDA_SUCCESS) {
      cudaError_t const e = cudaGetLastError();  // as after every CUTLASS launch
      if (e == cudaSuccess) return 0;
      err = std::string(FO_NAME) + ": launch failed: " + cudaGetErrorString(e);
      return 6;
    }
  }
  cudaError_t e = cudaSuccess;
  if constexpr (kClusterSize == 1) {
    cutlass::device_kernel<GemmKernel><<<l.grid, block, smem, stream>>>(l.params);
  } else {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = FO_CM;
    attr[0].val.clusterDim.y = FO_CN;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = l.grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaLaunchKernelExC(&cfg, reinterpret_cast<void const*>(&cutlass::device_kernel<GemmKernel>), kernel_params);
  }
  cudaError_t const last = cudaGetLastError();
  if (e == cudaSuccess) e = last;
  if (e != cudaSuccess) {
    err = std::string(FO_NAME) + ": launch failed: " + cudaGetErrorString(e);
    return 6;
  }
  return 0;
}

uint64_t hash_key(LaunchKey const& key) {
  uint64_t w[sizeof(LaunchKey) / sizeof(uint64_t)];
  std::memcpy(w, &key, sizeof(LaunchKey));
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (uint64_t x : w) {
    h = (h ^ x) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  return h;
}

// The bounded cache of built launches: kSets x kWays slots, a key's set chosen by its hash, least recently used
// replaced within a set. 256 launches per configuration: a ring call alone makes up to world x rounds distinct GEMM
// launches (pointers differ per step), and a model repeats that per layer (weights differ per layer); a working
// set larger than this degrades per set, not all at once as one LRU list would. Slots are allocated at the first
// store (64 KB, plus about 2 KB per launch kept). One mutex: host threads may launch concurrently.
class LaunchCache {
 public:
  static constexpr int kSets = 64;
  static constexpr int kWays = 4;

  LaunchPtr find(LaunchKey const& key, uint64_t hash) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot* s = lookup(key, hash);
    if (s == nullptr) return nullptr;
    s->last_use = ++tick_;
    return s->launch;  // shared: the slot may be replaced while the caller launches
  }

  void store(LaunchKey const& key, uint64_t hash, LaunchPtr launch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!slots_) slots_.reset(new Slot[kSets * kWays]());
    Slot* s = lookup(key, hash);  // another thread may have stored the same key meanwhile
    if (s == nullptr) {
      Slot* set = &slots_[(hash >> 7) % kSets * kWays];
      s = set;
      for (int w = 1; w < kWays; ++w) {
        if (set[w].last_use < s->last_use) s = &set[w];  // empty slots have last_use 0
      }
    }
    s->hash = hash;
    s->key = key;
    s->launch = std::move(launch);
    s->last_use = ++tick_;
  }

  void forget(LaunchKey const& key, uint64_t hash) {
    std::lock_guard<std::mutex> lock(mu_);
    if (Slot* s = lookup(key, hash)) {
      s->last_use = 0;
      s->launch.reset();
    }
  }

 private:
  struct Slot {
    uint64_t last_use = 0;  // 0: empty
    uint64_t hash = 0;
    LaunchKey key{};
    LaunchPtr launch;
  };

  Slot* lookup(LaunchKey const& key, uint64_t hash) {
    if (!slots_) return nullptr;
    Slot* set = &slots_[(hash >> 7) % kSets * kWays];
    for (int w = 0; w < kWays; ++w) {
      Slot& s = set[w];
      if (s.last_use != 0 && s.hash == hash && std::memcmp(&s.key, &key, sizeof(LaunchKey)) == 0) return &s;
    }
    return nullptr;
  }

  std::mutex mu_;
  std::unique_ptr<Slot[]> slots_;
  uint64_t tick_ = 0;
};

LaunchCache& launch_cache() {
  static LaunchCache* cache = new LaunchCache;  // never destroyed: host threads may still launch at exit
  return *cache;
}

size_t workspace_size(flashoverlap::GemmCall const& c) {
  LaunchKey key;
  typename Gemm::Arguments args;
  std::string err;
  if (!make_key(c, key, err) || !make_arguments(key, args, err)) return 0;
  return Gemm::get_workspace_size(args);
}

int run(flashoverlap::GemmCall const& c, std::string& err) {
  LaunchKey key;
  if (!make_key(c, key, err)) return 2;
  bool const cached = flashoverlap::gemm_cache_enabled();
  uint64_t const hash = cached ? hash_key(key) : 0;
  LaunchPtr l = cached ? launch_cache().find(key, hash) : nullptr;
  bool const hit = l != nullptr;
  if (!hit) {
    auto built = std::shared_ptr<Launch>(new Launch);
    int rc = prepare(key, *built, err);
    if (rc != 0) return rc;
    l = std::move(built);
    if (cached) launch_cache().store(key, hash, l);
  }
  flashoverlap::count_gemm_launch(hit);
  int rc = launch(*l, key.device, key.workspace, c.stream, err);
  if (rc != 0) {  // rebuild from scratch next time (function attributes included)
    if (cached) launch_cache().forget(key, hash);
    attributes_set[key.device].store(false, std::memory_order_release);
  }
  return rc;
}

int preload(std::string& err) {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, cutlass::device_kernel<GemmKernel>);
  int device = 0;
  if (e == cudaSuccess) e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = device >= 0 && device < kMaxDevices ? prepare_device(device) : set_attributes();
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
