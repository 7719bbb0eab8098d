// fo_gather_call / fo_gather_finish: the NVLink peer route of all_gather -> GEMMs, two host calls per fused op.
//
// Every rank copies its shard into its own symmetric buffer and tells every peer; each peer's copy engine then
// pulls it (cudaMemcpyAsync from the buffer mapped here: no SM is taken from the GEMMs) and says when it is done
// reading. The caller's stream runs the GEMMs (cuBLAS, issued from Python between the two calls): the local shard's
// at once, each pulled shard's after the event of its pull. All the protocol -- the call's beginning, the bounded
// waits, the copies, the notifications -- runs on one copy stream per (device, group), in order, so calls of the
// group never overtake each other there. flashoverlap_sm90.h states the flags, the epochs and why one set of
// buffers serves every call.
//
// Cross-GPU ordering as in peer_call.cu: a system-scope fence and release add after the copy in stream order, paired
// with a bounded system-scope acquire before the reader's copy (FO_GATHER_COPY_NOTIFY, an experiment: a copy-engine
// write of the flag after the copy instead).
//
// The push schedule (FO_GATHER_PUSH: gather_start="push", "auto"'s choice on 2 ranks) turns the copies around:
// each rank copies its shard straight into slot `rank` of a set of every peer's receive buffer, so ready[j] means
// "rank j's shard is in slot j of my buffer" and done_b[j] "rank j finished reading the slot I write in set b of its
// buffer".
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "device_wait.hpp"
#include "gather_protocol.hpp"
#include "flashoverlap_sm90.h"
#include "route_util.hpp"

namespace flashoverlap {

namespace {

using namespace gp;

__device__ __forceinline__ void record_enqueue_failure(fo_fault* f, int tag) {
  int const origin = f->rank;
  record_fault(f, 4, tag, 0, 0, origin);
  int const n = f->npeers < FO_FAULT_MAX_PEERS ? f->npeers : FO_FAULT_MAX_PEERS;
  for (int i = 0; i < n; ++i) {
    if (f->peers[i] != nullptr) record_fault(f->peers[i], 4, tag, 0, 0, origin);
  }
  __threadfence_system();
}

__global__ void gather_step_kernel(GatherStep s) {
  if (s.begin) {
    s.fault->deadline_ns = (long long)global_timer_ns() + s.timeout_ns;
    s.fault->call_counter += 1;
    s.fault->current_launch = s.launch_id;
    *s.epoch += 1;
    if (s.snapshot != nullptr) *s.snapshot = *s.epoch;
    if (s.pieces > 0) {  // fo_scatter_run: this call's piece values, read by the copy engine after cur's GEMMs
      int const sent = *s.piece_sent;
      for (int i = 0; i < s.pieces; ++i) s.piece_src[i] = sent + i + 1;
      *s.piece_sent = sent + s.pieces;
    }
    __threadfence();
  }
  if (s.fail_tag != 0) record_enqueue_failure(s.fault, s.fail_tag);
  if (s.num_notify > 0) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    for (int i = 0; i < s.num_notify; ++i) {
      asm volatile("red.release.sys.global.add.s32 [%0], 1;" ::"l"(s.notify[i]) : "memory");
    }
  }
  if (s.num_wait == 0) return;
  int const base = s.counter != nullptr ? *s.counter : load_volatile(s.epoch);
  int const target = int(unsigned(base) + unsigned(s.wait_offset));
  long long const deadline = wait_deadline(s.fault, s.timeout_ns);
  for (int i = 0; i < s.num_wait; ++i) bounded_wait(s.wait[i], target, deadline, s.fault, nullptr, s.tag[i]);
  if (s.counter != nullptr && s.advance) *s.counter = base + 1;  // consumed whether or not a wait gave up
}

// The outputs of one call (contiguous, numel elements each), poisoned while the block holds a fault.
struct GatherOutputs {
  char* ptr[kMaxOutputs];
  int64_t numel[kMaxOutputs];
  int count;
};

// The call's last kernel (cur): while the block holds a fault, mirror it to the host and fill every output with the
// NaN bit pattern. Costs one load per block when there is none.
__global__ void gather_finish_kernel(fo_fault* f, int* mirror, GatherOutputs o, int elem_bytes, unsigned nan) {
  __shared__ int code;
  if (threadIdx.x == 0) code = mirror_fault(f, mirror, blockIdx.x == 0);
  __syncthreads();
  if (code == 0) return;
  int64_t const stride = int64_t(gridDim.x) * blockDim.x;
  for (int k = 0; k < o.count; ++k) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < o.numel[k]; i += stride) {
      if (elem_bytes == 2) {
        reinterpret_cast<unsigned short*>(o.ptr[k])[i] = (unsigned short)nan;
      } else {
        reinterpret_cast<unsigned*>(o.ptr[k])[i] = nan;
      }
    }
  }
}

}  // namespace

