// fo_fused_call: one fused GEMM + per-group collectives issued from C (one host call per fused op).
//
// Order of work (all asynchronous; the host returns after enqueueing):
//   caller stream:  expected := counters (epoch resync), fork event, signal GEMM into d
//   side stream:    waits for the fork; per group: bounded wait kernel, the group's staging copy d -> buf (if
//                   any: reduce_scatter with the tile-row order), then the group's NCCL call(s)
//                   (all_reduce in place / reduce_scatter buf -> out / grouped send+recv + a local copy)
//   caller stream:  waits for the side stream's join event
// The fork is recorded before the GEMM launch, so the side stream depends on the GEMM's inputs but not on the
// GEMM itself; it is released group by group by the GEMM's tile counters. NCCL is reached through the library
// already loaded in the process (fo_nccl_bind), with the communicator the caller passes (the process group's).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <string>
#include <unordered_map>

#include <chrono>
#include <thread>

#include "flashoverlap_sm90.h"
#include "registry.hpp"
#include "route_util.hpp"

namespace flashoverlap {
namespace {

using NcclResult = int;  // ncclResult_t: 0 success, 7 in progress (non-blocking communicators)
using AllReduceFn = NcclResult (*)(void const*, void*, size_t, int, int, void*, cudaStream_t);
using ReduceScatterFn = NcclResult (*)(void const*, void*, size_t, int, int, void*, cudaStream_t);
using ReduceFn = NcclResult (*)(void const*, void*, size_t, int, int, int, void*, cudaStream_t);
using SendFn = NcclResult (*)(void const*, size_t, int, int, void*, cudaStream_t);
using RecvFn = NcclResult (*)(void*, size_t, int, int, void*, cudaStream_t);
using GroupFn = NcclResult (*)();
using ErrorStringFn = char const* (*)(NcclResult);
using AsyncErrorFn = NcclResult (*)(void*, NcclResult*);

struct Nccl {
  AllReduceFn all_reduce = nullptr;
  ReduceScatterFn reduce_scatter = nullptr;
  ReduceFn reduce = nullptr;  // optional: only step kind 4 needs it
  SendFn send = nullptr;
  RecvFn recv = nullptr;
  GroupFn group_start = nullptr;
  GroupFn group_end = nullptr;
  ErrorStringFn error_string = nullptr;
  AsyncErrorFn async_error = nullptr;  // ncclCommGetAsyncError: waits out ncclInProgress (non-blocking comms)
  bool ready() const { return all_reduce && reduce_scatter && send && recv && group_start && group_end; }
};

Nccl& nccl() {
  static Nccl n;
  return n;
}

constexpr int kNcclSum = 0;
constexpr int kNcclMax = 2;
constexpr int kNcclInt32 = 2;
constexpr int kNcclFloat16 = 6;
constexpr int kNcclInProgress = 7;

// The communicator and bound of the NCCL calls being issued (set by fo_fused_call for nccl_check).
thread_local void* current_comm = nullptr;
thread_local long long current_timeout_ns = 0;

// Test-only fault injection (fo_nccl_inject; all zero = off). countdown > 0: armed; the NCCL enqueue call that
// takes it from 1 to 0 is the injected one. Process-wide atomics: fused calls may come from several host threads.
struct Injection {
  std::atomic<long long> countdown{0};
  std::atomic<int> code{0};
  std::atomic<long long> pending_polls{0};  // polls to report once the injected ncclInProgress fires
  std::atomic<long long> polls{0};          // in-progress polls still to report
  std::atomic<long long> stall_ns{0};  // the next fused call's stall before its GEMM (ns)
  std::atomic<long long> fired{0}, polled{0}, stalled{0};
};

Injection& injection() {
  static Injection in;
  return in;
}

// One NCCL enqueue call through the injection point: `call` makes the real call. Unarmed: one relaxed load.
template <class F>
NcclResult enqueue(F&& call) {
  Injection& in = injection();
  if (in.countdown.load(std::memory_order_relaxed) > 0 && in.countdown.fetch_sub(1) == 1) {
    in.fired.fetch_add(1);
    int const code = in.code.load();
    if (code != kNcclInProgress) return code;  // refused: nothing enqueued
    NcclResult const r = call();
    if (r != 0) return r;
    in.polls.store(in.pending_polls.load());
    return kNcclInProgress;  // enqueued, reported as still in progress (polls follow)
  }
  return call();
}

// One poll of the communicator's state (ncclCommGetAsyncError), or an injected "still in progress".
NcclResult poll_async(void* comm, NcclResult* state) {
  Injection& in = injection();
  if (in.polls.load(std::memory_order_relaxed) > 0 && in.polls.fetch_sub(1) > 0) {
    in.polled.fetch_add(1);
    *state = kNcclInProgress;
    return 0;
  }
  return nccl().async_error(comm, state);
}

// Spins `ns` nanoseconds of GPU time (the injected stall); one thread.
__global__ void inject_spin_kernel(long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while ((long long)(now - start) < ns);
}

// ncclInProgress (a non-blocking communicator) is waited out with ncclCommGetAsyncError, bounded by the call's
// timeout; any other result but success is an error.
int nccl_check(NcclResult r, char const* what) {
  if (r == kNcclInProgress) {
    if (nccl().async_error == nullptr || current_comm == nullptr) {
      return fail_code(300 + r, std::string(what) + " returned ncclInProgress and the bound NCCL lacks "
                                                     "ncclCommGetAsyncError");
    }
    auto const until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(current_timeout_ns);
    while (r == kNcclInProgress) {
      NcclResult state = 0;
      NcclResult q = poll_async(current_comm, &state);
      if (q != 0) { r = q; break; }
      r = state;
      if (r == kNcclInProgress && std::chrono::steady_clock::now() > until) {
        return fail_code(300 + r, std::string(what) + " still in progress after the wait timeout");
      }
      if (r == kNcclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(1));
    }
  }
  if (r == 0) return 0;
  char const* msg = nccl().error_string ? nccl().error_string(r) : "?";
  return fail_code(300 + r, std::string(what) + " failed: NCCL error " + std::to_string(r) + " (" + msg + ")");
}

struct Events {
  cudaEvent_t fork = nullptr, join = nullptr;
};

// Per host thread and device: two threads (e.g. autograd's device thread and the main one) must not interleave
// record/wait pairs on one event.
int events_for_current_device(Events*& out) {
  thread_local std::unordered_map<int, Events> table;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return fail_code(100 + int(e), std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  Events& ev = table[device];
  if (ev.fork == nullptr) {
    if ((e = cudaEventCreateWithFlags(&ev.fork, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&ev.join, cudaEventDisableTiming)) != cudaSuccess) {
      return fail_code(100 + int(e), std::string("cudaEventCreate: ") + cudaGetErrorString(e));
    }
  }
  out = &ev;
  return 0;
}

// Group g's rows from the GEMM output d into the collective's buffer on `side` (after its wait, before its
// collective): one 2-D copy of copy_height pieces of copy_width elements (d and buf pitches in elements).
int stage_group(fo_group_step const& s, char const* d, char* buf, int elem_bytes, cudaStream_t side) {
  if (s.copy_width <= 0 || s.copy_height <= 0) return 0;
  size_t const e = size_t(elem_bytes);
  return cuda_check(cudaMemcpy2DAsync(buf + s.copy_dst * e, size_t(s.copy_dst_pitch) * e, d + s.copy_src * e,
                                      size_t(s.copy_src_pitch) * e, size_t(s.copy_width) * e, size_t(s.copy_height),
                                      cudaMemcpyDeviceToDevice, side),
                    "stage copy");
}

// Group g's collective(s) on `side` (after its wait).
int issue_group(fo_group_step const& s, fo_p2p_step const* p2p, char* buf, char* out, int elem_bytes, int dtype,
                void* comm, cudaStream_t side) {
  Nccl const& n = nccl();
  switch (s.kind) {
    case 0:
      if (s.count == 0) return 0;
      return nccl_check(enqueue([&] { return n.all_reduce(buf + s.buf_offset * elem_bytes,
                                                          buf + s.buf_offset * elem_bytes, size_t(s.count), dtype,
                                                          kNcclSum, comm, side); }),
                        "ncclAllReduce");
    case 1:
      if (s.count == 0) return 0;
      return nccl_check(enqueue([&] { return n.reduce_scatter(buf + s.buf_offset * elem_bytes,
                                                              out + s.out_offset * elem_bytes, size_t(s.count),
                                                              dtype, kNcclSum, comm, side); }),
                        "ncclReduceScatter");
    case 2: {
      if (s.num_p2p > 0) {
        int rc = nccl_check(n.group_start(), "ncclGroupStart");
        for (int i = 0; rc == 0 && i < s.num_p2p; ++i) {
          fo_p2p_step const& p = p2p[s.first_p2p + i];
          rc = p.recv ? nccl_check(enqueue([&] { return n.recv(out + p.offset * elem_bytes, size_t(p.count), dtype,
                                                               p.peer, comm, side); }), "ncclRecv")
                      : nccl_check(enqueue([&] { return n.send(buf + p.offset * elem_bytes, size_t(p.count), dtype,
                                                               p.peer, comm, side); }), "ncclSend");
        }
        int rc_end = nccl_check(n.group_end(), "ncclGroupEnd");  // always close the group
        if (rc != 0) return rc;
        if (rc_end != 0) return rc_end;
      }
      if (s.local_count > 0) {
        return cuda_check(cudaMemcpyAsync(out + s.local_out * elem_bytes, buf + s.local_buf * elem_bytes,
                                          size_t(s.local_count) * elem_bytes, cudaMemcpyDeviceToDevice, side),
                          "local copy");
      }
      return 0;
    }
    case 4: {  // reduce_scatter from natural rows: one ncclReduce per chunk piece (peer = the chunk's rank, the
               // root), grouped; each root receives its sum at out + out_offset
      if (s.num_p2p == 0) return 0;
      if (n.reduce == nullptr) return fail_code(8, "fo_fused_call: the bound NCCL lacks ncclReduce");
      int rc = nccl_check(n.group_start(), "ncclGroupStart");
      for (int i = 0; rc == 0 && i < s.num_p2p; ++i) {
        fo_p2p_step const& p = p2p[s.first_p2p + i];
        rc = nccl_check(enqueue([&] { return n.reduce(buf + p.offset * elem_bytes, out + s.out_offset * elem_bytes,
                                                      size_t(p.count), dtype, kNcclSum, p.peer, comm, side); }),
                        "ncclReduce");
      }
      int rc_end = nccl_check(n.group_end(), "ncclGroupEnd");
      return rc != 0 ? rc : rc_end;
    }
    default:
      return 0;
  }
}

}  // namespace
}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_nccl_bind(const char* path) {
  void* h = loaded_library("fo_nccl_bind", path);
  if (h == nullptr) return 8;
  Nccl n;
  n.all_reduce = reinterpret_cast<AllReduceFn>(dlsym(h, "ncclAllReduce"));
  n.reduce_scatter = reinterpret_cast<ReduceScatterFn>(dlsym(h, "ncclReduceScatter"));
  n.reduce = reinterpret_cast<ReduceFn>(dlsym(h, "ncclReduce"));
  n.send = reinterpret_cast<SendFn>(dlsym(h, "ncclSend"));
  n.recv = reinterpret_cast<RecvFn>(dlsym(h, "ncclRecv"));
  n.group_start = reinterpret_cast<GroupFn>(dlsym(h, "ncclGroupStart"));
  n.group_end = reinterpret_cast<GroupFn>(dlsym(h, "ncclGroupEnd"));
  n.error_string = reinterpret_cast<ErrorStringFn>(dlsym(h, "ncclGetErrorString"));
  n.async_error = reinterpret_cast<AsyncErrorFn>(dlsym(h, "ncclCommGetAsyncError"));
  if (!n.ready()) return fail_code(8, std::string("fo_nccl_bind: ") + path + " lacks NCCL's collective symbols");
  nccl() = n;
  return 0;
}

FO_API int fo_nccl_inject(int64_t nth, int code, int64_t polls, int64_t stall_ns) {
  Injection& in = injection();
  if (stall_ns > 0) {  // loaded now (current device), never lazily beside a spinning wait kernel (fo_preload)
    cudaFuncAttributes attr{};
    cudaError_t e = cudaFuncGetAttributes(&attr, reinterpret_cast<void const*>(inject_spin_kernel));
    if (e != cudaSuccess) return fail_code(100 + int(e), std::string("fo_nccl_inject: ") + cudaGetErrorString(e));
  }
  in.countdown.store(0);  // disarmed while the fields change
  in.fired.store(0), in.polled.store(0), in.stalled.store(0);
  in.code.store(code), in.polls.store(0), in.stall_ns.store(stall_ns > 0 ? stall_ns : 0);
  in.pending_polls.store(polls > 0 ? polls : 0);
  in.countdown.store(nth > 0 ? nth : 0);
  return 0;
}

FO_API int fo_nccl_inject_stats(int64_t* fired, int64_t* polled, int64_t* stalled) {
  Injection& in = injection();
  if (fired != nullptr) *fired = in.fired.load();
  if (polled != nullptr) *polled = in.polled.load();
  if (stalled != nullptr) *stalled = in.stalled.load();
  return 0;
}

FO_API int fo_fused_call(int config, const void* a, int64_t lda, const void* b, int64_t ldb, const void* bias,
                         void* d, void* buf, int64_t ldd, int m, int n, int k, const int* group_of_tile_row,
                         const int* tile_row_order, int signal_mode, int sm_count, int raster, int swizzle,
                         void* workspace, size_t workspace_bytes,
                         int* counters, int* expected, int num_groups, const fo_group_step* steps,
                         const fo_p2p_step* p2p, void* out, int elem_bytes, int nccl_dtype, void* comm,
                         int64_t timeout_ns, fo_fault* fault, int* mirror, int32_t launch_id, int64_t out_numel,
                         int32_t rank, void* cur_stream, void* side_stream) {
  if (!nccl().ready()) return fail_code(8, "fo_fused_call: call fo_nccl_bind first");
  if (num_groups < 1 || steps == nullptr || counters == nullptr || expected == nullptr || fault == nullptr) {
    return fail_code(2, "fo_fused_call: needs >= 1 group, steps, counters, expected and fault");
  }
  if (timeout_ns <= 0) return fail_code(2, "fo_fused_call: timeout_ns must be positive");
  GemmConfig const* c = config_at(config);
  if (c == nullptr) return fail_code(1, "fo_fused_call: no configuration " + std::to_string(config));
  auto cur = static_cast<cudaStream_t>(cur_stream);
  auto side = static_cast<cudaStream_t>(side_stream);
  Events* ev = nullptr;
  int rc = events_for_current_device(ev);
  if (rc != 0) return rc;
  bool const rows = m > 0;
  if (rows) {  // epoch resync: every earlier user of these counters has been joined into `cur`
    rc = cuda_check(cudaMemcpyAsync(expected, counters, size_t(num_groups) * sizeof(int), cudaMemcpyDeviceToDevice,
                                    cur), "epoch resync");
    if (rc != 0) return rc;
  }
  if ((rc = cuda_check(cudaEventRecord(ev->fork, cur), "fork record")) != 0) return rc;
  if ((rc = cuda_check(cudaStreamWaitEvent(side, ev->fork, 0), "fork wait")) != 0) return rc;
  if (rows) {
    long long const stall = injection().stall_ns.exchange(0);
    if (stall > 0) {  // injected: this rank's GEMM starts `stall` ns after the fork (its waits' deadline is set)
      inject_spin_kernel<<<1, 1, 0, cur>>>(stall);
      if ((rc = cuda_check(cudaGetLastError(), "injected stall")) != 0) return rc;
      injection().stalled.fetch_add(1);
    }
    GemmCall call{a,        lda,       b,        ldb,         bias,     d,      ldd,     m,
                  n,        k,         counters, group_of_tile_row, tile_row_order, signal_mode, sm_count, raster,
                  swizzle,  workspace, workspace_bytes, cur};
    std::string err;
    rc = c->run(call, err);
    if (rc != 0) return fail_code(rc, err);  // nothing is queued on `side` but the fork: no join needed
  }
  current_comm = comm;
  current_timeout_ns = (long long)timeout_ns;
  char* const dp = static_cast<char*>(d);
  char* const bufp = static_cast<char*>(buf);
  char* const outp = static_cast<char*>(out);
  bool begun = false;
  int first_error = 0;
  // Every group's NCCL call(s) are issued even after an earlier part failed to enqueue (recorded as code 4, so every
  // rank's output is poisoned): the peers are never left waiting for a collective this rank skipped.
  for (int g = 0; g < num_groups; ++g) {
    int step_rc = 0;
    if (steps[g].tiles > 0) {
      WaitArgs w{};
      w.counter = counters + g, w.expected = expected + g, w.increment = steps[g].tiles, w.fault = fault;
      w.timeout_ns = (long long)timeout_ns, w.tag = g, w.begin = !begun, w.launch_id = launch_id, w.rank = rank;
      step_rc = launch_wait(w, side);
      begun = begun || step_rc == 0;
    }
    if (step_rc == 0) step_rc = stage_group(steps[g], dp, bufp, elem_bytes, side);
    if (step_rc != 0) {
      launch_fault_local(fault, g, side);
      if (first_error == 0) first_error = step_rc;
    }
    bool const last = g == num_groups - 1;
    if (last) {  // the fault exchange travels in the last group's NCCL group
      int x = launch_fault_exchange(fault, !begun, (long long)timeout_ns, launch_id, rank, side);
      if (x != 0 && first_error == 0) first_error = x;
      x = nccl_check(nccl().group_start(), "ncclGroupStart");
      if (x != 0) return x;  // NCCL itself is broken here: the caller aborts the communicator
    }
    int const nrc = issue_group(steps[g], p2p, bufp, outp, elem_bytes, nccl_dtype, comm, side);
    if (last) {
      int const xrc = nccl_check(enqueue([&] { return nccl().all_reduce(&fault->exchange, &fault->exchange, 1,
                                                                        kNcclInt32, kNcclMax, comm, side); }),
                                 "ncclAllReduce (fault exchange)");
      int const erc = nccl_check(nccl().group_end(), "ncclGroupEnd");
      if (nrc == 0 && xrc != 0) return xrc;
      if (nrc == 0 && erc != 0) return erc;
    }
    if (nrc != 0) return nrc;  // NCCL failed to enqueue: the caller aborts the communicator (torch's abort path)
  }
  // Join even after a failure, so the caller's stream never runs ahead of work already queued on `side`.
  int rc_join = cuda_check(cudaEventRecord(ev->join, side), "join record");
  if (rc_join == 0) rc_join = cuda_check(cudaStreamWaitEvent(cur, ev->join, 0), "join wait");
  // The poison runs on `cur` after the join, i.e. after this rank's GEMM too: a GEMM that started late (a stalled
  // rank whose own wait gave up) writes `d`, which is the output of an all_reduce; poisoning on `side` before the
  // GEMM's last tile would let its finite partial product overwrite the NaN (seen on 2 H200s, fault_probe_nccl).
  unsigned const nan = nan_bits(elem_bytes, nccl_dtype != kNcclFloat16);  // 2-byte: bf16 unless fp16
  int rc_fault = launch_fault_finish(fault, mirror, out, out_numel, 1, 1, elem_bytes, nan, cur);
  if (first_error != 0) return first_error;
  return rc_fault != 0 ? rc_fault : rc_join;
}

}  // extern "C"
