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
#include "route_util.hpp"

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
int gather_call_preload();  // gather_call.cu
int moe_plan_preload();  // moe_plan.cu
int moe_combine_preload();  // moe_combine_blocks.cu

// Make everything this GPU's stream order put before this point visible to every GPU, then add 1 to *counter
// (possibly another GPU's memory, mapped here): a peer that acquires the new value sees all of it.
__device__ __forceinline__ void notify_sys(int* counter) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  asm volatile("red.release.sys.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// Begins a call on its fault block (route_util.hpp: WaitArgs::begin), then waits (unless counter is null), and adds
// 1 to *notify (unless null): after the wait, or before it with notify_first (one kernel for both halves of a
// two-rank barrier). A timed-out wait still notifies and advances its epoch (every rank notifies each flag once per
// call and every wait consumes one epoch, so epochs stay aligned across a fault): the peer then fails on its own
// deadline instead of hanging longer, and the fault block poisons what the call returns.
__global__ void wait_counter_kernel(WaitArgs a) {
  if (a.begin && a.fault != nullptr) {
    a.fault->deadline_ns = (long long)global_timer_ns() + a.timeout_ns;
    a.fault->call_counter += 1;
    a.fault->current_launch = a.launch_id;
    if (a.rank >= 0) a.fault->rank = a.rank;
    __threadfence();
  }
  if (a.notify != nullptr && (a.notify_first || a.counter == nullptr)) notify_sys(a.notify);
  if (a.counter == nullptr) {  // no wait: only advance the epoch (an in-kernel waiter reads it: csrc/peer_call.cu)
    if (a.expected != nullptr) *a.expected += a.increment;
    return;
  }
  int const target = int(unsigned((a.expected != nullptr) ? *a.expected : 0) + unsigned(a.increment));
  bounded_wait(a.counter, target, wait_deadline(a.fault, a.timeout_ns), a.fault, a.error_record, a.tag);
  if (a.expected != nullptr) *a.expected = target;  // the epoch advances even on timeout: the GEMM still adds later
  if (a.notify != nullptr && !a.notify_first) notify_sys(a.notify);
}

int launch_wait(WaitArgs const& a, cudaStream_t stream) {
  wait_counter_kernel<<<1, 1, 0, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("wait kernel launch", e);
}

// The last kernel of every routed call (fo_fault): takes another rank's fault from the NCCL route's exchange word,
// then, while the block holds a fault, mirrors it to the host and fills `rows` x `n` elements of `out` (row stride
// ld, elem_bytes 2 or 4) with the NaN bit pattern `nan_bits`. Costs one load when there is no fault.
__global__ void fault_finish_kernel(fo_fault* f, int* mirror, char* out, int64_t rows, int64_t n, int64_t ld,
                                    int elem_bytes, unsigned nan_bits) {
  __shared__ int code;
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    int const x = load_volatile(&f->exchange);
    if (x > 0 && load_volatile(&f->code) == 0) record_fault(f, 3, -1, 0, 0, x - 1);
    code = mirror_fault(f, mirror, blockIdx.x == 0);
  }
  __syncthreads();
  if (code == 0 || out == nullptr) return;
  int64_t const total = rows * n;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    char* p = out + ((i / n) * ld + i % n) * elem_bytes;
    if (elem_bytes == 2) {
      *reinterpret_cast<unsigned short*>(p) = (unsigned short)nan_bits;
    } else {
      *reinterpret_cast<unsigned*>(p) = nan_bits;
    }
  }
}

int launch_fault_finish(fo_fault* f, int* mirror, void* out, int64_t rows, int64_t n, int64_t ld, int elem_bytes,
                        unsigned nan_bits, cudaStream_t stream) {
  if (f == nullptr) return 0;
  fault_finish_kernel<<<8, 256, 0, stream>>>(f, mirror, static_cast<char*>(out), rows, n, ld, elem_bytes, nan_bits);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("fault kernel launch", e);
}

