// fo_grouped_gemm: the experts' grouped GEMM of a MoE layer with its row offsets on the device (the ABI in
// flashoverlap_sm90.h): for each expert e of [first, last), rows [start_e, end_e) of A times expert e's weight,
// written to the same rows of D, with start_e = max(0, offs[0 .. e-1]) and end_e = max(0, offs[0 .. e]) (running
// maxima: good offsets are non-decreasing, so these are offs[e - 1] and offs[e]), both at most rows: bad offsets give
// experts fewer rows, never overlapping ones or rows outside A or D. No host read, so a
// caller can cut the experts into pieces ([0, E/2), then [E/2, E)) whose rows lie anywhere in one buffer and whose
// results land in one output, in expert order, with no copy (torch._grouped_mm returns a fresh tensor per call);
// with `range` the piece's expert bounds are read on the device too (the MoE dispatch's cut by expert computes them
// from the routing, routes/moe_expert_cut.py).
//
// One CUTLASS sm90 ptr-array grouped kernel per B layout (cooperative, 128x256x64 tiles, a 1x2 cluster multicasting
// A along N, bf16 in and out, fp32 accumulation), persistent over the SMs; its per-group problem shapes, pointers and strides
// are written on the stream by a small kernel from `offs` into the caller's workspace (fo_grouped_gemm_workspace
// says how large), so the host knows only the piece's expert range. B is each expert's Linear weight ([N, K], K
// contiguous; b_layout 0) or a [K, N] matrix (N contiguous; b_layout 1), `w_stride` elements apart.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "flashoverlap_sm90.h"
#include "route_util.hpp"

// The ctypes mirror's layout (native/grouped.py; tests/test_grouped_gemm.py compares every field's offset).
static_assert(sizeof(fo_grouped_gemm_args) == 136 && offsetof(fo_grouped_gemm_args, stream) == 128,
              "fo_grouped_gemm_args layout");

namespace {

using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;
using cute::Shape;

using Element = cutlass::bfloat16_t;
using Accumulator = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using Shape3 = typename ProblemShape::UnderlyingProblemShape;
using LayoutA = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 8 elements: TMA's 16 bytes
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_1, _2, _1>;

// The per-group arrays at the workspace's start, each 128-byte aligned; CUTLASS's own workspace after them.
struct Layout {
  size_t shapes, a, b, d, sa, sb, sd, cutlass, total;
};

constexpr size_t round_up(size_t x) { return (x + 127) / 128 * 128; }

__device__ __forceinline__ long long load_off(void const* p, int bytes, long long i) {
  return bytes == 4 ? (long long)static_cast<int const*>(p)[i] : static_cast<long long const*>(p)[i];
}

// One B layout's kernel types, assembled at namespace scope (the CollectiveBuilders do not instantiate inside a class
// template under nvcc's host compiler): LayoutB ColumnMajor reads B(k, n) at n * K + k (each expert's Linear weight
// [N, K], b_layout 0), RowMajor at k * N + n (a [K, N] matrix, N contiguous: the backward's down projection as
// stored, b_layout 1).
#define FO_GROUPED_KERNEL(NS, LAYOUT_B)                                                                               \
  namespace NS {                                                                                                     \
  using LayoutB = LAYOUT_B;                                                                                          \
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<                                        \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,                                  \
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator, void, LayoutD*, kAlign, Element,    \
      LayoutD*, kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;                     \
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<                                            \
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,     \
      Accumulator, TileShape, ClusterShape,                                                                          \
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>, \
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;                                     \
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;                             \
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;                                                  \
  }

FO_GROUPED_KERNEL(by_linear, cutlass::layout::ColumnMajor)
FO_GROUPED_KERNEL(by_rows, cutlass::layout::RowMajor)
#undef FO_GROUPED_KERNEL

// A kernel's workspace layout, arguments and B stride; Gemm one of the two above.
template <class GemmT, bool RowMajorB>
struct Grouped {
  using Gemm = GemmT;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;
  static constexpr bool kRowMajorB = RowMajorB;

  static Layout layout_for(int groups, size_t cutlass_bytes) {
    Layout l{};
    size_t at = 0;
    l.shapes = at; at += round_up(sizeof(Shape3) * groups);
    l.a = at; at += round_up(sizeof(void*) * groups);
    l.b = at; at += round_up(sizeof(void*) * groups);
    l.d = at; at += round_up(sizeof(void*) * groups);
    l.sa = at; at += round_up(sizeof(StrideA) * groups);
    l.sb = at; at += round_up(sizeof(StrideB) * groups);
    l.sd = at; at += round_up(sizeof(StrideD) * groups);
    l.cutlass = at; at += round_up(cutlass_bytes);
    l.total = at;
    return l;
  }

