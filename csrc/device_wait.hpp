// Device-side waiting shared by the wait kernel (api.cu) and the peer gate in a GEMM's epilogue (tile_signal.hpp):
// one bounded poll loop, and the fault block that makes a timed-out wait visible to every rank of the group.
//
// Failure contract (flashoverlap_sm90.h, fo_fault): every wait of a call ends at the call's deadline (set once per
// call by its first wait kernel: one failed call ends within about one timeout, however many waits it has). A wait
// that gives up records the fault in its rank's block and in every peer's block it knows (system-scope stores over
// NVLink, before anything this rank writes afterwards), so a peer that reads data this rank wrote after the fault
// also sees the fault. The route's last kernel then poisons the call's output (NaN) while the block holds a fault,
// and mirrors the block into pinned host memory, where the host raises. Blocks are cleared only by the host, after
// it raised (fo_fault_clear).
#pragma once

#include "flashoverlap_sm90.h"

namespace flashoverlap {

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// System scope: the flag may be one another GPU adds to over NVLink (the peer route), or a counter of a GEMM on
// this GPU whose data a peer then reads.
__device__ __forceinline__ int load_acquire_sys(int const* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int load_volatile(int const* p) { return *reinterpret_cast<int const volatile*>(p); }

// Record a fault {code, tag, seen, target, origin} into block f (the first fault is kept), at system scope.
__device__ __forceinline__ void record_fault(fo_fault* f, int code, int tag, int seen, int target, int origin) {
  if (atomicCAS_system(&f->code, 0, code) != 0) return;
  f->tag = tag;
  f->seen = seen;
  f->target = target;
  f->origin = origin;
  f->fault_call = load_volatile(&f->call_counter);
  f->launch = load_volatile(&f->current_launch);
  __threadfence_system();
}

// The prologue of a call's last kernel (one thread): the block's fault code after a system-scope acquire fence; while
// there is one and `copy` (block 0), its first 8 ints go to the caller's pinned host mirror, code last.
__device__ __forceinline__ int mirror_fault(fo_fault* f, int* mirror, bool copy) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  int const code = load_volatile(&f->code);
  if (code != 0 && copy && mirror != nullptr) {
    int const* src = &f->code;
    for (int i = 1; i < 8; ++i) reinterpret_cast<int volatile*>(mirror)[i] = load_volatile(src + i);
    __threadfence_system();
    reinterpret_cast<int volatile*>(mirror)[0] = code;
    __threadfence_system();
  }
  return code;
}

// This rank's wait gave up: its own block (code 1), then every peer's (code 2).
__device__ __forceinline__ void record_timeout(fo_fault* f, int tag, int seen, int target) {
  int const origin = f->rank;
  record_fault(f, 1, tag, seen, target, origin);
  int const n = f->npeers < FO_FAULT_MAX_PEERS ? f->npeers : FO_FAULT_MAX_PEERS;
  for (int i = 0; i < n; ++i) {
    if (f->peers[i] != nullptr) record_fault(f->peers[i], 2, tag, seen, target, origin);
  }
  __threadfence_system();
}

// The absolute deadline of a wait: the call's (set by its first wait kernel) when a block is given, else now +
// timeout_ns (the single-kernel waits of fo_wait_counter).
__device__ __forceinline__ long long wait_deadline(fo_fault const* f, long long timeout_ns) {
  if (f != nullptr) return *reinterpret_cast<long long const volatile*>(&f->deadline_ns);
  return (long long)global_timer_ns() + timeout_ns;
}

// One thread polls *flag until (int)(*flag - target) >= 0 (compared cyclically), with a nanosleep backoff (32 ns
// doubling to 256 ns), until `deadline` (globaltimer ns). On timeout: the fault goes to block f (and its peers) when
// given, else {1, tag, seen, target} into error_record (first kept). Returns true when it timed out.
__device__ __forceinline__ bool bounded_wait(int const* flag, int target, long long deadline, fo_fault* f,
                                             int* error_record, int tag) {
  int v = load_acquire_sys(flag);
  unsigned sleep_ns = 32;
  while (int(unsigned(v) - unsigned(target)) < 0) {
    if ((long long)global_timer_ns() > deadline) {
      if (f != nullptr) {
        record_timeout(f, tag, v, target);
      } else if (error_record != nullptr && atomicCAS(error_record, 0, 1) == 0) {
        error_record[1] = tag;
        error_record[2] = v;
        error_record[3] = target;
        __threadfence_system();
      }
      return true;
    }
    __nanosleep(sleep_ns);
    sleep_ns = sleep_ns < 256 ? sleep_ns * 2 : 256;
    v = load_acquire_sys(flag);
  }
  return false;
}

}  // namespace flashoverlap
