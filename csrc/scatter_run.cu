// fo_scatter_run: the copy-engine pull route of GEMM -> reduce_scatter on 2 ranks (routes/scatter_pull.py) as one
// host call, its peer's half cut into pieces so the push of each piece runs beside the next piece's GEMM, and the
// received rows added by the own half's GEMMs (cuBLASLt, C = the receive slot, beta 1) instead of one add after them.
// flashoverlap_sm90.h states the schedule and the flags; the flags, buffers, copy stream and finish are the gather
// protocol's (gather_call.cu), so its failure contract holds: every wait is a bounded step kernel, a timeout or an
// enqueue failure is recorded in both ranks' fault blocks, and fo_gather_finish poisons every output while one is.
// With all_reduce = 1 the same call runs GEMM -> all_reduce (routes/reduce_pull.py): each rank's whole partial
// pushed piece by piece into the peer's set, each piece added once both ranks' partials of it are in place.
//
// Why this order (2 H200s, 41st session, scatter_pull's Python path): the add over the own half (3 x half x N x 2
// bytes of HBM traffic, ~0.1 ms at 16384 x 8192) and a push that the own half's first GEMM could not start before
// were most of the route's gap to the GEMM alone. Here the own half's piece i waits only for the peer's piece i,
// pushed while the peer computed its pieces i + 1 ...; only the notification is per piece, and it is a copy-engine
// write (a step kernel on the copy stream would wait for an SM the caller's GEMM holds).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flashoverlap_sm90.h"
#include "gather_protocol.hpp"
#include "route_util.hpp"

namespace flashoverlap {
namespace {

using namespace gp;

// out[i] += in[i] over `count` 2-byte elements (bf16 or fp16), each sum in fp32 rounded once to the nearest even,
// as torch's add_ rounds it (so pieces = 1 gives the route's Python path's result bit for bit); 8 elements per
// 16-byte access where both pointers lie on 16 bytes, else one by one.
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ void from_float2(float2 v, __nv_bfloat162* out) { *out = __float22bfloat162_rn(v); }
__device__ __forceinline__ void from_float2(float2 v, __half2* out) { *out = __float22half2_rn(v); }

template <class T, class T2>
__global__ void add_rows_kernel(T* out, T const* in, int64_t count, int vec) {
  int64_t const stride = int64_t(gridDim.x) * blockDim.x;
  int64_t const first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t const vecs = vec ? count / 8 : 0;
  for (int64_t v = first; v < vecs; v += stride) {
    uint4 x = reinterpret_cast<uint4 const*>(out)[v];
    uint4 const y = reinterpret_cast<uint4 const*>(in)[v];
    T2* px = reinterpret_cast<T2*>(&x);
    T2 const* py = reinterpret_cast<T2 const*>(&y);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 const u = to_float2(px[j]), w = to_float2(py[j]);
      from_float2(make_float2(u.x + w.x, u.y + w.y), &px[j]);
    }
    reinterpret_cast<uint4*>(out)[v] = x;
  }
  for (int64_t e = vecs * 8 + first; e < count; e += stride) out[e] = T(float(out[e]) + float(in[e]));
}

int add_rows(void* out, void const* in, int64_t count, bool bf16, cudaStream_t stream) {
  int const vec = ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(in)) & 15u) == 0;
  int64_t const work = vec ? count / 8 + 1 : count;
  int const blocks = int(work / 256 + 1 < 1056 ? work / 256 + 1 : 1056);
  if (bf16) {
    add_rows_kernel<__nv_bfloat16, __nv_bfloat162><<<blocks, 256, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out), static_cast<__nv_bfloat16 const*>(in), count, vec);
  } else {
    add_rows_kernel<__half, __half2><<<blocks, 256, 0, stream>>>(static_cast<__half*>(out),
                                                                 static_cast<__half const*>(in), count, vec);
  }
  return cuda_check(cudaGetLastError(), "add kernel");
}