  static typename Gemm::Arguments arguments(fo_grouped_gemm_args const& a, char* ws, Layout const& l, int sm_count) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {a.last - a.first, reinterpret_cast<Shape3*>(ws + l.shapes), nullptr};
    args.mainloop = {reinterpret_cast<Element const**>(ws + l.a), reinterpret_cast<StrideA*>(ws + l.sa),
                     reinterpret_cast<Element const**>(ws + l.b), reinterpret_cast<StrideB*>(ws + l.sb)};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = reinterpret_cast<Element**>(ws + l.d);
    args.epilogue.dD = reinterpret_cast<StrideD*>(ws + l.sd);
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info.device_id = a.device;
    args.hw_info.sm_count = sm_count;
    return args;
  }

  static Layout layout(fo_grouped_gemm_args const& a, int sm_count) {
    Layout bare = layout_for(a.last - a.first, 0);
    return layout_for(a.last - a.first, Gemm::get_workspace_size(arguments(a, nullptr, bare, sm_count)));
  }
};

using ByLinear = Grouped<by_linear::Gemm, false>;
using ByRows = Grouped<by_rows::Gemm, true>;

// One thread per group g = e - first: its problem shape, pointers and strides (O(e) reads of offs: a few hundred
// experts at most in practice).
template <class G>
__global__ void fill_groups(fo_grouped_gemm_args a, char* ws, Layout l) {
  int g = blockIdx.x * blockDim.x + threadIdx.x;
  int groups = a.last - a.first;
  if (g >= groups) return;
  long long e = a.first + g;
  long long rows = a.rows;
  long long start = 0, end = 0;  // the running maxima of offs[0 .. e-1] and offs[0 .. e]: never overlapping
  for (long long j = 0; j <= e; ++j) {
    start = end;
    long long o = load_off(a.offs, a.offs_bytes, j);
    end = o > end ? o : end;
  }
  start = start > rows ? rows : start;
  end = end > rows ? rows : end;
  if (a.range != nullptr && (e < a.range[0] || e >= a.range[1])) end = start;  // outside the device's piece
  reinterpret_cast<Shape3*>(ws + l.shapes)[g] = Shape3{int(end - start), int(a.n), int(a.k)};
  reinterpret_cast<Element const**>(ws + l.a)[g] = static_cast<Element const*>(a.a) + start * a.lda;
  reinterpret_cast<Element const**>(ws + l.b)[g] = static_cast<Element const*>(a.w) + e * a.w_stride;
  reinterpret_cast<Element**>(ws + l.d)[g] = static_cast<Element*>(a.d) + start * a.ldd;
  typename G::StrideA sa{};
  cute::get<0>(sa) = a.lda;
  typename G::StrideB sb{};
  if constexpr (G::kRowMajorB) {
    cute::get<1>(sb) = a.n;  // (n, k) at k * N + n
  } else {
    cute::get<0>(sb) = a.k;  // (n, k) at n * K + k
  }
  typename G::StrideD sd{};
  cute::get<0>(sd) = a.ldd;
  reinterpret_cast<typename G::StrideA*>(ws + l.sa)[g] = sa;
  reinterpret_cast<typename G::StrideB*>(ws + l.sb)[g] = sb;
  reinterpret_cast<typename G::StrideD*>(ws + l.sd)[g] = sd;
}

int sm_count_of(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return 0;
  if (!counts[device]) cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device);
  return counts[device];
}