int gp::events(GatherEvents*& out) {
  thread_local std::unordered_map<int, GatherEvents> table;
  int device = 0;
  int rc = cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (rc != 0) return rc;
  GatherEvents& ev = table[device];
  if (ev.fork == nullptr) {
    for (cudaEvent_t* e : {&ev.fork, &ev.join, &ev.ready}) {
      if ((rc = cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate")) != 0) return rc;
    }
    for (cudaEvent_t* list : {ev.piece, ev.pushed}) {
      for (int i = 0; i < kMaxPieces; ++i) {
        rc = cuda_check(cudaEventCreateWithFlags(&list[i], cudaEventDisableTiming), "cudaEventCreate");
        if (rc != 0) return rc;
      }
    }
  }
  out = &ev;
  return 0;
}

gp::GatherStep gp::step_base(fo_gather_args const& p) {
  GatherStep s{};
  s.fault = p.fault;
  s.epoch = p.epoch;
  s.timeout_ns = (long long)p.timeout_ns;
  s.launch_id = p.launch_id;
  return s;
}

int gp::launch_step(GatherStep const& s, cudaStream_t stream) {
  gather_step_kernel<<<1, 1, 0, stream>>>(s);
  return cuda_check(cudaGetLastError(), "gather step kernel");
}

namespace {

// FO_GATHER_BLOCKS's own fields (flashoverlap_sm90.h): a push without copy_own or copy notification; a slot stride
// whose world slots fit one set; per peer a block and a receive copy of at most one slot, with pointers where bytes.
int check_blocks(fo_gather_args const& p) {
  if ((p.options & FO_GATHER_PUSH) == 0 || (p.options & FO_GATHER_COPY_NOTIFY) != 0 || p.copy_own != 0) {
    return fail_code(2, "fo_gather_call: FO_GATHER_BLOCKS needs FO_GATHER_PUSH, without copy_own or "
                        "FO_GATHER_COPY_NOTIFY");
  }
  if (p.phase < 0 || p.phase > 2) return fail_code(2, "fo_gather_call: phase must be 0, 1 or 2");
  if (p.slot_bytes <= 0 || p.slot_bytes > p.set_bytes / p.world) {
    return fail_code(2, "fo_gather_call: FO_GATHER_BLOCKS needs 0 < slot_bytes <= set_bytes / world");
  }
  for (int j = 0; j < p.world; ++j) {
    if (j == p.rank) continue;
    if (p.block_bytes[j] < 0 || p.block_bytes[j] > p.slot_bytes || p.recv_bytes[j] < 0 ||
        p.recv_bytes[j] > p.slot_bytes) {
      return fail_code(2, "fo_gather_call: every block and receive copy must fit one slot (0 .. slot_bytes)");
    }
    if ((p.block_bytes[j] > 0 && p.blocks[j] == nullptr) || (p.recv_bytes[j] > 0 && p.recv[j] == nullptr)) {
      return fail_code(2, "fo_gather_call: a block or receive copy with bytes needs its pointer");
    }
  }
  return 0;
}

int check_args(fo_gather_args const& p, bool finish) {
  if (p.world < 2 || p.world > kMaxWorld || p.rank < 0 || p.rank >= p.world) {
    return fail_code(2, "fo_gather: world must be in [2, FO_GATHER_MAX_WORLD] and rank in [0, world)");
  }
  if (p.fault == nullptr || p.copy_stream == nullptr) return fail_code(2, "fo_gather: fault and copy_stream are required");
  if (p.slot_set < 0 || p.slot_set >= kSlotSets || ((p.options & FO_GATHER_PUSH) == 0 && p.slot_set != 0)) {
    return fail_code(2, "fo_gather: slot_set must be in [0, FO_GATHER_SLOT_SETS), and 0 without FO_GATHER_PUSH");
  }
  if (finish) {
    if (p.num_outputs < 0 || p.num_outputs > kMaxOutputs) {
      return fail_code(2, "fo_gather_finish: num_outputs must be in [0, FO_GATHER_MAX_OUTPUTS]");
    }
    if (p.elem_bytes != 2 && p.elem_bytes != 4) return fail_code(2, "fo_gather_finish: elem_bytes must be 2 or 4");
    for (int k = 0; k < p.num_outputs; ++k) {
      if (p.outputs[k] == nullptr && p.output_numel[k] > 0) return fail_code(2, "fo_gather_finish: null output");
    }
    return 0;
  }
  if ((p.options & kBlocks) != 0) {
    if (int const rc = check_blocks(p); rc != 0) return rc;
  } else if (p.phase != 0) {
    return fail_code(2, "fo_gather_call: phase 1 and 2 need FO_GATHER_BLOCKS");
  }
  bool const staging_needed = (p.options & FO_GATHER_PUSH) == 0 || p.copy_own != 0;
  bool const a_needed = (p.options & kBlocks) == 0;
  if (p.shard_bytes <= 0 || (a_needed && p.a == nullptr) || (staging_needed && p.staging == nullptr) ||
      p.epoch == nullptr) {
    return fail_code(2, "fo_gather_call: shard_bytes must be positive; a, staging (but for a push without copy_own) "
                        "and epoch are required");
  }
  if ((p.options & FO_GATHER_PUSH) != 0 && (p.options & kBlocks) == 0 &&
      p.set_bytes < int64_t(p.world) * p.shard_bytes) {
    return fail_code(2, "fo_gather_call: FO_GATHER_PUSH needs set_bytes >= world * shard_bytes");
  }
  if ((p.options & FO_GATHER_PUSH) != 0 && (p.options & FO_GATHER_GEMM_AFTER_HANDSHAKE) != 0) {
    return fail_code(2, "fo_gather_call: FO_GATHER_PUSH excludes FO_GATHER_GEMM_AFTER_HANDSHAKE");
  }
  if ((p.options & FO_GATHER_COPY_NOTIFY) != 0 && (p.options & FO_GATHER_PUSH) == 0) {
    return fail_code(2, "fo_gather_call: FO_GATHER_COPY_NOTIFY needs FO_GATHER_PUSH");
  }
  if (p.timeout_ns <= 0) return fail_code(2, "fo_gather_call: timeout_ns must be positive");
  for (int r = 0; r < p.world; ++r) {
    if (p.buffers[r] == nullptr || p.flags[r] == nullptr) {
      return fail_code(2, "fo_gather_call: buffers and flags of every rank are required");
    }
    if (r != p.rank && p.shard_events[r] == nullptr) {
      return fail_code(2, "fo_gather_call: an event per peer is required");
    }
  }
  return 0;
}

// A call's first step (every schedule): begin (deadline, call counter, epoch e), then wait until every peer j's done
// flag at `first_done` + j in this rank's page says the peer finished reading what this call overwrites: the shared
// done[j] >= e - 1 (counter null), or the push's done_b[j] >= uses_b (counter: uses_b, advanced).
GatherStep begin_step(fo_gather_args const& p, int first_done = kDone, int* counter = nullptr) {
  GatherStep s = step_base(p);
  s.begin = 1;
  s.counter = counter;
  s.advance = counter != nullptr;
  s.wait_offset = counter != nullptr ? 0 : -1;
  for (int d = 1; d < p.world; ++d) {
    int const j = (p.rank + d) % p.world;
    s.wait[s.num_wait] = p.flags[p.rank] + first_done + j;
    s.tag[s.num_wait++] = kTagDone + j;
  }
  return s;
}

// The push schedule's fo_gather_call (flashoverlap_sm90.h, FO_GATHER_PUSH). Its first kernel runs on cur_stream,
// before the caller's GEMMs: it begins the call and waits until every peer finished reading the slots this call
// overwrites in set slot_set, which in a steady run of alternating sets is the peers' call e - 2, long over, so it
// costs the GEMMs one short launch and never couples a rank to its peers' previous call. (On the copy stream this
// wait would need an SM slot that a GEMM filling every SM frees only at its end, and the pushes behind it would wait
// as long: 2 H200s, 31st session.) The rest runs on the copy stream, which cur_stream does not wait for: the pushes
// need no SM; the ready notification and the waits for the peers' shards run when the caller's first GEMMs free an
// SM, which is when they are needed. On 3+ ranks one notification after the last push holds every peer's GEMM for
// all the pushes (4 H200s, 32nd session: 1.03x over sequential against the handshake start's 1.41x), which
// FO_GATHER_COPY_NOTIFY replaces by a copy-engine write per peer; it was no faster (33rd session: 1.085x against
// 1.100x), as step 5's waits queue behind every push on this one stream anyway.
int push_call(fo_gather_args const& p, GatherEvents* ev, cudaStream_t cur, cudaStream_t copy) {
  int const W = p.world, r = p.rank, b = p.slot_set;
  bool const blocks = (p.options & kBlocks) != 0;
  size_t const bytes = size_t(p.shard_bytes), slot = blocks ? size_t(p.slot_bytes) : bytes;
  GatherStep s{};
  if (p.phase == 2) {  // FO_GATHER_BLOCKS: the begin and the fork's record were phase 1's, on this thread
    if (!ev->push_begun) return fail_code(2, "fo_gather_call: phase 2 without a phase-1 call on this host thread");
  } else {
    ev->push_begun = false;  // whatever an earlier call left (a finish that returned early): this call's own state
    ev->push_fail_tag = 0;
    // 1. on cur: begin (deadline, call counter, epoch e); every peer j done reading the slot this rank writes in
    // set b of j's buffer (done_b[j] here reaches uses_b, this rank's pushes begun into set b so far; then uses_b +
    // 1).
    bool const by_copy = (p.options & FO_GATHER_COPY_NOTIFY) != 0 && W >= kCopyNotifyMinWorld;
    s = begin_step(p, kSetDone + b * kMaxWorld, p.flags[r] + kSetUses + b);
    if (by_copy) s.snapshot = p.flags[r] + kSetEpoch + b;
    int rc = launch_step(s, cur);
    if (rc != 0) return rc;
    ev->push_begun = true;  // from here on every notification is issued whatever fails (as fo_gather_call's)
    // 2. the fork's record: the copy stream reads `a` and the epoch after the begin (FO_GATHER_BLOCKS: each block
    // also after its own event)
    ev->fork_rc = cuda_check(cudaEventRecord(ev->fork, cur), "fork record");
    if (p.phase == 1) return ev->fork_rc;  // its failure is phase 2's too (no push then: a poisoned call)
  }
  int first = 0, fail_tag = 0;
  auto note = [&](int code, int tag) {
    if (code != 0 && first == 0) first = code;
    if (code != 0 && fail_tag == 0) fail_tag = tag;
  };
  int fork = ev->fork_rc;
  if (fork == 0) fork = cuda_check(cudaStreamWaitEvent(copy, ev->fork, 0), "fork wait");
  note(fork, kTagEnqueue);  // unforked, the pushes could read `a` before it is written: none then (poisoned call)
  bool const by_copy = (p.options & FO_GATHER_COPY_NOTIFY) != 0 && W >= kCopyNotifyMinWorld;
  // 3. a into slot r of set b of every peer's buffer, the peer that takes it first (r + 1) first. Under
  // FO_GATHER_COPY_NOTIFY on 3+ ranks each peer is told right after its push, by copy engine (a step kernel there
  // would wait for an SM the caller's GEMM holds, and every push behind it with it): two 4-byte copies of this rank's
  // own values into the peer's page, its epoch snapshot of set b into ready[r] and uses_b into ready_b[r], which are
  // what the adds of step 4 would leave there (rank r alone writes them, once per call). The sources stay until the
  // copies ran: fo_gather_finish makes cur_stream join this copy stream before the next call's begin rewrites them.
  // Stream order puts each after its push. A peer whose push or copy could not be enqueued, or any after an enqueue
  // failure, is told in step 4 instead, after the failure is recorded.
  size_t const set_offset = size_t(b) * size_t(p.set_bytes);  // fixed per workspace: sets never overlap
  int* const own = p.flags[r];
  int* const sources[2] = {own + kSetEpoch + b, own + kSetUses + b};
  GatherStep tell = step_base(p);
  for (int d = 1; d < W; ++d) {
    int const j = (r + d) % W;
    int* const flags_of_j[2] = {p.flags[j] + kReady + r, set_flag(p.flags[j], kSetReady, b, r)};
    int pushed = fork;
    void const* const src = blocks ? p.blocks[j] : p.a;
    size_t const nbytes = blocks ? size_t(p.block_bytes[j]) : bytes;
    if (pushed == 0 && blocks && p.block_events[j] != nullptr) {  // block j exists once its event fired
      pushed = cuda_check(cudaStreamWaitEvent(copy, static_cast<cudaEvent_t>(p.block_events[j]), 0), "block wait");
      note(pushed, kTagEnqueue + d);
    }
    if (pushed == 0 && nbytes > 0) {
      pushed = cuda_check(cudaMemcpyAsync(static_cast<char*>(p.buffers[j]) + set_offset + size_t(r) * slot, src,
                                          nbytes, cudaMemcpyDeviceToDevice, copy), "shard push");
      note(pushed, kTagEnqueue + d);
    }
    for (int f = 0; f < 2; ++f) {
      bool told = false;
      if (by_copy && pushed == 0 && fail_tag == 0) {
        int const crc = cuda_check(cudaMemcpyAsync(flags_of_j[f], sources[f], sizeof(int), cudaMemcpyDeviceToDevice,
                                                   copy), "ready copy");
        note(crc, kTagEnqueue + d);
        told = crc == 0;
      }
      if (!told) tell.notify[tell.num_notify++] = flags_of_j[f];
    }
  }
  // 4. ready to every peer not told by copy (on 2 ranks: every peer), after every push in stream order, recording
  // an enqueue failure first.
  tell.fail_tag = fail_tag;
  if (tell.num_notify > 0 || fail_tag != 0) {
    if (int const krc = launch_step(tell, copy); krc == 0) {
      fail_tag = 0;
    } else {
      note(krc, kTagEnqueue + W);
    }
  }
  // 5. per peer j in arrival order: its shard of this call is in slot j of set b here (ready_b[j] reaches reads_b + 1:
  // j's pushes into set b counted against this rank's set-b calls, so a rank on the other set than its peers waits
  // out its bound and the call is poisoned, never read from a stale slot; the last step counts the call); the
  // caller's GEMM of slot j waits for its event.
  for (int d = 1; d < W; ++d) {
    int const j = (r - d + W) % W;
    s = step_base(p);
    s.fail_tag = fail_tag;
    s.counter = p.flags[r] + kSetReads + b;
    s.wait_offset = 1;
    s.advance = d == W - 1;
    s.wait[0] = set_flag(p.flags[r], kSetReady, b, j);
    s.tag[0] = kTagReady + j;
    s.num_wait = 1;
    if (int const krc = launch_step(s, copy); krc == 0) {
      fail_tag = 0;
    } else {
      note(krc, kTagEnqueue + W + d);
    }
    if (blocks && p.recv_bytes[j] > 0) {  // slot j here, after its wait, into the caller's rows (copy engine)
      char const* const from = static_cast<char const*>(p.buffers[r]) + set_offset + size_t(j) * slot;
      note(cuda_check(cudaMemcpyAsync(p.recv[j], from, size_t(p.recv_bytes[j]), cudaMemcpyDeviceToDevice, copy),
                      "block receive copy"), kTagEnqueue + W + d);
    }
    note(cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(p.shard_events[j]), copy), "shard record"),
         kTagEnqueue + W + d);
  }
  // 6. with copy_own, the gathered rows: every slot of set b and a into staging, last on the copy stream (beside
  // the caller's GEMMs; fo_gather_finish joins before it tells the peers their slots here were read).
  if (p.copy_own != 0) {
    char* const staging = static_cast<char*>(p.staging);
    char const* const slots = static_cast<char const*>(p.buffers[r]) + set_offset;
    for (int d = 0; d < W; ++d) {
      int const j = (r - d + W) % W;
      void const* src = d == 0 ? p.a : static_cast<void const*>(slots + size_t(j) * bytes);
      note(cuda_check(cudaMemcpyAsync(staging + size_t(j) * bytes, src, bytes, cudaMemcpyDeviceToDevice, copy),
                      "gathered copy"), kTagEnqueue + 3 * W);
    }
  }
  ev->push_fail_tag = fail_tag;  // recorded by fo_gather_finish's done notification
  return first;
}

// The push schedule's part of fo_gather_finish, on cur_stream after the caller's GEMMs and the join (so after every
// read of this rank's slots, the gathered copy's included): done to every peer, carrying an enqueue failure no step
// kernel recorded yet; nothing for a call whose begin was not enqueued.
int push_finish(fo_gather_args const& p, GatherEvents* ev, cudaStream_t cur) {
  bool const began = ev->push_begun;
  int const fail_tag = ev->push_fail_tag;
  ev->push_begun = false;
  ev->push_fail_tag = 0;
  if (!began) return 0;
  int const W = p.world, r = p.rank;
  GatherStep s = step_base(p);  // done to every peer (the call's, and set b's: its slot here may be written again)
  s.fail_tag = fail_tag;
  for (int q = 1; q < W; ++q) {
    int* const page = p.flags[(r + q) % W];
    s.notify[s.num_notify++] = page + kDone + r;
    s.notify[s.num_notify++] = set_flag(page, kSetDone, p.slot_set, r);
  }
  return launch_step(s, cur);
}

}  // namespace

