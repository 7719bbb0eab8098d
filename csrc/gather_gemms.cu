// fo_cublas_bind / fo_gather_gemms: the all_gather peer route's GEMMs in one host call, through the cuBLAS library
// the process already loaded (torch's), on the caller's handle (torch's handle of the current thread, device and
// stream, with torch's workspace), issued as torch's mm issues them, so each result rounds bit for bit as
// torch.mm's (the GPU test checks it). Per shard j in arrival order (the local one, then rank - 1, rank - 2, ...):
// cur waits for j's pull event (none for the local shard, which reads `a`), then one GEMM per weight into shard j's
// rows of that weight's output. The route takes this path for contiguous shards without bias (fo_gather_gemm_args).
//
// The call (row-major x [rows, K] @ w [K, N] into out rows [rows, N], leading dimension N) as torch's addmm with a
// row-major result makes it: the column-major product out^T = w^T x^T, i.e. cublasGemmEx(op_w, N, m = N, n = rows,
// k = K, w, ld_w, x, K, out, N), compute type CUDA_R_32F with fp32 alpha/beta, CUBLAS_GEMM_DEFAULT_TENSOR_OP, the
// math mode set before and reset after; op_w = T for a Linear weight W.t() (W [N, K] contiguous, ld K), N for a
// row-major [K, N] weight (ld N).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <string>

#include "flashoverlap_sm90.h"
#include "route_util.hpp"

namespace flashoverlap {
namespace {

// cuBLAS's C ABI, declared here (the library is torch's, found at run time; no cuBLAS header or link is needed).
using CublasStatus = int;
using GemmExFn = CublasStatus (*)(void* handle, int transa, int transb, int m, int n, int k, void const* alpha,
                                  void const* a, int a_type, int lda, void const* b, int b_type, int ldb,
                                  void const* beta, void* c, int c_type, int ldc, int compute_type, int algo);
using SetMathModeFn = CublasStatus (*)(void* handle, int mode);
constexpr int kOpN = 0, kOpT = 1;           // cublasOperation_t
constexpr int kR16F = 2, kR16BF = 14;       // cudaDataType_t
constexpr int kR32F = 0;                    // CUDA_R_32F, passed as the compute type (as torch passes it)
constexpr int kDefaultTensorOp = 99;        // CUBLAS_GEMM_DEFAULT_TENSOR_OP
constexpr int kDefaultMath = 0;             // CUBLAS_DEFAULT_MATH

struct Cublas {
  GemmExFn gemm_ex = nullptr;
  SetMathModeFn set_math_mode = nullptr;
};

Cublas& cublas() {
  static Cublas c;
  return c;
}

}  // namespace
}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_cublas_bind(const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);  // only the cuBLAS already loaded (torch's): never a second one
  if (h == nullptr) return fail_code(8, std::string("fo_cublas_bind: ") + path + " is not loaded in this process");
  Cublas c;
  c.gemm_ex = reinterpret_cast<GemmExFn>(dlsym(h, "cublasGemmEx"));
  c.set_math_mode = reinterpret_cast<SetMathModeFn>(dlsym(h, "cublasSetMathMode"));
  if (c.gemm_ex == nullptr || c.set_math_mode == nullptr) {
    return fail_code(8, std::string("fo_cublas_bind: ") + path + " lacks cublasGemmEx / cublasSetMathMode");
  }
  cublas() = c;
  return 0;
}

FO_API int fo_gather_gemms(const fo_gather_gemm_args* args) {
  if (args == nullptr) return fail_code(2, "fo_gather_gemms: args is null");
  fo_gather_gemm_args const& p = *args;
  Cublas const& c = cublas();
  if (c.gemm_ex == nullptr) return fail_code(8, "fo_gather_gemms: cuBLAS is not bound (fo_cublas_bind)");
  if (p.world < 2 || p.world > FO_GATHER_MAX_WORLD || p.rank < 0 || p.rank >= p.world || p.handle == nullptr ||
      p.num_weights < 1 || p.num_weights > FO_GATHER_MAX_OUTPUTS || p.rows < 2 || p.k < 2 || p.a == nullptr ||
      p.staging == nullptr || (p.elem_type != kR16BF && p.elem_type != kR16F)) {
    return fail_code(2, "fo_gather_gemms: bad arguments (world, rank, handle, weights, rows >= 2, K >= 2, a, "
                        "staging, a bf16 or fp16 element type)");
  }
  for (int w = 0; w < p.num_weights; ++w) {
    if (p.weights[w] == nullptr || p.outputs[w] == nullptr || p.n[w] < 2) {
      return fail_code(2, "fo_gather_gemms: every weight needs its pointer, its output and N >= 2");
    }
  }
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  int64_t const elem = 2;
  float const alpha = 1.0f, beta = 0.0f;
  int rc = 0;
  for (int s = 0; s < p.world && rc == 0; ++s) {
    int const j = ((p.rank - s) % p.world + p.world) % p.world;
    char const* x = static_cast<char const*>(p.a);
    if (s > 0) {
      x = static_cast<char const*>(p.staging) + int64_t(j) * p.rows * p.k * elem;
      if ((rc = cuda_check(cudaStreamWaitEvent(cur, static_cast<cudaEvent_t>(p.shard_events[j]), 0),
                           "fo_gather_gemms: shard wait")) != 0) {
        break;
      }
    }
    for (int w = 0; w < p.num_weights; ++w) {
      int64_t const n = p.n[w];
      char* out = static_cast<char*>(p.outputs[w]) + int64_t(j) * p.rows * n * elem;
      CublasStatus st = c.set_math_mode(p.handle, p.math_mode);
      if (st == 0) {
        st = c.gemm_ex(p.handle, p.weight_transposed[w] ? kOpT : kOpN, kOpN, int(n), int(p.rows), int(p.k), &alpha,
                       p.weights[w], p.elem_type, int(p.weight_transposed[w] ? p.k : n), x, p.elem_type, int(p.k),
                       &beta, out, p.elem_type, int(n), kR32F, kDefaultTensorOp);
      }
      CublasStatus const reset = c.set_math_mode(p.handle, kDefaultMath);
      if (st != 0 || reset != 0) {
        rc = fail_code(9, "fo_gather_gemms: cublasGemmEx failed with status " + std::to_string(st != 0 ? st : reset));
        break;
      }
    }
  }
  return rc;
}

}  // extern "C"