int check(fo_gather_args const& p, fo_scatter_gemm_args const& g) {
  if (p.world != 2 || p.rank < 0 || p.rank > 1 || (p.options & FO_GATHER_PUSH) == 0 ||
      (p.options & FO_GATHER_COPY_NOTIFY) != 0 || p.slot_set < 0 || p.slot_set >= kSlotSets) {
    return fail_code(2, "fo_scatter_run: 2 ranks, options FO_GATHER_PUSH alone, slot_set in [0, SLOT_SETS)");
  }
  if (p.fault == nullptr || p.copy_stream == nullptr || p.epoch == nullptr || p.timeout_ns <= 0 ||
      p.buffers[0] == nullptr || p.buffers[1] == nullptr || p.flags[0] == nullptr || p.flags[1] == nullptr) {
    return fail_code(2, "fo_scatter_run: fault, copy_stream, epoch, every buffer and flag page, timeout_ns > 0");
  }
  bool const ar = g.all_reduce != 0;
  int64_t const rows = ar ? 2 * g.half_rows : g.half_rows;  // the rows cut into pieces
  if (g.pieces < 1 || g.pieces > kMaxPieces || g.half_rows < 1 || rows < g.pieces || g.n < 2 || g.k < 2 ||
      g.a == nullptr || g.weight == nullptr || (!ar && g.part == nullptr) || g.out == nullptr ||
      g.handle == nullptr || (g.elem_type != 14 && g.elem_type != 2) || g.workspace_bytes < 0 ||
      (g.all_reduce != 0 && g.all_reduce != 1)) {
    return fail_code(2, "fo_scatter_run: bad arguments (pieces in [1, FO_SCATTER_MAX_PIECES] and <= the rows cut, "
                        "N >= 2, K >= 2, a, weight, part (reduce_scatter), out, handle, a bf16 or fp16 element "
                        "type, all_reduce 0 or 1)");
  }
  if (ar && g.cuts[g.pieces] != 0) {  // given cuts: 0 < ... < every row
    bool ok = g.cuts[0] == 0 && g.cuts[g.pieces] == rows;
    for (int i = 0; i < g.pieces; ++i) ok = ok && g.cuts[i] < g.cuts[i + 1];
    if (!ok) return fail_code(2, "fo_scatter_run: cuts must rise from 0 to 2 * half_rows over the pieces");
  }
  int64_t const bytes = g.half_rows * g.n * 2;
  if (p.shard_bytes != bytes || p.a != (ar ? g.out : g.part) || p.set_bytes < 2 * bytes || p.elem_bytes != 2) {
    return fail_code(2, "fo_scatter_run: call.a must be part (all_reduce: out), call.shard_bytes half_rows * N * 2, "
                        "set_bytes >= 2 shards, elem_bytes 2");
  }
  if (!gemms_bound(false) || (g.workspace != nullptr && !gemms_bound(true))) {
    return fail_code(8, "fo_scatter_run: cuBLAS (or, with a workspace, cuBLASLt) is not bound");
  }
  return 0;
}

// One call's failure bookkeeping. Once the begin is enqueued, every piece's push and notification is still issued
// where it can be (the peer's waits then end in time), and an enqueue failure goes to ev->push_fail_tag, which
// fo_gather_finish records in both ranks' blocks with its done.
struct Progress {
  fo_gather_args const& p;
  GatherEvents* ev;
  cudaStream_t cur, copy;
  int first = 0;          // the first failure (0: none)
  bool recorded = false;  // a step kernel on cur recorded it in both ranks' blocks