// fo_preload (api.cu): load this file's kernels too (lazy loading may synchronize the context under a spinning wait).
int gather_call_preload() {
  cudaFuncAttributes attr{};
  int rc = cuda_check(cudaFuncGetAttributes(&attr, gather_step_kernel), "fo_preload (gather route)");
  if (rc == 0) rc = cuda_check(cudaFuncGetAttributes(&attr, gather_finish_kernel), "fo_preload (gather route)");
  return rc;
}

}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_gather_call(const fo_gather_args* args) {
  if (args == nullptr) return fail_code(2, "fo_gather_call: args is null");
  fo_gather_args const& p = *args;
  int rc = check_args(p, false);
  if (rc != 0) return rc;
  GatherEvents* ev = nullptr;
  if ((rc = events(ev)) != 0) return rc;
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  auto copy = static_cast<cudaStream_t>(p.copy_stream);
  if ((p.options & FO_GATHER_PUSH) != 0) return push_call(p, ev, cur, copy);
  int const W = p.world, r = p.rank;
  size_t const bytes = size_t(p.shard_bytes);
  char* const staging = static_cast<char*>(p.staging);
  // The fork: the copy stream reads `a`, written in cur's order. Without it nothing below may run.
  if ((rc = cuda_check(cudaEventRecord(ev->fork, cur), "fork record")) != 0) return rc;
  if ((rc = cuda_check(cudaStreamWaitEvent(copy, ev->fork, 0), "fork wait")) != 0) return rc;
  // 1. begin; every peer done reading this rank's previous shard (call e - 1) before it is overwritten.
  GatherStep s = begin_step(p);
  if ((rc = launch_step(s, copy)) != 0) return rc;
  // From here on every notification is issued whatever fails (the peers stay in step); a part that could not be
  // enqueued is recorded (code 4) by the next step kernel, before it notifies, so no peer takes stale data for good.
  int first = 0, fail_tag = 0;
  auto note = [&](int code, int tag) {
    if (code != 0 && first == 0) first = code;
    if (code != 0 && fail_tag == 0) fail_tag = tag;
  };
  // 2. this rank's shard into its buffer (and the gathered tensor's slot), then ready to every peer.
  note(cuda_check(cudaMemcpyAsync(p.buffers[r], p.a, bytes, cudaMemcpyDeviceToDevice, copy), "shard copy"),
       kTagEnqueue);
  auto copy_own_slot = [&]() {
    if (p.copy_own) {
      note(cuda_check(cudaMemcpyAsync(staging + size_t(r) * bytes, p.a, bytes, cudaMemcpyDeviceToDevice, copy),
                      "own slot copy"), kTagEnqueue);
    }
  };
  bool const handshake_first = (p.options & FO_GATHER_GEMM_AFTER_HANDSHAKE) != 0;
  if (!handshake_first) copy_own_slot();  // with the handshake first: after the pulls (it delays no peer then)
  if (handshake_first) {
    // 3'. one handshake (ready to every peer, wait for every peer's ready), then cur may start its GEMMs: from here
    // on the copy stream needs no SM until the pulls are done, so a GEMM that fills every SM cannot delay them.
    s = step_base(p);
    s.fail_tag = fail_tag;
    for (int q = 1; q < W; ++q) s.notify[s.num_notify++] = p.flags[(r + q) % W] + kReady + r;
    for (int d = 1; d < W; ++d) {
      int const j = (r - d + W) % W;
      s.wait[s.num_wait] = p.flags[r] + kReady + j;
      s.tag[s.num_wait++] = kTagReady + j;
    }
    if (int const krc = launch_step(s, copy); krc == 0) {
      fail_tag = 0;
    } else {
      note(krc, kTagEnqueue + 1);
    }
    // cur's wait is a scheduling choice only (the local GEMMs read `a`; each pulled shard's GEMM waits for its own
    // event): if it cannot be enqueued, the call goes on without it (same results, the peers unaffected).
    if (cudaEventRecord(ev->ready, copy) != cudaSuccess || cudaStreamWaitEvent(cur, ev->ready, 0) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    for (int d = 1; d < W; ++d) {
      int const j = (r - d + W) % W;
      note(cuda_check(cudaMemcpyAsync(staging + size_t(j) * bytes, p.buffers[j], bytes, cudaMemcpyDeviceToDevice,
                                      copy), "shard pull"), kTagEnqueue + d);
      note(cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(p.shard_events[j]), copy), "shard record"),
           kTagEnqueue + d);
    }
    copy_own_slot();
    s = step_base(p);  // done to every peer
    s.fail_tag = fail_tag;
    for (int q = 1; q < W; ++q) s.notify[s.num_notify++] = p.flags[(r + q) % W] + kDone + r;
    int const krc = launch_step(s, copy);
    return first != 0 ? first : krc;
  }
  // 3. per peer in arrival order: notify (ready to all at first, then done to the previous peer), wait, pull.
  int prev = -1;
  for (int d = 1; d < W; ++d) {
    int const j = (r - d + W) % W;
    s = step_base(p);
    s.fail_tag = fail_tag;
    if (prev < 0) {
      for (int q = 1; q < W; ++q) s.notify[s.num_notify++] = p.flags[(r + q) % W] + kReady + r;
    } else {
      s.notify[s.num_notify++] = p.flags[prev] + kDone + r;
    }
    s.wait[0] = p.flags[r] + kReady + j;
    s.tag[0] = kTagReady + j;
    s.num_wait = 1;
    if (int const krc = launch_step(s, copy); krc == 0) {
      fail_tag = 0;  // recorded by that kernel
    } else {
      note(krc, kTagEnqueue + d);  // the next step kernel records it
    }
    note(cuda_check(cudaMemcpyAsync(staging + size_t(j) * bytes, p.buffers[j], bytes, cudaMemcpyDeviceToDevice, copy),
                    "shard pull"), kTagEnqueue + d);
    note(cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(p.shard_events[j]), copy), "shard record"),
         kTagEnqueue + d);
    prev = j;
  }
  s = step_base(p);  // done to the last peer pulled
  s.fail_tag = fail_tag;
  s.notify[s.num_notify++] = p.flags[prev] + kDone + r;
  int const krc = launch_step(s, copy);
  return first != 0 ? first : krc;
}

