// The MoE whole-block path's routing plan and the deferred settle's poison as library kernels
// (fo_moe_plan, fo_moe_poison; the ABI in flashoverlap_sm90.h). The same results as the Triton kernels of
// flashoverlap_inductor/routes/moe_plan_triton.py and, where those match it, the torch reference
// (moe_fast.plan_with_torch): one ctypes call each, in place of a Triton launch (~40-80 us of host time per launch
// on the 2-GPU hosts, measured) and a torch fill.
//
// fo_moe_plan: one kernel zeroing the workspace, then
//   scatter (one thread per expert row i): idx[i] = index[i] mod rows (Python's sign rule; entries clamped to
//     +-(2^62 - 1) first), inv[idx] = max(inv[idx], i), hits[idx] += 1, count[block of idx][group of i] += 1 for a
//     group < experts, the index's extremes as maxima of (raw + 2^62) and (2^62 - raw) (warp-reduced);
//   judge (one thread per buffer row r): UNNAMED += (hits[r] == 0); KEY_STEP = min(KEY_STEP, key(r + 1) - key(r))
//     with key(r) = group(inv[r]) + block(r) * (experts + 1); block 0 also writes the table (per block a cumulative
//     sum over the experts, each at most the block's rows; padding columns 0) and the scalar facts.
//     With pieces > 0 block 0 then writes the dispatch's expert pieces' bounds from the table (routes/moe_expert_cut.py):
//     bounds[q + 1] = max(bounds[q], min over blocks j of #experts e with table[j][e] <= cuts[q][j]), bounds[pieces] = E.
// group(pos): how many offsets are at most pos (searchsorted-right on sorted offsets); block(pos): how many block
// ends are at most pos. Both kernels keep the offsets in shared memory (experts <= FO_MOE_MAX_EXPERTS).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashoverlap_sm90.h"
#include "moe_rows.hpp"
#include "route_util.hpp"

// The ctypes mirrors' layout (routes/moe_plan_lib.py; tests/test_moe_plan_lib.py compares every field's offset).
static_assert(sizeof(fo_moe_plan_args) == 704 && offsetof(fo_moe_plan_args, stream) == 696, "fo_moe_plan_args layout");
static_assert(sizeof(fo_moe_poison_args) == 144 && offsetof(fo_moe_poison_args, stream) == 136,
              "fo_moe_poison_args layout");
static_assert(sizeof(fo_moe_move_args) == 216 && offsetof(fo_moe_move_args, stream) == 208, "fo_moe_move_args layout");