  void note(int code, int tag) {
    if (code != 0 && first == 0) first = code;
    if (code != 0 && ev->push_fail_tag == 0) ev->push_fail_tag = tag;
  }
  // A failure is recorded in both ranks' blocks by a step kernel on cur before any later notification is ordered
  // after it, so the peer, whose waits then end, poisons its output; where that cannot be ordered, no notification:
  // the peer's wait runs out its bound (a fault recorded there too).
  void record_failure() {
    if (first == 0 || recorded) return;
    GatherStep f = step_base(p);
    f.fail_tag = ev->push_fail_tag;
    if (launch_step(f, cur) == 0) {
      recorded = true;
      ev->push_fail_tag = 0;
    }
  }
  // After rows [off, off + bytes) of `src` (written on cur): on the copy stream, those bytes to `dst` in the peer's
  // buffer, `pushed` recorded after them (where given), then this call's value of piece i into the peer's
  // piece_ready[r]. Without a copy stream ordered after cur: neither push nor notification.
  void push_piece(int i, char const* src, char* dst, int64_t bytes, cudaEvent_t pushed) {
    int const r = p.rank, peer = 1 - r;
    int e = cuda_check(cudaEventRecord(ev->piece[i], cur), "piece record");
    if (e == 0) e = cuda_check(cudaStreamWaitEvent(copy, ev->piece[i], 0), "piece wait");
    if (e != 0) {
      note(e, kTagEnqueue + 2);
      return;
    }
    if (first == 0) {
      note(cuda_check(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, copy), "piece push"),
           kTagEnqueue + 3);
    }
    if (pushed != nullptr) note(cuda_check(cudaEventRecord(pushed, copy), "pushed record"), kTagEnqueue + 8);
    if (first == 0 || recorded) {
      note(cuda_check(cudaMemcpyAsync(p.flags[peer] + kPieceReady + r, p.flags[r] + kPieceSrc + i, sizeof(int),
                                      cudaMemcpyDeviceToDevice, copy), "piece notify"), kTagEnqueue + 4);
    }
  }
  // On cur, one kernel: wait until the peer's piece_ready here reaches recv + 1, then recv + 1. Launched whatever
  // failed (each consumes one of the peer's notifications: the counters stay in step).
  void wait_piece() {
    int* const own = p.flags[p.rank];
    GatherStep w = step_base(p);
    w.counter = own + kPieceRecv;
    w.wait_offset = 1;
    w.advance = 1;
    w.wait[0] = own + kPieceReady + 1 - p.rank;
    w.tag[0] = kTagReady + 1 - p.rank;
    w.num_wait = 1;
    note(launch_step(w, cur), kTagEnqueue + 5);
  }
};

// Step 1 (flashoverlap_sm90.h): begin, ready[r] to the peer, this call's piece values, the set's reuse guard.
int begin(fo_gather_args const& p, int pieces, cudaStream_t cur) {
  int const r = p.rank, peer = 1 - r, b = p.slot_set;
  int* const own = p.flags[r];
  GatherStep s = step_base(p);
  s.begin = 1;
  s.pieces = pieces;
  s.piece_sent = own + kPieceSent;
  s.piece_src = own + kPieceSrc;
  s.notify[s.num_notify++] = p.flags[peer] + kReady + r;
  s.counter = own + kSetUses + b;
  s.advance = 1;
  s.wait[0] = set_flag(own, kSetDone, b, peer);
  s.tag[0] = kTagDone + peer;
  s.num_wait = 1;
  return launch_step(s, cur);
}

// The reduce_scatter's steps 2-3: the peer's half piece by piece, each pushed once computed; then pieces = 1: the own
// half at once (beside the push), the wait, one add; more pieces: the own half piece by piece, each after the peer's
// piece of it, out = a[r's half] @ w + slot.
void reduce_scatter(Progress& c, fo_scatter_gemm_args const& g, int device) {
  fo_gather_args const& p = c.p;
  int const r = p.rank, peer = 1 - r, b = p.slot_set, pieces = g.pieces;
  int64_t const row_bytes = g.n * 2;
  char const* const a = static_cast<char const*>(g.a);
  char* const part = static_cast<char*>(g.part);
  char* const out = static_cast<char*>(g.out);
  char* const slot_here = static_cast<char*>(p.buffers[r]) + size_t(b) * size_t(p.set_bytes) +
                          size_t(peer) * size_t(p.shard_bytes);  // the peer's part of this rank's rows lands here
  char* const slot_there = static_cast<char*>(p.buffers[peer]) + size_t(b) * size_t(p.set_bytes) +
                           size_t(r) * size_t(p.shard_bytes);
  auto rows_of = [&](int i) { return g.half_rows * i / pieces; };
  auto gemm = [&](int half, int i, void const* cc, char* dst) {
    int64_t const r0 = rows_of(i), rows = rows_of(i + 1) - r0;
    return gemm_rows(GemmRows{g.handle, g.elem_type, g.math_mode, g.weight_transposed, g.weight, g.n, g.k,
                              a + (int64_t(half) * g.half_rows + r0) * g.k * 2, rows, cc, dst + r0 * row_bytes,
                              g.workspace, g.workspace_bytes, device}, c.cur);
  };
  for (int i = 0; i < pieces; ++i) {
    int64_t const off = rows_of(i) * row_bytes, bytes = (rows_of(i + 1) - rows_of(i)) * row_bytes;
    if (c.first == 0) c.note(gemm(peer, i, nullptr, part), kTagEnqueue + 1);
    c.record_failure();
    c.push_piece(i, part + off, slot_there + off, bytes, nullptr);
  }
  if (pieces == 1 && c.first == 0) c.note(gemm(r, 0, nullptr, out), kTagEnqueue + 6);
  for (int i = 0; i < pieces; ++i) {
    c.wait_piece();
    if (c.first != 0) continue;
    if (pieces == 1) {
      c.note(add_rows(out, slot_here, g.half_rows * g.n, g.elem_type == 14, c.cur), kTagEnqueue + 7);
    } else {
      c.note(gemm(r, i, slot_here + rows_of(i) * row_bytes, out), kTagEnqueue + 6);
    }
  }
}