template <class G>
int run(fo_grouped_gemm_args const& a, int sms) {
  using flashoverlap::fail_code;
  Layout l = G::layout(a, sms);
  if (a.workspace_bytes < static_cast<int64_t>(l.total) || reinterpret_cast<uintptr_t>(a.workspace) % 128)
    return fail_code(2, "fo_grouped_gemm: the workspace must start on 128 bytes and hold fo_grouped_gemm_workspace's "
                        "bytes");
  auto stream = static_cast<cudaStream_t>(a.stream);
  char* ws = static_cast<char*>(a.workspace);
  int groups = a.last - a.first;
  fill_groups<G><<<(groups + 127) / 128, 128, 0, stream>>>(a, ws, l);
  if (int rc = flashoverlap::cuda_check(cudaGetLastError(), "fo_grouped_gemm: fill_groups")) return rc;
  typename G::Gemm gemm;
  typename G::Gemm::Arguments gargs = G::arguments(a, ws, l, sms);
  if (gemm.can_implement(gargs) != cutlass::Status::kSuccess) return fail_code(2, "fo_grouped_gemm: CUTLASS refused");
  if (gemm.initialize(gargs, ws + l.cutlass, stream) != cutlass::Status::kSuccess)
    return fail_code(3, "fo_grouped_gemm: CUTLASS initialize failed");
  if (gemm.run(stream) != cutlass::Status::kSuccess) return fail_code(3, "fo_grouped_gemm: CUTLASS run failed");
  return flashoverlap::cuda_check(cudaGetLastError(), "fo_grouped_gemm");
}

}  // namespace

namespace flashoverlap {

// fo_grouped_gemm's refusals (rc 2, before any launch), the workspace's size included; moe_dispatch_cut.cu checks
// its terms with it before its first launch.
int grouped_gemm_check(fo_grouped_gemm_args const& a) {
  if (!a.a || !a.w || !a.d || !a.offs || !a.workspace) return fail_code(2, "fo_grouped_gemm: a null pointer");
  if (a.first < 0 || a.last <= a.first || a.last > a.experts)
    return fail_code(2, "fo_grouped_gemm: need 0 <= first < last <= experts");
  if (a.rows < 0 || a.rows >= (1LL << 31)) return fail_code(2, "fo_grouped_gemm: rows out of [0, 2^31)");
  if (a.n <= 0 || a.k <= 0 || a.n % kAlign || a.k % kAlign || a.lda < a.k || a.ldd < a.n || a.lda % kAlign ||
      a.ldd % kAlign || a.w_stride < a.n * a.k || a.w_stride % kAlign)
    return fail_code(2, "fo_grouped_gemm: N, K, the row strides and the expert stride must be multiples of 8 "
                        "(16 bytes) and hold a row / a weight");
  if (a.offs_bytes != 4 && a.offs_bytes != 8) return fail_code(2, "fo_grouped_gemm: offs_bytes must be 4 or 8");
  if (a.b_layout != 0 && a.b_layout != 1) return fail_code(2, "fo_grouped_gemm: b_layout must be 0 or 1");
  if ((reinterpret_cast<uintptr_t>(a.a) | reinterpret_cast<uintptr_t>(a.w) | reinterpret_cast<uintptr_t>(a.d)) % 16)
    return fail_code(2, "fo_grouped_gemm: A, W and D must start on 16 bytes");
  int sms = sm_count_of(a.device);
  if (!sms) return fail_code(2, "fo_grouped_gemm: no such device");
  size_t need = (a.b_layout ? ByRows::layout(a, sms) : ByLinear::layout(a, sms)).total;
  if (a.workspace_bytes < static_cast<int64_t>(need) || reinterpret_cast<uintptr_t>(a.workspace) % 128)
    return fail_code(2, "fo_grouped_gemm: the workspace must start on 128 bytes and hold fo_grouped_gemm_workspace's "
                        "bytes");
  return 0;
}

}  // namespace flashoverlap

extern "C" {

FO_API int fo_grouped_gemm_workspace(const fo_grouped_gemm_args* a, int64_t* bytes) {
  if (a == nullptr || bytes == nullptr || a->last <= a->first || (a->b_layout != 0 && a->b_layout != 1))
    return flashoverlap::fail_code(2, "fo_grouped_gemm_workspace: needs arguments with first < last, b_layout 0 or 1 "
                                      "and an output");
  int sms = sm_count_of(a->device);
  if (!sms) return flashoverlap::fail_code(2, "fo_grouped_gemm_workspace: no such device");
  *bytes = static_cast<int64_t>((a->b_layout ? ByRows::layout(*a, sms) : ByLinear::layout(*a, sms)).total);
  return 0;
}

FO_API int fo_grouped_gemm(const fo_grouped_gemm_args* args) {
  if (args == nullptr) return flashoverlap::fail_code(2, "fo_grouped_gemm: null arguments");
  fo_grouped_gemm_args const& a = *args;
  if (int rc = flashoverlap::grouped_gemm_check(a)) return rc;
  int sms = sm_count_of(a.device);
  return a.b_layout ? run<ByRows>(a, sms) : run<ByLinear>(a, sms);
}

}  // extern "C"