namespace flashoverlap {

namespace {

constexpr long long kShift = 1LL << 62;
constexpr long long kLimit = (1LL << 62) - 1;
constexpr int kThreads = 256;
enum Field { kFail = 0, kRows, kIdxMax, kIdxMin, kOffsStep, kUnnamed, kOffsLast, kKeyStep };

__device__ __forceinline__ long long load_int(void const* p, int bytes, long long i) {
  return bytes == 4 ? (long long)static_cast<int const*>(p)[i] : static_cast<long long const*>(p)[i];
}

__device__ __forceinline__ long long group_of(long long pos, long long const* offs, int experts) {
  long long g = 0;
  for (int e = 0; e < experts; ++e) g += offs[e] <= pos;
  return g;
}

__device__ __forceinline__ long long block_of(long long pos, long long const* ends) {
  long long b = 0;
#pragma unroll
  for (int j = 0; j < FO_MOE_MAX_BLOCKS; ++j) b += ends[j] <= pos;
  return b;
}

__device__ __forceinline__ void load_offsets(fo_moe_plan_args const& a, long long* s_offs) {
  for (int e = threadIdx.x; e < a.experts; e += blockDim.x) s_offs[e] = load_int(a.offs, a.offs_bytes, e);
  __syncthreads();
}

// The argument struct's int64_t (long) pointers as the long long pointers CUDA's 64-bit atomics take.
__device__ __forceinline__ long long* ll(int64_t* p) { return reinterpret_cast<long long*>(p); }
__device__ __forceinline__ long long const* ll(int64_t const* p) { return reinterpret_cast<long long const*>(p); }

__device__ __forceinline__ long long warp_max(long long v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ long long warp_min(long long v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

// The workspace zeroed (a kernel: cudaMemsetAsync held the host 26-40 us per call on the H200 hosts, a launch 7-13).
__global__ void moe_plan_zero(long long* work, long long len) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (long long)gridDim.x * blockDim.x)
    work[i] = 0;
}

__global__ void moe_plan_scatter(fo_moe_plan_args a) {
  extern __shared__ long long s_offs[];
  load_offsets(a, s_offs);
  long long const i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long hi = 0, lo = 0;  // (raw + SHIFT), (SHIFT - raw): both >= 1 for an entry, 0 for none
  if (i < a.rows) {
    long long raw = load_int(a.index, a.index_bytes, i);
    raw = min(max(raw, -kLimit), kLimit);
    long long idx = raw % a.rows;
    if (idx < 0) idx += a.rows;
    ll(a.idx)[i] = idx;
    atomicMax(ll(a.inv) + idx, i);  // the last expert row naming a row: the same on every run
    atomicAdd(reinterpret_cast<unsigned long long*>(ll(a.hits) + idx), 1ULL);
    long long const g = group_of(i, s_offs, a.experts);
    if (g < a.experts)
      atomicAdd(reinterpret_cast<unsigned long long*>(ll(a.count) + block_of(idx, ll(a.ends)) * a.experts + g), 1ULL);
    hi = raw + kShift;
    lo = kShift - raw;
  }
  hi = warp_max(hi);
  lo = warp_max(lo);
  if ((threadIdx.x & 31) == 0) {
    if (hi) atomicMax(ll(a.facts) + kIdxMax, hi);
    if (lo) atomicMax(ll(a.facts) + kIdxMin, lo);
  }
}

__global__ void moe_plan_judge(fo_moe_plan_args a) {
  extern __shared__ long long s_offs[];
  load_offsets(a, s_offs);
  long long const r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long const* ends = ll(a.ends);
  long long const* inv = ll(a.inv);
  long long* facts = ll(a.facts);
  long long unnamed = (r < a.rows && ll(a.hits)[r] == 0) ? 1 : 0;
  long long step = 0;  // KEY_STEP is clipped at 0
  if (r + 1 < a.rows) {
    long long const key = group_of(inv[r], s_offs, a.experts) + block_of(r, ends) * (a.experts + 1);
    long long const key1 = group_of(inv[r + 1], s_offs, a.experts) + block_of(r + 1, ends) * (a.experts + 1);
    step = min(key1 - key, 0LL);
  }
  for (int o = 16; o > 0; o >>= 1) unnamed += __shfl_down_sync(0xffffffffu, unnamed, o);
  step = warp_min(step);
  if ((threadIdx.x & 31) == 0) {
    if (unnamed) atomicAdd(reinterpret_cast<unsigned long long*>(facts + kUnnamed), (unsigned long long)unnamed);
    if (step < 0) atomicMin(facts + kKeyStep, step);
  }
  if (blockIdx.x != 0) return;
  if ((int)threadIdx.x < a.blocks) {  // the table: block j's cumulative expert offsets, clamped to its rows
    int const j = threadIdx.x;
    long long const size = ends[j] - (j ? ends[j - 1] : 0LL);
    long long cum = 0;
    for (int e = 0; e < a.table_cols; ++e) {
      if (e < a.experts) cum += ll(a.count)[(long long)j * a.experts + e];
      a.table[(long long)j * a.table_cols + e] = e < a.experts ? (int)min(cum, size) : 0;
    }
  }
  if (a.pieces > 0) {  // the expert pieces' bounds from the table just written (block 0's threads, synchronized)
    __syncthreads();
    if (threadIdx.x == 0) {
      int lo = 0;
      a.bounds[0] = 0;
      for (int q = 0; q + 1 < a.pieces; ++q) {
        int fewest = a.experts;
        for (int j = 0; j < a.blocks; ++j) {
          int done = 0;
          for (int e = 0; e < a.experts; ++e) done += a.table[(long long)j * a.table_cols + e] <= a.cuts[q][j];
          fewest = min(fewest, done);
        }
        lo = max(lo, fewest);
        a.bounds[q + 1] = lo;
      }
      a.bounds[a.pieces] = a.experts;
    }
  }
  if (threadIdx.x == 0) {  // the scalar facts (kernel 1 is complete; the other blocks touch UNNAMED, KEY_STEP only)
    long long step0 = kShift;
    for (int e = 0; e < a.experts; ++e) step0 = min(step0, s_offs[e] - (e ? s_offs[e - 1] : 0LL));
    facts[kOffsStep] = step0;
    facts[kOffsLast] = s_offs[a.experts - 1];
    facts[kRows] = a.rows;
    facts[kIdxMax] = facts[kIdxMax] - kShift;
    facts[kIdxMin] = kShift - facts[kIdxMin];
  }
}

// Whether any of the world vectors (FO_MOE_SETTLE_LEN int64 each) shows a failure, bad routing data or a failed
// premise (flashoverlap_inductor/routes/moe_deferred.py: bad).
__device__ bool any_bad(long long const* every, int world) {
  bool bad = false;
  for (int r = 0; r < world; ++r) {
    long long const* v = every + (long long)r * FO_MOE_SETTLE_LEN;
    long long const rows = v[kRows];
    bool const out_of_range = rows > 0 && (v[kIdxMax] >= rows || v[kIdxMin] < -rows);
    bad = bad || v[kFail] != 0 || out_of_range || v[kOffsStep] < 0 || v[kOffsLast] != rows || v[kUnnamed] > 0 ||
          v[kKeyStep] < 0;
  }
  return bad;
}

__global__ void moe_poison(fo_moe_poison_args a) {
  __shared__ int s_bad;
  if (a.mirror != nullptr && blockIdx.x == 0 && blockIdx.y == 0) {  // the vectors to the host, good or bad
    for (int i = threadIdx.x; i < a.world * FO_MOE_SETTLE_LEN; i += blockDim.x) ll(a.mirror)[i] = ll(a.every)[i];
  }
  if (threadIdx.x == 0) s_bad = any_bad(ll(a.every), a.world);
  __syncthreads();
  if (!s_bad) return;
  int const k = blockIdx.y;
  long long const n = a.numel[k];
  unsigned long long const bits = a.nan_bits[k];
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    switch (a.elem_bytes[k]) {
      case 2: static_cast<unsigned short*>(a.out[k])[i] = (unsigned short)bits; break;
      case 4: static_cast<unsigned int*>(a.out[k])[i] = (unsigned int)bits; break;
      default: static_cast<unsigned long long*>(a.out[k])[i] = bits; break;
    }
  }
}

// One warp per (row, move): dst[k] row inv[r] = src[k] row r, as W-byte words.
__global__ void moe_move_rows(fo_moe_move_args a) {
  int const k = blockIdx.y;
  int const lane = threadIdx.x & 31;
  long long const warps = (long long)gridDim.x * (blockDim.x >> 5);
  long long const* inv = ll(a.inv);
  for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < a.rows; r += warps) {
    long long const to = inv[r];
    if (to < 0 || to >= a.dst_rows) continue;
    copy_row(static_cast<char const*>(a.src[k]) + r * a.src_stride[k], static_cast<char*>(a.dst[k]) + to * a.dst_stride[k],
             a.row_bytes[k], a.word_bytes[k], lane);
  }
}