// The all_reduce's steps (flashoverlap_sm90.h, all_reduce = 1): piece i's partial into out and pushed whole into the
// same rows of the peer's set b; piece i's add issued after piece i + 1's GEMM, so cur waits neither for the push
// (the next GEMM's length, ~4x the push's at 4 pieces) nor for the peer's piece. The add rewrites rows the push reads,
// hence its wait for the `pushed` event.
void all_reduce(Progress& c, fo_scatter_gemm_args const& g, int device) {
  fo_gather_args const& p = c.p;
  int const r = p.rank, peer = 1 - r, b = p.slot_set, pieces = g.pieces;
  int64_t const rows = 2 * g.half_rows, row_bytes = g.n * 2;
  char const* const a = static_cast<char const*>(g.a);
  char* const out = static_cast<char*>(g.out);
  char* const region_here = static_cast<char*>(p.buffers[r]) + size_t(b) * size_t(p.set_bytes);
  char* const region_there = static_cast<char*>(p.buffers[peer]) + size_t(b) * size_t(p.set_bytes);
  bool const cut = g.cuts[pieces] != 0;
  auto rows_of = [&](int i) { return cut ? g.cuts[i] : rows * i / pieces; };
  auto add = [&](int i) {
    c.wait_piece();
    c.note(cuda_check(cudaStreamWaitEvent(c.cur, c.ev->pushed[i], 0), "pushed wait"), kTagEnqueue + 9);
    if (c.first != 0) return;
    int64_t const off = rows_of(i) * row_bytes;
    c.note(add_rows(out + off, region_here + off, (rows_of(i + 1) - rows_of(i)) * g.n, g.elem_type == 14, c.cur),
           kTagEnqueue + 7);
  };
  for (int i = 0; i < pieces; ++i) {
    int64_t const r0 = rows_of(i), n_rows = rows_of(i + 1) - r0, off = r0 * row_bytes;
    if (c.first == 0) {
      c.note(gemm_rows(GemmRows{g.handle, g.elem_type, g.math_mode, g.weight_transposed, g.weight, g.n, g.k,
                                a + r0 * g.k * 2, n_rows, nullptr, out + off, g.workspace, g.workspace_bytes,
                                device}, c.cur), kTagEnqueue + 1);
    }
    c.record_failure();
    c.push_piece(i, out + off, region_there + off, n_rows * row_bytes, c.ev->pushed[i]);
    if (i > 0) add(i - 1);
  }
  add(pieces - 1);
}

int run(fo_gather_args const& p, fo_scatter_gemm_args const& g, GatherEvents* ev, int device) {
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  ev->push_begun = false;
  ev->push_fail_tag = 0;
  int const rc = begin(p, g.pieces, cur);
  if (rc != 0) return rc;
  ev->push_begun = true;
  Progress c{p, ev, cur, static_cast<cudaStream_t>(p.copy_stream)};
  if (g.all_reduce != 0) {
    all_reduce(c, g, device);
  } else {
    reduce_scatter(c, g, device);
  }
  return c.first;
}

}  // namespace
}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_scatter_run(const fo_gather_args* call, const fo_scatter_gemm_args* gemm, int32_t* finish_rc) {
  if (call == nullptr || gemm == nullptr || finish_rc == nullptr) {
    return fail_code(2, "fo_scatter_run: call, gemm or finish_rc is null");
  }
  *finish_rc = 0;
  int rc = check(*call, *gemm);
  if (rc != 0) return rc;  // nothing enqueued: no finish owed
  GatherEvents* ev = nullptr;
  int device = 0;
  if ((rc = events(ev)) == 0) rc = cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (rc != 0) return rc;
  return finish_after(call, run(*call, *gemm, ev, device), finish_rc);  // always: join, done to the peer, poison
}

}  // extern "C"
