// libflashoverlap_sm90_test.so: helper kernels for the GPU tests and benchmarks only (never shipped in
// libflashoverlap_sm90.so). Built by flashoverlap_inductor/build.py next to the library from this one unit (no
// GEMM, no CUTLASS); loaded through ctypes by tests/test_gpu_kernels.py and examples/bench_gemm.py. Raw device
// pointers, cudaStream_t as void*; every function returns 0 or a nonzero code, fo_test_last_error() then says why.
//
// C ABI (all extern "C"):
//   int fo_test_abi_version(void);      1
//   const char* fo_test_last_error(void);
//   int fo_test_preload(void);          load both kernels on the current device now (CUDA lazy loading would load
//                                       one at its first launch, which may synchronize the context: a launch
//                                       queued behind a spinning wait, or behind cuStreamWaitValue32, then
//                                       deadlocks). Call once per device before the first launch.
//   int fo_test_delayed_add(int* counter, int value, int64_t delay_ns, int64_t* stamp, void* stream);
//                                       one thread spins delay_ns, writes %globaltimer to *stamp, then
//                                       release-adds (gpu scope) `value` to *counter
//   int fo_test_stamp(int64_t* stamp, void* stream);   one thread writes %globaltimer to *stamp
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device_wait.hpp"

#define FO_TEST_API __attribute__((visibility("default")))

namespace flashoverlap_test {

using flashoverlap::global_timer_ns;

thread_local std::string last_error;

int fail_cuda(char const* what, cudaError_t e) {
  last_error = std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
  return 100 + int(e);
}

__global__ void delayed_add_kernel(int* counter, int value, long long delay_ns, long long* stamp) {
  unsigned long long const t0 = global_timer_ns();
  while ((long long)(global_timer_ns() - t0) < delay_ns) {
  }
  *stamp = (long long)global_timer_ns();
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

__global__ void stamp_kernel(long long* stamp) { *stamp = (long long)global_timer_ns(); }

}  // namespace flashoverlap_test

using namespace flashoverlap_test;

extern "C" {

FO_TEST_API int fo_test_abi_version(void) { return 1; }

FO_TEST_API const char* fo_test_last_error(void) { return last_error.c_str(); }

FO_TEST_API int fo_test_preload(void) {
  cudaFuncAttributes attr{};
  for (void const* k :
       {reinterpret_cast<void const*>(&delayed_add_kernel), reinterpret_cast<void const*>(&stamp_kernel)}) {
    cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return fail_cuda("fo_test_preload", e);
  }
  return 0;
}

FO_TEST_API int fo_test_delayed_add(int* counter, int value, int64_t delay_ns, int64_t* stamp, void* stream) {
  delayed_add_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(counter, value, (long long)delay_ns,
                                                                     reinterpret_cast<long long*>(stamp));
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("fo_test_delayed_add launch", e);
}

FO_TEST_API int fo_test_stamp(int64_t* stamp, void* stream) {
  stamp_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(reinterpret_cast<long long*>(stamp));
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("fo_test_stamp launch", e);
}

}  // extern "C"