int cuda_fail(char const* what, cudaError_t e) {
  return fail_code(100 + int(e), std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

}  // namespace

// fo_preload (api.cu): load this file's kernels too.
int moe_plan_preload() {
  cudaFuncAttributes attr{};
  for (void const* k : {reinterpret_cast<void const*>(moe_plan_zero), reinterpret_cast<void const*>(moe_plan_scatter),
                        reinterpret_cast<void const*>(moe_plan_judge),
                        reinterpret_cast<void const*>(moe_poison), reinterpret_cast<void const*>(moe_move_rows)}) {
    if (cudaError_t e = cudaFuncGetAttributes(&attr, k); e != cudaSuccess) return cuda_fail("fo_preload (moe)", e);
  }
  return 0;
}

// fo_moe_plan's refusals (rc 2, before any launch); moe_dispatch_cut.cu checks its plan with it first.
int moe_plan_check(fo_moe_plan_args const& a) {
  if (a.rows <= 0 || a.rows >= (1LL << 31)) return fail_code(2, "fo_moe_plan: rows must be in [1, 2^31)");
  if (a.experts < 1 || a.experts > FO_MOE_MAX_EXPERTS) return fail_code(2, "fo_moe_plan: experts out of range");
  if (a.blocks < 1 || a.blocks > FO_MOE_MAX_BLOCKS) return fail_code(2, "fo_moe_plan: blocks out of range");
  if ((a.index_bytes != 4 && a.index_bytes != 8) || (a.offs_bytes != 4 && a.offs_bytes != 8))
    return fail_code(2, "fo_moe_plan: index_bytes and offs_bytes must be 4 or 8");
  if (a.table_cols < a.experts) return fail_code(2, "fo_moe_plan: table_cols must be at least experts");
  if (a.pieces < 0 || a.pieces > FO_MOE_MAX_PIECES || (a.pieces > 0 && a.bounds == nullptr))
    return fail_code(2, "fo_moe_plan: pieces must be in [0, 8], with bounds given when positive");
  for (int j = 0; j < FO_MOE_MAX_BLOCKS; ++j) {  // block_of reads all 8: non-decreasing, rows from the last block on
    int64_t const prev = j ? a.ends[j - 1] : 0;
    bool const ok = j >= a.blocks - 1 ? a.ends[j] == a.rows : (a.ends[j] >= prev && a.ends[j] <= a.rows);
    if (!ok) return fail_code(2, "fo_moe_plan: ends must be non-decreasing in [0, rows], rows from the last block on");
  }
  if (!a.index || !a.offs || !a.work || !a.idx || !a.table || !a.count || !a.facts || !a.inv || !a.hits)
    return fail_code(2, "fo_moe_plan: a null pointer");
  return 0;
}

}  // namespace flashoverlap

