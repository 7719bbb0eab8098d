// fo_ring_call: the ring route of a fused reduce_scatter / all_reduce on `world` ranks, one host call per fused op.
//
// The two-rank peer route (peer_call.cu) generalised to a ring: the GEMM runs as world steps per round, one piece
// of rows each, and each step's epilogue adds, as CUTLASS's C operand, the partial sum of the same piece that the
// next rank pushed into this rank's memory at its previous step; the result goes on to the previous rank. After
// world steps every piece has collected every rank's partial, so the reduce_scatter is done in the epilogues of
// GEMMs that hold the SMs anyway: no NCCL kernel, no reduction kernel. all_reduce then pulls the other ranks'
// reduced pieces by copy engine, round by round, while the next round computes. flashoverlap_sm90.h states the
// schedule, the buffer layout and why one set of buffers serves every call.
//
// Cross-GPU ordering as in peer_call.cu: a release add at system scope after a step in stream order, paired with a
// bounded system-scope acquire (the gate before each tile's C load, or a wait kernel).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "flashoverlap_sm90.h"
#include "registry.hpp"
#include "route_util.hpp"

namespace flashoverlap {

namespace {

constexpr int kMaxWorld = FO_RING_MAX_WORLD;
constexpr int kMaxRounds = 16;
// Error-record tags (the NCCL route tags its waits with the group index, the peer route from 1000)
constexpr int kTagArrive = 2000;  // + 16 t + s: the next rank's push of step s, round t
constexpr int kTagReady = 2400;   // + 16 t + p: rank p's reduced piece of round t
constexpr int kTagDone = 2800;    // the readers of this rank's buffers are done

// The flag indices of flashoverlap_sm90.h (ints in every rank's ring flag area).
struct FlagIndex {
  int world, rounds;
  int arrival(int t, int s) const { return t * (world - 1) + s; }
  int rs_done() const { return rounds * (world - 1); }
  int ready(int t, int p) const { return rounds * (world - 1) + 1 + t * world + p; }
  int ar_done() const { return ready(rounds, 0); }
  int count() const { return ar_done() + 1; }
};

struct NotifyList {
  int* flag[kMaxWorld];
  int n;
};

// One thread: a system-scope fence, then a release add of 1 to each flag (other GPUs' memory, mapped here).
__global__ void notify_list_kernel(NotifyList list) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  for (int i = 0; i < list.n; ++i) {
    asm volatile("red.release.sys.global.add.s32 [%0], 1;" ::"l"(list.flag[i]) : "memory");
  }
}

struct RingEvents {
  cudaEvent_t round = nullptr;
  cudaEvent_t join[kMaxWorld] = {};
};

// Per host thread and device, like peer_call.cu's events.
int events(RingEvents*& out) {
  thread_local std::unordered_map<int, RingEvents> table;
  int device = 0;
  int rc = cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (rc != 0) return rc;
  RingEvents& ev = table[device];
  if (ev.round == nullptr) {
    if ((rc = cuda_check(cudaEventCreateWithFlags(&ev.round, cudaEventDisableTiming), "cudaEventCreate")) != 0) {
      return rc;
    }
    for (cudaEvent_t& e : ev.join) {
      if ((rc = cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate")) != 0) return rc;
    }
  }
  out = &ev;
  return 0;
}

int check_args(fo_ring_args const& p, GemmConfig const*& c1, GemmConfig const*& c2) {
  c1 = config_at(p.config_first);
  c2 = config_at(p.config_add);
  if (c1 == nullptr || c2 == nullptr) return fail_code(1, "fo_ring_call: no such configuration");
  if (c1->add_c != 0 || c2->add_c != 1) {
    return fail_code(2, "fo_ring_call: config_first must be a plain configuration, config_add an _addc one without "
                        "an aux store");
  }
  if (p.world < 2 || p.world > kMaxWorld || p.rank < 0 || p.rank >= p.world) {
    return fail_code(2, "fo_ring_call: world must be in [2, FO_RING_MAX_WORLD] and rank in [0, world)");
  }
  if (p.rounds < 1 || p.rounds > kMaxRounds || FlagIndex{p.world, p.rounds}.count() > FO_RING_FLAGS) {
    return fail_code(2, "fo_ring_call: rounds must be in [1, 16] with the flags within FO_RING_FLAGS");
  }
  if (p.rows <= 0 || p.n <= 0 || p.k <= 0) return fail_code(2, "fo_ring_call: sizes must be positive");
  if (p.expected == nullptr || p.out == nullptr || p.fault == nullptr) {  // cur_stream may be null: legacy stream
    return fail_code(2, "fo_ring_call: expected, out and fault are required");
  }
  if (p.timeout_ns <= 0) return fail_code(2, "fo_ring_call: timeout_ns must be positive");
  for (int r = 0; r < p.world; ++r) {
    if (p.buffers[r] == nullptr || p.flags[r] == nullptr) {
      return fail_code(2, "fo_ring_call: buffers and flags of every rank are required");
    }
  }
  if (p.all_reduce) {
    if (p.side_stream == nullptr) return fail_code(2, "fo_ring_call: all_reduce needs side_stream");
    for (int d = 1; d < p.world; ++d) {
      if (p.pull_streams[d - 1] == nullptr) return fail_code(2, "fo_ring_call: all_reduce needs world - 1 pull streams");
    }
  }
  return 0;
}

// What one call addresses: pieces, slots and own pieces of every rank.
struct RingLayout {
  fo_ring_args const& p;
  size_t piece_bytes() const { return size_t(p.rows) * size_t(p.n) * size_t(p.elem_bytes); }
  int64_t first_row(int chunk, int t) const { return int64_t(chunk) * p.rows * p.rounds + int64_t(t) * p.rows; }
  char* slot(int owner, int t, int s) const {
    return static_cast<char*>(p.buffers[owner]) + (size_t(t) * (p.world - 1) + s) * piece_bytes();
  }
  char* own_piece(int owner, int t) const {
    return static_cast<char*>(p.buffers[owner]) + (size_t(p.rounds) * (p.world - 1) + t) * piece_bytes();
  }
  char* out_rows(int64_t row) const { return static_cast<char*>(p.out) + row * p.ld_out * p.elem_bytes; }
};

// Round t's world GEMM steps on cur (flashoverlap_sm90.h), with the flag after each push.
int ring_round(fo_ring_args const& p, GemmConfig const& c1, GemmConfig const& c2, int t, cudaStream_t cur) {
  FlagIndex const fi{p.world, p.rounds};
  RingLayout const lay{p};
  StepOperands const ops{p.a, p.lda, p.b, p.ldb, p.bias, p.n, p.k, p.elem_bytes, p.signal_mode, p.sm_count,
                         p.raster, p.swizzle, p.workspace, p.workspace_bytes};
  int const W = p.world, r = p.rank, prev = (r + W - 1) % W;
  bool const gate = p.gate_in_kernel != 0;
  int rc = 0;
  for (int s = 0; s < W && rc == 0; ++s) {
    int const chunk = (r + s + 1) % W;
    bool const last = s == W - 1;
    void* d = last ? (p.all_reduce ? lay.own_piece(r, t) : lay.out_rows(int64_t(t) * p.rows)) : lay.slot(prev, t, s);
    int64_t const ldd = (last && !p.all_reduce) ? p.ld_out : p.n;
    GemmCall call = step_call(ops, int(lay.first_row(chunk, t)), p.rows, s == 0 ? nullptr : lay.slot(r, t, s - 1),
                              d, ldd, cur);
    if (s > 0 && gate) {  // before each C load: the next rank's push of step s - 1 has arrived
      int const idx = fi.arrival(t, s - 1);
      call.gate_flag = p.flags[r] + idx;
      call.gate_target = p.expected + idx;
      call.gate_timeout_ns = (long long)p.timeout_ns;
      call.gate_error_record = reinterpret_cast<int*>(p.fault);
      call.gate_tag = kTagArrive + 16 * t + s - 1;
    }
    rc = run_step(s == 0 ? c1 : c2, call);
    if (rc == 0 && !last) {  // tell rank r - 1 its slot (t, s) is full; without the gate, wait for ours here
      int const idx = fi.arrival(t, s);
      bool const begin = t == 0 && s == 0;  // the call's first wait kernel: its deadline starts here
      rc = gate ? route_wait(p, nullptr, p.expected + idx, 1, 0, cur, p.flags[prev] + idx, false, begin)
                : route_wait(p, p.flags[r] + idx, p.expected + idx, 1, kTagArrive + 16 * t + s, cur,
                             p.flags[prev] + idx, true, begin);
    }
  }
  return rc;
}

// The call's last kernel on cur: NaN into out's `rows` rows while the fault block holds a fault, and the mirror.
int finish(fo_ring_args const& p, GemmConfig const& c, int64_t rows, cudaStream_t cur) {
  return launch_fault_finish(p.fault, p.mirror, p.out, rows, p.n, p.ld_out, p.elem_bytes,
                             nan_bits(p.elem_bytes, c.dtype == 0), cur);
}

// all_reduce, after round t: tell every peer this rank's piece is ready; pull theirs into out (and copy ours).
int gather_round(fo_ring_args const& p, RingEvents& ev, int t, cudaStream_t cur) {
  FlagIndex const fi{p.world, p.rounds};
  RingLayout const lay{p};
  int const W = p.world, r = p.rank;
  NotifyList list{};
  for (int d = 1; d < W; ++d) list.flag[list.n++] = p.flags[(r + d) % W] + fi.ready(t, r);
  notify_list_kernel<<<1, 1, 0, cur>>>(list);
  int rc = cuda_check(cudaGetLastError(), "ring notify kernel");
  if (rc == 0) rc = cuda_check(cudaEventRecord(ev.round, cur), "round record");
  auto side = static_cast<cudaStream_t>(p.side_stream);
  if (rc == 0) rc = cuda_check(cudaStreamWaitEvent(side, ev.round, 0), "round wait");
  if (rc == 0) {
    rc = copy_rows(lay.out_rows(lay.first_row(r, t)), p.ld_out, lay.own_piece(r, t), p.n, 0, p.rows, p.n,
                   p.elem_bytes, side);
  }
  for (int d = 1; d < W && rc == 0; ++d) {
    int const peer = (r + d) % W;
    auto pull = static_cast<cudaStream_t>(p.pull_streams[d - 1]);
    rc = cuda_check(cudaStreamWaitEvent(pull, ev.round, 0), "round wait");
    if (rc == 0) {
      rc = route_wait(p, p.flags[r] + fi.ready(t, peer), p.expected + fi.ready(t, peer), 1, kTagReady + 16 * t + peer,
                      pull, nullptr);
    }
    if (rc == 0) {
      rc = copy_rows(lay.out_rows(lay.first_row(peer, t)), p.ld_out, lay.own_piece(peer, t), p.n, 0, p.rows, p.n,
                     p.elem_bytes, pull);
    }
  }
  return rc;
}

}  // namespace

// fo_preload (api.cu): load this file's kernel too (lazy loading may synchronize the context under a spinning wait).
int ring_call_preload() {
  cudaFuncAttributes attr{};
  return cuda_check(cudaFuncGetAttributes(&attr, notify_list_kernel), "fo_preload (ring route)");
}

}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_ring_call(const fo_ring_args* args) {
  if (args == nullptr) return fail_code(2, "fo_ring_call: args is null");
  fo_ring_args const& p = *args;
  GemmConfig const *c1 = nullptr, *c2 = nullptr;
  int rc = check_args(p, c1, c2);
  if (rc != 0) return rc;
  RingEvents* ev = nullptr;
  if ((rc = events(ev)) != 0) return rc;
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  FlagIndex const fi{p.world, p.rounds};
  bool forked = false;  // any work queued on the side or pull streams (which cur must then join)
  for (int t = 0; t < p.rounds && rc == 0; ++t) {
    rc = ring_round(p, *c1, *c2, t, cur);
    if (rc == 0 && p.all_reduce) {
      forked = true;
      rc = gather_round(p, *ev, t, cur);
    }
  }
  if (!p.all_reduce) {  // one flag each way: rank r + 1's pushes are read; wait until rank r - 1 has read ours
    if (rc == 0) {
      rc = route_wait(p, p.flags[p.rank] + fi.rs_done(), p.expected + fi.rs_done(), 1, kTagDone, cur,
                      p.flags[(p.rank + 1) % p.world] + fi.rs_done(), true);
    }
    if (rc == 0) rc = finish(p, *c2, int64_t(p.rounds) * p.rows, cur);
    return rc;
  }
  if (forked) {  // join even after a failure, so cur never runs ahead of work already queued on the other streams
    int rc_join = 0;
    for (int d = 0; d < p.world && rc_join == 0; ++d) {
      auto s = static_cast<cudaStream_t>(d == 0 ? p.side_stream : p.pull_streams[d - 1]);
      rc_join = cuda_check(cudaEventRecord(ev->join[d], s), "join record");
      if (rc_join == 0) rc_join = cuda_check(cudaStreamWaitEvent(cur, ev->join[d], 0), "join wait");
    }
    if (rc == 0) rc = rc_join;
  }
  if (rc == 0) {  // a barrier: this rank's reads are all done (joined); tell every peer, wait for all of theirs
    NotifyList list{};
    for (int d = 1; d < p.world; ++d) list.flag[list.n++] = p.flags[(p.rank + d) % p.world] + fi.ar_done();
    notify_list_kernel<<<1, 1, 0, cur>>>(list);
    rc = cuda_check(cudaGetLastError(), "ring notify kernel");
  }
  if (rc == 0) {  // then no rank reads any region of call i any more, whatever layout call i + 1 gives them
    rc = route_wait(p, p.flags[p.rank] + fi.ar_done(), p.expected + fi.ar_done(), p.world - 1, kTagDone, cur, nullptr);
  }
  if (rc == 0) rc = finish(p, *c2, int64_t(p.world) * p.rounds * p.rows, cur);
  return rc;
}

}  // extern "C"
