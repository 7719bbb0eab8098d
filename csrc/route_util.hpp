// Host helpers shared by the routes that run a fused op as several GEMM steps (peer_call.cu: two ranks;
// ring_call.cu: a ring of any size): CUDA error mapping, a row-range copy, and the GemmCall of one step; and the
// binding of a library the process loaded (fused_call.cu: NCCL; gather_gemms.cu: cuBLAS, cuBLASLt).
// Not part of the C ABI; included by those translation units only (the GEMM units do not depend on it).
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <string>

#include "flashoverlap_sm90.h"
#include "registry.hpp"

namespace flashoverlap {

int fail_code(int code, std::string msg);  // api.cu

// One wait kernel's arguments (api.cu: wait_counter_kernel). begin: first of the call on `fault` (deadline = now +
// timeout_ns, call_counter + 1, current_launch = launch_id). With a fault block every wait ends at the call's
// deadline and a timeout is recorded there (and in the peers' blocks); without one (fo_wait_counter), at now +
// timeout_ns, recorded into error_record.
struct WaitArgs {
  int const* counter = nullptr;  // null: no wait (notify and / or advance the epoch only)
  int* expected = nullptr;
  int increment = 0;
  fo_fault* fault = nullptr;
  int* error_record = nullptr;
  long long timeout_ns = 0;
  int tag = 0;
  int* notify = nullptr;
  bool notify_first = false;
  bool begin = false;
  int launch_id = 0;
  int rank = -1;  // begin: this rank in the call's group, into fault->rank (-1: leave it; the host wrote it)
};

// api.cu
int launch_wait(WaitArgs const& a, cudaStream_t stream);
int launch_fault_finish(fo_fault* f, int* mirror, void* out, int64_t rows, int64_t n, int64_t ld, int elem_bytes,
                        unsigned nan_bits, cudaStream_t stream);
int launch_fault_exchange(fo_fault* f, bool begin, long long timeout_ns, int launch_id, int rank, cudaStream_t stream);
int launch_fault_local(fo_fault* f, int tag, cudaStream_t stream);

// A wait kernel of one call of a route whose argument struct P (fo_peer_args, fo_ring_args) holds its fault block,
// timeout_ns and launch_id.
template <class P>
int route_wait(P const& p, int const* counter, int* expected, int increment, int tag, cudaStream_t stream, int* notify,
               bool notify_first = false, bool begin = false) {
  WaitArgs a{};
  a.counter = counter, a.expected = expected, a.increment = increment, a.fault = p.fault;
  a.timeout_ns = (long long)p.timeout_ns, a.tag = tag, a.notify = notify, a.notify_first = notify_first;
  a.begin = begin, a.launch_id = p.launch_id;
  return launch_wait(a, stream);
}

// The NaN bit pattern of a 2-byte float (elem_bytes 2: bf16 when bf16, else fp16) or of fp32.
inline unsigned nan_bits(int elem_bytes, bool bf16) {
  return elem_bytes == 4 ? 0x7FC00000u : (bf16 ? 0x7FC0u : 0x7E00u);
}

inline int cuda_check(cudaError_t e, char const* what) {
  return e == cudaSuccess ? 0 : fail_code(100 + int(e), std::string(what) + ": " + cudaGetErrorString(e));
}

// The library at `path` if this process loaded it already (dlopen with RTLD_NOLOAD: never a second copy of torch's
// NCCL, cuBLAS or cuBLASLt); null after recording "<who>: <path> is not loaded in this process" (code 8).
inline void* loaded_library(char const* who, char const* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) fail_code(8, std::string(who) + ": " + path + " is not loaded in this process");
  return h;
}

// Rows [r0, r1) of a [*, n] matrix at src (row stride src_ld) to dst (row stride dst_ld), on `stream`: one 1-D
// copy when both are contiguous (a copy-engine transfer, no SMs), else a 2-D one. Strides in elements.
inline int copy_rows(void* dst, int64_t dst_ld, void const* src, int64_t src_ld, int64_t r0, int64_t r1, int n,
                     int elem_bytes, cudaStream_t stream) {
  if (r1 <= r0) return 0;
  size_t const e = size_t(elem_bytes);
  if (dst_ld == n && src_ld == n) {
    return cuda_check(cudaMemcpyAsync(static_cast<char*>(dst) + r0 * dst_ld * e,
                                      static_cast<char const*>(src) + r0 * src_ld * e, size_t(r1 - r0) * n * e,
                                      cudaMemcpyDeviceToDevice, stream),
                      "route copy");
  }
  return cuda_check(cudaMemcpy2DAsync(static_cast<char*>(dst) + r0 * dst_ld * e, size_t(dst_ld) * e,
                                      static_cast<char const*>(src) + r0 * src_ld * e, size_t(src_ld) * e,
                                      size_t(n) * e, size_t(r1 - r0), cudaMemcpyDeviceToDevice, stream),
                    "route copy");
}

// What every GEMM step of one call shares: the operands and the launch settings (sizes in elements).
struct StepOperands {
  void const* a;
  int64_t lda;
  void const* b;
  int64_t ldb;
  void const* bias;
  int n, k, elem_bytes;
  int signal_mode, sm_count, raster, swizzle;
  void* workspace;
  size_t workspace_bytes;
};

// The GemmCall of one step: A's rows [row, row + m) times B -> d (row stride ldd), plus C (row stride n) when
// c_operand is given (an _addc configuration). No signals, no gate: callers add those.
inline GemmCall step_call(StepOperands const& s, int row, int m, void const* c_operand, void* d, int64_t ldd,
                          cudaStream_t stream) {
  GemmCall call{};
  call.a = static_cast<char const*>(s.a) + int64_t(row) * s.lda * s.elem_bytes;
  call.lda = s.lda;
  call.b = s.b;
  call.ldb = s.ldb;
  call.bias = s.bias;
  call.d = d;
  call.ldd = ldd;
  call.m = m, call.n = s.n, call.k = s.k;
  call.counters = nullptr;
  call.group_of_tile_row = nullptr;
  call.tile_row_order = nullptr;
  call.signal_mode = s.signal_mode;
  call.sm_count = s.sm_count;
  call.raster = s.raster;
  call.swizzle = s.swizzle;
  call.workspace = s.workspace;
  call.workspace_bytes = s.workspace_bytes;
  call.stream = stream;
  call.c = c_operand;
  call.ldc = s.n;
  return call;
}

inline int run_step(GemmConfig const& c, GemmCall const& call) {
  std::string err;
  int rc = c.run(call, err);
  return rc == 0 ? 0 : fail_code(rc, err);
}

}  // namespace flashoverlap