using flashoverlap::cuda_fail;
using flashoverlap::fail_code;

FO_API int fo_moe_plan(const fo_moe_plan_args* args) {
  if (args == nullptr) return fail_code(2, "fo_moe_plan: null arguments");
  fo_moe_plan_args const& a = *args;
  if (int rc = flashoverlap::moe_plan_check(a)) return rc;
  auto stream = static_cast<cudaStream_t>(a.stream);
  long long const zero_blocks = (a.work_len + flashoverlap::kThreads - 1) / flashoverlap::kThreads;
  flashoverlap::moe_plan_zero<<<(unsigned)(zero_blocks > 1024 ? 1024 : zero_blocks), flashoverlap::kThreads, 0,
                                stream>>>(reinterpret_cast<long long*>(a.work), a.work_len);
  unsigned const grid = (unsigned)((a.rows + flashoverlap::kThreads - 1) / flashoverlap::kThreads);
  size_t const shared = (size_t)a.experts * sizeof(long long);
  flashoverlap::moe_plan_scatter<<<grid, flashoverlap::kThreads, shared, stream>>>(a);
  flashoverlap::moe_plan_judge<<<grid, flashoverlap::kThreads, shared, stream>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_fail("fo_moe_plan", e);
  return 0;
}

FO_API int fo_moe_poison(const fo_moe_poison_args* args) {
  if (args == nullptr) return fail_code(2, "fo_moe_poison: null arguments");
  fo_moe_poison_args const& a = *args;
  if (a.world < 1 || a.world > FO_MOE_MAX_BLOCKS || a.every == nullptr)
    return fail_code(2, "fo_moe_poison: world must be in [1, 8] with the vectors given");
  if (a.outputs < 1 || a.outputs > FO_MOE_POISON_SLOTS) return fail_code(2, "fo_moe_poison: outputs out of range");
  long long most = 0;
  for (int k = 0; k < a.outputs; ++k) {
    if (a.elem_bytes[k] != 2 && a.elem_bytes[k] != 4 && a.elem_bytes[k] != 8)
      return fail_code(2, "fo_moe_poison: elem_bytes must be 2, 4 or 8");
    if (a.numel[k] < 0 || (a.numel[k] > 0 && a.out[k] == nullptr)) return fail_code(2, "fo_moe_poison: bad output");
    most = a.numel[k] > most ? a.numel[k] : most;
  }
  fo_moe_poison_args k = a;
  if (a.mirror != nullptr) {  // the device's address of the page-locked mirror (the same one under UVA)
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, a.mirror) != cudaSuccess || attr.type != cudaMemoryTypeHost ||
        attr.devicePointer == nullptr) {
      cudaGetLastError();  // a refused query leaves no sticky error
      return fail_code(2, "fo_moe_poison: mirror must be page-locked host memory the device can address");
    }
    k.mirror = static_cast<int64_t*>(attr.devicePointer);
  }
  long long const blocks = (most + flashoverlap::kThreads - 1) / flashoverlap::kThreads;
  dim3 const grid((unsigned)(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks)), (unsigned)a.outputs);
  flashoverlap::moe_poison<<<grid, flashoverlap::kThreads, 0, static_cast<cudaStream_t>(a.stream)>>>(k);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_fail("fo_moe_poison", e);
  return 0;
}