// NCCL route, before its last NCCL group: this call's own fault (codes 1 and 4 recorded in this call) as
// origin + 1 for the MAX exchange; begins the call when no wait did (a rank without rows).
__global__ void fault_exchange_kernel(fo_fault* f, int begin, long long timeout_ns, int launch_id, int rank) {
  if (begin) {
    f->deadline_ns = (long long)global_timer_ns() + timeout_ns;
    f->call_counter += 1;
    f->current_launch = launch_id;
    f->rank = rank;
  }
  int const code = load_volatile(&f->code);
  bool const mine = (code == 1 || code == 4) && load_volatile(&f->fault_call) == load_volatile(&f->call_counter);
  f->exchange = mine ? f->rank + 1 : 0;
  __threadfence();
}

int launch_fault_exchange(fo_fault* f, bool begin, long long timeout_ns, int launch_id, int rank,
                          cudaStream_t stream) {
  fault_exchange_kernel<<<1, 1, 0, stream>>>(f, begin ? 1 : 0, timeout_ns, launch_id, rank);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("fault exchange kernel launch", e);
}

// A part of the call could not be enqueued on this rank (code 4): the rest of it still runs, poisoned.
__global__ void fault_local_kernel(fo_fault* f, int tag) { record_fault(f, 4, tag, 0, 0, f->rank); }

int launch_fault_local(fo_fault* f, int tag, cudaStream_t stream) {
  if (f == nullptr) return 0;
  fault_local_kernel<<<1, 1, 0, stream>>>(f, tag);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

// The host watchdog's record (runtime/nccl_watch.py): `code` with this rank as origin, in the call the block is in.
__global__ void fault_mark_kernel(fo_fault* f, int code, int tag) { record_fault(f, code, tag, 0, 0, f->rank); }

__global__ void fault_clear_kernel(fo_fault* f, int* mirror) {
  f->code = f->tag = f->seen = f->target = f->origin = f->fault_call = f->launch = 0;
  f->exchange = 0;
  __threadfence_system();
  if (mirror != nullptr) {
    for (int i = 0; i < 8; ++i) reinterpret_cast<int volatile*>(mirror)[i] = 0;
    __threadfence_system();
  }
}

}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_abi_version(void) { return 24; }

FO_API int fo_preload(void) {
  cudaFuncAttributes attr{};
  for (void const* k : {reinterpret_cast<void const*>(wait_counter_kernel),
                         reinterpret_cast<void const*>(fault_finish_kernel),
                         reinterpret_cast<void const*>(fault_exchange_kernel),
                         reinterpret_cast<void const*>(fault_local_kernel),
                         reinterpret_cast<void const*>(fault_clear_kernel),
                         reinterpret_cast<void const*>(fault_mark_kernel)}) {  // the watchdog's, beside a stuck kernel
    cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return fail_cuda("fo_preload", e);
  }
  if (int rc = peer_call_preload(); rc != 0) return rc;
  if (int rc = ring_call_preload(); rc != 0) return rc;
  if (int rc = gather_call_preload(); rc != 0) return rc;
  if (int rc = moe_plan_preload(); rc != 0) return rc;
  if (int rc = moe_combine_preload(); rc != 0) return rc;
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
  if (timeout_ns <= 0) return fail(2, "fo_wait_counter: timeout_ns must be positive");
  WaitArgs a{};
  a.counter = counter, a.expected = expected, a.increment = increment, a.timeout_ns = (long long)timeout_ns;
  a.error_record = error_record, a.tag = tag;
  return launch_wait(a, static_cast<cudaStream_t>(stream));
}

FO_API int fo_notify(int* counter, void* stream) {
  if (counter == nullptr) return fail(2, "fo_notify: counter is null");
  WaitArgs a{};
  a.notify = counter;
  return launch_wait(a, static_cast<cudaStream_t>(stream));
}

FO_API int fo_fault_clear(fo_fault* fault, int* mirror, void* stream) {
  if (fault == nullptr) return fail(2, "fo_fault_clear: fault is null");
  fault_clear_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(fault, mirror);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("fo_fault_clear", e);
}

FO_API int fo_fault_mark(fo_fault* fault, int code, int tag, void* stream) {
  if (fault == nullptr || code <= 0) return fail_code(2, "fo_fault_mark: needs a fault block and a code > 0");
  fault_mark_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(fault, code, tag);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : fail_cuda("fault mark kernel launch", e);
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