FO_API int fo_gather_finish(const fo_gather_args* args) {
  if (args == nullptr) return fail_code(2, "fo_gather_finish: args is null");
  fo_gather_args const& p = *args;
  int rc = check_args(p, true);
  if (rc != 0) return rc;
  GatherEvents* ev = nullptr;
  if ((rc = events(ev)) != 0) return rc;
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  auto copy = static_cast<cudaStream_t>(p.copy_stream);
  rc = cuda_check(cudaEventRecord(ev->join, copy), "join record");
  if (rc == 0) rc = cuda_check(cudaStreamWaitEvent(cur, ev->join, 0), "join wait");
  if ((p.options & FO_GATHER_PUSH) != 0) {
    // push: done to the peers only after the join (the copy stream's gathered copy read the slots). Without a join
    // the slots may still be read: no done then, so the peers' next pushes wait out their bound (a fault, poisoned)
    // rather than overwrite them.
    if (rc != 0) {
      ev->push_begun = false;
      ev->push_fail_tag = 0;
      return rc;
    }
    rc = push_finish(p, ev, cur);
  } else if (rc != 0) {
    return rc;
  }
  GatherOutputs o{};
  for (int k = 0; k < p.num_outputs; ++k) {
    if (p.output_numel[k] <= 0) continue;
    o.ptr[o.count] = static_cast<char*>(p.outputs[k]);
    o.numel[o.count++] = p.output_numel[k];
  }
  gather_finish_kernel<<<32, 256, 0, cur>>>(p.fault, p.mirror, o, p.elem_bytes, nan_bits(p.elem_bytes, p.bf16 != 0));
  int const krc = cuda_check(cudaGetLastError(), "gather finish kernel");
  return rc != 0 ? rc : krc;
}

}  // extern "C"
