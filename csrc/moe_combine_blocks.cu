// fo_moe_combine_blocks: the MoE combine's whole-block compute as one library call (the ABI in flashoverlap_sm90.h;
// Python: routes/moe_combine_lib.py). It composes this library's steps on one stream,
//
//   fo_moe_plan (the routing plan: inv, each block's expert offsets, the settle's facts)
//   per block j of `order`: per term, the block's expert rows gathered into scratch and the term's grouped GEMM
//                           (fo_grouped_gemm) into the block's rows (the second and later terms added in); ready[j]
//
// which routes/moe_fast.py ran as ~4 torch calls per block and term plus the plan. The caller issues each block's
// transfer behind ready[j] (routes/moe_nccl.py), so block j travels while later blocks compute. Every argument is
// checked before the first launch (a refusal, rc 2, enqueues nothing); any failure after it returns a code >= 100 (a
// CUDA error's, else 100), the steps before it enqueued.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashoverlap_sm90.h"
#include "moe_rows.hpp"
#include "route_util.hpp"

// The ctypes mirror's layout (routes/moe_combine_lib.py; tests/test_moe_combine_lib.py compares every field's offset).
static_assert(sizeof(fo_moe_combine_args) == 1536 && offsetof(fo_moe_combine_args, stream) == 1528,
              "fo_moe_combine_args layout");

namespace flashoverlap {

int moe_plan_check(fo_moe_plan_args const& a);         // moe_plan.cu
int grouped_gemm_check(fo_grouped_gemm_args const& a);  // grouped_gemm.cu

namespace {

constexpr int kThreads = 256;

// dst row r = src row inv[r] for r < rows (a warp per row); inv's entries lie in [0, src_rows) (the plan's).
__global__ void gather_rows(char const* src, long long src_stride, char* dst, long long dst_stride,
                            long long const* inv, long long rows, long long row_bytes, int word) {
  int const lane = threadIdx.x & 31;
  long long const warps = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    copy_row(src + inv[r] * src_stride, dst + r * dst_stride, row_bytes, word, lane);
  }
}

// dst[r, c] = bf16(float(dst[r, c]) + float(add[r, c])) for r < rows, c < n (add contiguous, dst dst_ld apart).
__global__ void add_rows(__nv_bfloat16* dst, long long dst_ld, __nv_bfloat16 const* add, long long rows, long long n) {
  long long const total = rows * n;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
    long long const r = i / n, c = i % n;
    __nv_bfloat16* d = dst + r * dst_ld + c;
    *d = __float2bfloat16_rn(__bfloat162float(*d) + __bfloat162float(add[i]));
  }
}

int grid_of(long long work, int per_block) {
  long long const blocks = (work + per_block - 1) / per_block;
  return int(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks);
}

int64_t start_of(fo_moe_combine_args const& a, int j) { return j ? a.plan.ends[j - 1] : 0; }

// The block's grouped GEMM of term t: its arguments with the template's w, n, k, experts, layout and workspace.
fo_grouped_gemm_args block_gemm(fo_moe_combine_args const& a, int t, int j, int64_t rows) {
  fo_grouped_gemm_args g = a.gemm[t];
  g.a = a.scratch[t], g.lda = g.k, g.rows = rows;
  g.offs = a.plan.table + int64_t(j) * a.plan.table_cols, g.offs_bytes = 4, g.range = nullptr;
  g.first = 0, g.last = g.experts;
  if (t == 0) {
    g.d = a.out[j], g.ldd = a.out_stride / 2;
  } else {
    g.d = a.sum, g.ldd = g.n;
  }
  g.stream = a.stream;
  return g;
}

