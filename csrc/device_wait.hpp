// Device-side waiting shared by the wait kernel (api.cu) and the peer route's gate in GEMM 2's epilogue
// (tile_signal.hpp): one bounded poll loop, one timeout record.
#pragma once

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

// One thread polls *flag until (int)(*flag - target) >= 0 (compared cyclically), with a nanosleep backoff (32 ns
// doubling to 256 ns), for at most timeout_ns. A timeout records the first one, {1, tag, seen, target}, into
// error_record (device-visible memory, e.g. pinned host memory) and returns. skip_if_recorded: when the first
// poll fails and a timeout is already recorded, return at once (later waiters of a failed call do not each time
// out once more; the record is read only off the common path). Returns the last value seen.
__device__ __forceinline__ int bounded_wait(int const* flag, int target, long long timeout_ns, int* error_record,
                                            int tag, bool skip_if_recorded) {
  int v = load_acquire_sys(flag);
  if (int(unsigned(v) - unsigned(target)) >= 0) return v;
  if (skip_if_recorded && error_record != nullptr && *reinterpret_cast<int const volatile*>(error_record) != 0) {
    return v;
  }
  unsigned long long const t0 = global_timer_ns();
  unsigned sleep_ns = 32;
  while (int(unsigned(v) - unsigned(target)) < 0) {
    if ((long long)(global_timer_ns() - t0) > timeout_ns) {
      if (error_record != nullptr && atomicCAS(error_record, 0, 1) == 0) {
        error_record[1] = tag;
        error_record[2] = v;
        error_record[3] = target;
        __threadfence_system();
      }
      break;
    }
    __nanosleep(sleep_ns);
    sleep_ns = sleep_ns < 256 ? sleep_ns * 2 : 256;
    v = load_acquire_sys(flag);
  }
  return v;
}

}  // namespace flashoverlap
