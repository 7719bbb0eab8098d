// C ABI of libflashoverlap_sm90.so: configuration registry, GEMM dispatch, bounded wait kernel, stream wait, the
// GEMM launch cache's switch and counters (fo_fused_call, the whole fused op in one call, is in fused_call.cu; the
// test helpers are in test_api.cu, a library of their own).
#include <cuda.h>  // CUstream / CUdeviceptr types and CU_STREAM_WAIT_VALUE_GEQ only; the driver is reached at run time
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_wait.hpp"
#include "flashoverlap_sm90.h"
#include "registry.hpp"

namespace flashoverlap {

namespace {
std::vector<GemmConfig>& registry() {
  static std::vector<GemmConfig> configs;
  return configs;
}
thread_local std::string last_error;

int fail(int code, std::string msg) {
  last_error = std::move(msg);
  return code;
}
int fail_cuda(char const* what, cudaError_t e) {
  return fail(100 + int(e), std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
}  // namespace

void register_config(GemmConfig const& cfg) { registry().push_back(cfg); }
int num_configs() { return int(registry().size()); }
GemmConfig const* config_at(int i) { return (i >= 0 && i < num_configs()) ? &registry()[i] : nullptr; }

int fail_code(int code, std::string msg) { return fail(code, std::move(msg)); }

// The GEMM units' launch caches (gemm_sm90.cu): one switch and one pair of counters for all configurations.
namespace {
std::atomic<int64_t> gemm_cache_hits{0}, gemm_cache_misses{0};
std::atomic<bool> gemm_cache_on{true};
}  // namespace

bool gemm_cache_enabled() { return gemm_cache_on.load(std::memory_order_relaxed); }

void count_gemm_launch(bool cached) {
  (cached ? gemm_cache_hits : gemm_cache_misses).fetch_add(1, std::memory_order_relaxed);
}

int peer_call_preload();  // peer_call.cu
int ring_call_preload();  // ring_call.cu

__global__ void wait_counter_kernel(int const* counter, int* expected, int increment, long long timeout_ns,
                                    int* error_record, int tag, int* notify, int notify_first);

int launch_wait(int const* counter, int* expected, int increment, long long timeout_ns, int* error_record, int tag,
                cudaStream_t stream, int* notify, bool notify_first) {
  wait_counter_kernel<<<1, 1, 0, stream>>>(counter, expected, increment, timeout_ns, error_record, tag, notify,
                                           notify_first ? 1 : 0);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("wait kernel launch", e);
}

// Make everything this GPU's stream order put before this point visible to every GPU, then add 1 to *counter
// (possibly another GPU's memory, mapped here): a peer that acquires the new value sees all of it.
__device__ __forceinline__ void notify_sys(int* counter) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  asm volatile("red.release.sys.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// Waits (unless counter is null), and adds 1 to *notify (unless null): after the wait, or before it with
// notify_first (one kernel for both halves of a two-rank barrier). A timed-out wait still notifies: the peer then
// fails on its own timeout instead of hanging longer than its own bound.
__global__ void wait_counter_kernel(int const* counter, int* expected, int increment, long long timeout_ns,
                                    int* error_record, int tag, int* notify, int notify_first) {
  if (notify != nullptr && (notify_first || counter == nullptr)) notify_sys(notify);
  if (counter == nullptr) {  // no wait: only advance the epoch (an in-kernel waiter reads it: csrc/peer_call.cu)
    if (expected != nullptr) *expected += increment;
    return;
  }
  int const target = int(unsigned((expected != nullptr) ? *expected : 0) + unsigned(increment));
  bounded_wait(counter, target, timeout_ns, error_record, tag, false);
  if (expected != nullptr) *expected = target;  // the epoch advances even on timeout: the GEMM still adds later
  if (notify != nullptr && !notify_first) notify_sys(notify);
}

}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_abi_version(void) { return 7; }

FO_API int fo_preload(void) {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaFuncGetAttributes(&attr, wait_counter_kernel);
  if (e != cudaSuccess) return fail_cuda("fo_preload", e);
  if (int rc = peer_call_preload(); rc != 0) return rc;
  if (int rc = ring_call_preload(); rc != 0) return rc;
  for (int i = 0; i < num_configs(); ++i) {
    std::string err;
    int rc = registry()[i].preload(err);
    if (rc != 0) return fail(rc, err);
  }
  return 0;
}

FO_API const char* fo_last_error(void) { return last_error.c_str(); }

FO_API int fo_gemm_cache_enable(int enabled) { return gemm_cache_on.exchange(enabled != 0) ? 1 : 0; }

FO_API int fo_gemm_cache_stats(int64_t* hits, int64_t* misses) {
  if (hits != nullptr) *hits = gemm_cache_hits.load(std::memory_order_relaxed);
  if (misses != nullptr) *misses = gemm_cache_misses.load(std::memory_order_relaxed);
  return 0;
}

FO_API int fo_num_configs(void) { return num_configs(); }

FO_API int fo_config_info(int index, char* name, int name_len, int* ints) {
  GemmConfig const* c = config_at(index);
  if (c == nullptr) return fail(1, "fo_config_info: no configuration " + std::to_string(index));
  if (name != nullptr && name_len > 0) std::snprintf(name, size_t(name_len), "%s", c->name);
  if (ints != nullptr) {
    int const v[12] = {c->tile_m, c->tile_n, c->tile_k, c->cluster_m, c->cluster_n, c->schedule,
                       c->stages, c->epi_m,  c->epi_n,  c->dtype,     c->b_layout,  c->add_c};
    for (int i = 0; i < 12; ++i) ints[i] = v[i];
  }
  return 0;
}

FO_API int fo_gemm_workspace_size(int config, int m, int n, int k, int sm_count, int raster, int swizzle,
                                  size_t* bytes) {
  GemmConfig const* c = config_at(config);
  if (c == nullptr) return fail(1, "fo_gemm_workspace_size: no configuration " + std::to_string(config));
  GemmCall call{};
  call.m = m, call.n = n, call.k = k, call.lda = k, call.ldb = c->b_layout == kBNK ? k : n, call.ldd = n;
  call.sm_count = sm_count, call.raster = raster, call.swizzle = swizzle;
  *bytes = c->workspace_size(call);
  return 0;
}

FO_API int fo_gemm(int config, const void* a, int64_t lda, const void* b, int64_t ldb, const void* bias,
                   const void* c_operand, int64_t ldc, void* d, int64_t ldd, int m, int n, int k, int* counters,
                   const int* group_of_tile_row, const int* tile_row_order, int signal_mode, int sm_count, int raster,
                   int swizzle, void* workspace, size_t workspace_bytes, void* stream) {
  GemmConfig const* c = config_at(config);
  if (c == nullptr) return fail(1, "fo_gemm: no configuration " + std::to_string(config));
  if (m <= 0 || n <= 0 || k <= 0) return fail(2, "fo_gemm: sizes must be positive");
  if (signal_mode != 0 && signal_mode != 1) return fail(2, "fo_gemm: signal_mode must be 0 or 1");
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8) return fail(2, "fo_gemm: swizzle must be 1/2/4/8");
  if (raster < 0 || raster > 2) return fail(2, "fo_gemm: raster must be 0, 1 or 2");
  GemmCall call{a,        lda,       b,        ldb,         bias,     d,      ldd,     m,
                n,        k,         counters, group_of_tile_row, tile_row_order, signal_mode, sm_count, raster,
                swizzle,  workspace, workspace_bytes, static_cast<cudaStream_t>(stream), c_operand, ldc};
  std::string err;
  int rc = c->run(call, err);
  if (rc != 0) return fail(rc, err);
  return 0;
}

FO_API int fo_wait_counter(const int* counter, int* expected, int increment, int64_t timeout_ns, int* error_record,
                           int tag, void* stream) {
  if (counter == nullptr) return fail(2, "fo_wait_counter: counter is null");
  return launch_wait(counter, expected, increment, (long long)timeout_ns, error_record, tag,
                     static_cast<cudaStream_t>(stream), nullptr, false);
}

FO_API int fo_notify(int* counter, void* stream) {
  if (counter == nullptr) return fail(2, "fo_notify: counter is null");
  return launch_wait(nullptr, nullptr, 0, 0, nullptr, 0, static_cast<cudaStream_t>(stream), counter, false);
}

FO_API int fo_stream_wait_value(void* stream, int* counter, int target) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  static Fn fn = nullptr;
  if (fn == nullptr) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || p == nullptr) {
      return fail(7, "fo_stream_wait_value: cuStreamWaitValue32 is not available from the driver");
    }
    fn = reinterpret_cast<Fn>(p);
  }
  CUresult r = fn(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(counter), cuuint32_t(target),
                  CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) return fail(200 + int(r), "cuStreamWaitValue32 failed with CUresult " + std::to_string(int(r)));
  return 0;
}

}  // extern "C"