int check(fo_moe_combine_args const& a) {
  if (int rc = moe_plan_check(a.plan)) return rc;
  int const blocks = a.plan.blocks;
  if (a.plan.pieces != 0) return fail_code(2, "fo_moe_combine_blocks: the plan takes no pieces");
  if (a.terms < 1 || a.terms > FO_MOE_MAX_TERMS) return fail_code(2, "fo_moe_combine_blocks: terms out of range");
  if (a.terms > 1 && !a.sum) return fail_code(2, "fo_moe_combine_blocks: more than one term needs sum");
  unsigned seen = 0;
  int64_t largest = 0;
  for (int i = 0; i < blocks; ++i) {
    int const j = a.order[i];
    if (j < 0 || j >= blocks || (seen >> j) & 1u) return fail_code(2, "fo_moe_combine_blocks: order must list each block once");
    seen |= 1u << j;
    int64_t const rows = a.plan.ends[j] - start_of(a, j);
    if (rows < 0) return fail_code(2, "fo_moe_combine_blocks: plan.ends must not decrease");
    if (rows > largest) largest = rows;
    if (rows && (!a.out[j] || reinterpret_cast<uintptr_t>(a.out[j]) % 16))
      return fail_code(2, "fo_moe_combine_blocks: a block with rows needs out on 16 bytes");
  }
  int64_t const n = a.gemm[0].n;
  if (a.out_stride < n * 2 || a.out_stride % 16) return fail_code(2, "fo_moe_combine_blocks: out_stride must hold a row, on 16 bytes");
  for (int t = 0; t < a.terms; ++t) {
    int64_t const row_bytes = a.gemm[t].k * 2;
    if (!a.a[t] || !a.scratch[t] || a.a_stride[t] < row_bytes ||
        !row_word(row_bytes, a.a_stride[t], row_bytes, a.a[t], a.scratch[t]))
      return fail_code(2, "fo_moe_combine_blocks: a term's rows, stride or scratch are unusable");
    if (a.gemm[t].n != n || a.gemm[t].experts != a.plan.experts)
      return fail_code(2, "fo_moe_combine_blocks: the terms must share N and the plan's experts");
    if (largest) {
      fo_grouped_gemm_args g = block_gemm(a, t, a.order[0], largest);
      g.d = t == 0 ? (a.out[a.order[0]] ? a.out[a.order[0]] : a.scratch[t]) : a.sum;
      if (int rc = grouped_gemm_check(g)) return rc;
    }
  }
  return 0;
}

int cuda_fail(char const* what, cudaError_t e) {
  return fail_code(100 + int(e), std::string("fo_moe_combine_blocks: ") + what + ": " + cudaGetErrorString(e));
}

int run_block(fo_moe_combine_args const& a, int j, cudaStream_t stream) {
  int64_t const start = start_of(a, j), rows = a.plan.ends[j] - start;
  for (int t = 0; t < a.terms && rows; ++t) {
    int64_t const row_bytes = a.gemm[t].k * 2;
    int const word = row_word(row_bytes, a.a_stride[t], row_bytes, a.a[t], a.scratch[t]);
    gather_rows<<<grid_of(rows, kThreads / 32), kThreads, 0, stream>>>(
        static_cast<char const*>(a.a[t]), a.a_stride[t], static_cast<char*>(a.scratch[t]), row_bytes,
        reinterpret_cast<long long const*>(a.plan.inv + start), rows, row_bytes, word);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_fail("gather", e);
    fo_grouped_gemm_args g = block_gemm(a, t, j, rows);
    if (int rc = fo_grouped_gemm(&g)) return after_first_launch(rc, "fo_moe_combine_blocks");
    if (t > 0) {
      int64_t const n = a.gemm[0].n;
      add_rows<<<grid_of(rows * n, kThreads), kThreads, 0, stream>>>(
          static_cast<__nv_bfloat16*>(a.out[j]), a.out_stride / 2, static_cast<__nv_bfloat16 const*>(a.sum), rows, n);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_fail("add", e);
    }
  }
  if (a.ready[j] != nullptr) {
    if (cudaError_t e = cudaEventRecord(static_cast<cudaEvent_t>(a.ready[j]), stream); e != cudaSuccess)
      return cuda_fail("recording a block's event", e);
  }
  return 0;
}

}  // namespace

// fo_preload (api.cu): load this file's kernels too.
int moe_combine_preload() {
  cudaFuncAttributes attr{};
  for (void const* k : {reinterpret_cast<void const*>(gather_rows), reinterpret_cast<void const*>(add_rows)}) {
    if (cudaError_t e = cudaFuncGetAttributes(&attr, k); e != cudaSuccess) return cuda_fail("fo_preload", e);
  }
  return 0;
}

}  // namespace flashoverlap

FO_API int fo_moe_combine_blocks(const fo_moe_combine_args* args) {
  if (args == nullptr) return flashoverlap::fail_code(2, "fo_moe_combine_blocks: null arguments");
  fo_moe_combine_args const& a = *args;
  if (int rc = flashoverlap::check(a)) return rc;
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (int rc = flashoverlap::plan_on(a.plan, a.stream)) return rc;
  for (int i = 0; i < a.plan.blocks; ++i) {
    if (int rc = flashoverlap::run_block(a, a.order[i], stream)) return flashoverlap::after_first_launch(rc, "fo_moe_combine_blocks");
  }
  return 0;
}