FO_API int fo_moe_move_rows(const fo_moe_move_args* args) {
  if (args == nullptr) return fail_code(2, "fo_moe_move_rows: null arguments");
  fo_moe_move_args const& a = *args;
  if (a.rows < 0 || a.dst_rows < 0 || a.inv == nullptr) return fail_code(2, "fo_moe_move_rows: bad rows or inv");
  if (a.moves < 1 || a.moves > FO_MOE_MOVE_SLOTS) return fail_code(2, "fo_moe_move_rows: moves out of range");
  for (int k = 0; k < a.moves; ++k) {
    int64_t const w = a.word_bytes[k];
    bool const word_ok = w == 16 || w == 8 || w == 4 || w == 2;
    if (!word_ok || a.row_bytes[k] <= 0 || a.row_bytes[k] % w || a.src_stride[k] % w || a.dst_stride[k] % w ||
        reinterpret_cast<uintptr_t>(a.src[k]) % w || reinterpret_cast<uintptr_t>(a.dst[k]) % w)
      return fail_code(2, "fo_moe_move_rows: word_bytes must be 16, 8, 4 or 2 and divide rows, strides and addresses");
    if (a.src_stride[k] < a.row_bytes[k] || a.dst_stride[k] < a.row_bytes[k])
      return fail_code(2, "fo_moe_move_rows: strides must hold a row");
  }
  if (a.rows == 0) return 0;
  long long const per_block = flashoverlap::kThreads / 32;
  long long const blocks = (a.rows + per_block - 1) / per_block;
  dim3 const grid((unsigned)(blocks > 8192 ? 8192 : blocks), (unsigned)a.moves);
  flashoverlap::moe_move_rows<<<grid, flashoverlap::kThreads, 0, static_cast<cudaStream_t>(a.stream)>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cuda_fail("fo_moe_move_rows", e);
  return 0;
}
