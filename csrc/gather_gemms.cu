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
//
// With a workspace (fo_gather_gemm_args.workspace) and cuBLASLt bound (fo_cublaslt_bind: the libcublasLt torch
// loaded), each GEMM is one cublasLtMatmul of the same product (A = w with op_w, B = x, D = out; compute type
// CUBLAS_COMPUTE_32F, scale type fp32) on torch's handle cast to cuBLASLt's (cuBLAS's handle is one), with its
// descriptors and the heuristic's first algorithm made once per (device, element type, op_w, N, rows, K, workspace
// bytes) and kept for the process: cublasGemmEx runs that heuristic on every call. A GEMM with an operand off a
// 256-byte boundary (the heuristic's assumption) takes cublasGemmEx. fo_gather_run puts the protocol's two calls
// around the GEMMs, so a call of the route is one host call.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "flashoverlap_sm90.h"
#include "gather_protocol.hpp"
#include "route_util.hpp"

namespace flashoverlap {
using gp::GemmRows;
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

// cuBLASLt's C ABI (cublasLt.h, CUDA 11.4 and later), declared here as cuBLAS's above.
using LtDesc = void*;  // cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t
struct LtAlgo {
  uint64_t data[8];  // cublasLtMatmulAlgo_t
};
struct LtHeuristic {  // cublasLtMatmulHeuristicResult_t
  LtAlgo algo;
  size_t workspace_size;
  int state;
  float waves;
  int reserved[4];
};
using LtDescCreateFn = CublasStatus (*)(LtDesc* desc, int compute_type, int scale_type);
using LtDescSetFn = CublasStatus (*)(LtDesc desc, int attr, void const* buf, size_t size);
using LtLayoutCreateFn = CublasStatus (*)(LtDesc* layout, int type, uint64_t rows, uint64_t cols, int64_t ld);
using LtPrefCreateFn = CublasStatus (*)(LtDesc* pref);
using LtHeuristicFn = CublasStatus (*)(void* handle, LtDesc op, LtDesc a, LtDesc b, LtDesc c, LtDesc d, LtDesc pref,
                                       int requested, LtHeuristic* results, int* returned);
using LtMatmulFn = CublasStatus (*)(void* handle, LtDesc op, void const* alpha, void const* a, LtDesc a_desc,
                                    void const* b, LtDesc b_desc, void const* beta, void const* c, LtDesc c_desc,
                                    void* d, LtDesc d_desc, LtAlgo const* algo, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream);
using LtDestroyFn = CublasStatus (*)(LtDesc);
constexpr int kCompute32F = 68;        // CUBLAS_COMPUTE_32F
constexpr int kDescTransA = 3;         // CUBLASLT_MATMUL_DESC_TRANSA
constexpr int kDescTransB = 4;         // CUBLASLT_MATMUL_DESC_TRANSB
constexpr int kPrefMaxWorkspace = 1;   // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES

struct CublasLt {
  LtDescCreateFn desc_create = nullptr;
  LtDescSetFn desc_set = nullptr;
  LtLayoutCreateFn layout_create = nullptr;
  LtPrefCreateFn pref_create = nullptr;
  LtDescSetFn pref_set = nullptr;
  LtHeuristicFn heuristic = nullptr;
  LtMatmulFn matmul = nullptr;
  LtDestroyFn desc_destroy = nullptr, layout_destroy = nullptr, pref_destroy = nullptr;
};

CublasLt& cublas_lt() {
  static CublasLt c;
  return c;
}

int rc_device(int* device) {
  cudaError_t const e = cudaGetDevice(device);
  return e == cudaSuccess ? 0 : fail_code(100 + int(e), std::string("fo_gather_gemms: cudaGetDevice: ") +
                                                           cudaGetErrorString(e));
}

// Whether p lies on a 256-byte boundary: what the heuristic assumes of every operand unless told otherwise
// (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES default 256), so a plan runs only on operands that are.
bool aligned256(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 255u) == 0; }

// One GEMM shape's cuBLASLt plan, made once and kept (never destroyed: a handful per model). usable false: the
// heuristic found no algorithm within the workspace, and the shape stays on cublasGemmEx.
struct LtPlan {
  bool usable = false;
  LtDesc op = nullptr, a = nullptr, b = nullptr, d = nullptr;
  LtAlgo algo{};
};
// (device, element type, op_w, N, rows, K, workspace bytes)
using LtKey = std::tuple<int, int, int, int64_t, int64_t, int64_t, int64_t>;

std::mutex lt_mutex;
std::map<LtKey, LtPlan>& lt_plans() {
  static std::map<LtKey, LtPlan> plans;
  return plans;
}

// The plan of one shape (made on first use: the descriptors, then the heuristic's first algorithm). A descriptor
// that cannot be made is an error (0 returned with *plan set, else a fail_code); no algorithm is a plan not usable.
int lt_plan(void* handle, LtKey const& key, LtPlan const** plan) {
  std::lock_guard<std::mutex> lock(lt_mutex);
  auto& plans = lt_plans();
  auto it = plans.find(key);
  if (it != plans.end()) {
    *plan = &it->second;
    return 0;
  }
  CublasLt const& lt = cublas_lt();
  auto const [device, type, op_w, n, rows, k, ws_bytes] = key;
  (void)device;
  LtPlan made;
  int const op_b = kOpN;
  uint64_t const wsb = uint64_t(ws_bytes);
  LtDesc pref = nullptr;
  int st = lt.desc_create(&made.op, kCompute32F, kR32F);
  if (st == 0) st = lt.desc_set(made.op, kDescTransA, &op_w, sizeof(op_w));
  if (st == 0) st = lt.desc_set(made.op, kDescTransB, &op_b, sizeof(op_b));
  // A = w as stored: [K, N] column-major (ld K) under op T, else [N, K] (ld N); B = x: [K, rows] (ld K); D: [N, rows]
  if (st == 0) st = op_w == kOpT ? lt.layout_create(&made.a, type, uint64_t(k), uint64_t(n), k)
                                 : lt.layout_create(&made.a, type, uint64_t(n), uint64_t(k), n);
  if (st == 0) st = lt.layout_create(&made.b, type, uint64_t(k), uint64_t(rows), k);
  if (st == 0) st = lt.layout_create(&made.d, type, uint64_t(n), uint64_t(rows), n);
  if (st == 0) st = lt.pref_create(&pref);
  if (st == 0) st = lt.pref_set(pref, kPrefMaxWorkspace, &wsb, sizeof(wsb));
  LtHeuristic found{};
  int returned = 0;
  if (st == 0) {
    CublasStatus const h = lt.heuristic(handle, made.op, made.a, made.b, made.d, made.d, pref, 1, &found, &returned);
    made.usable = h == 0 && returned > 0 && found.state == 0 && found.workspace_size <= wsb;
    made.algo = found.algo;
  }
  if (pref != nullptr) lt.pref_destroy(pref);
  if (st != 0) {
    if (made.op != nullptr) lt.desc_destroy(made.op);
    for (LtDesc l : {made.a, made.b, made.d}) {
      if (l != nullptr) lt.layout_destroy(l);
    }
    return fail_code(9, "fo_gather_gemms: a cuBLASLt descriptor failed with status " + std::to_string(st));
  }
  *plan = &(plans[key] = made);  // std::map: the element's address stays valid as others are added
  return 0;
}

}  // namespace

int gp::gemm_rows(GemmRows const& g, cudaStream_t cur) {
  float const alpha = 1.0f, beta = g.c != nullptr ? 1.0f : 0.0f;
  int const op_w = g.weight_transposed ? kOpT : kOpN;
  if (g.workspace != nullptr && aligned256(g.weight) && aligned256(g.x) && aligned256(g.out) &&
      (g.c == nullptr || aligned256(g.c))) {  // else cublasGemmEx
    LtPlan const* plan = nullptr;
    LtKey const key{g.device, g.elem_type, op_w, g.n, g.rows, g.k, g.workspace_bytes};
    if (int const rc = lt_plan(g.handle, key, &plan); rc != 0) return rc;
    if (plan->usable) {  // C (the addend) laid out as D
      CublasStatus const st = cublas_lt().matmul(g.handle, plan->op, &alpha, g.weight, plan->a, g.x, plan->b, &beta,
                                                 g.c != nullptr ? g.c : g.out, plan->d, g.out, plan->d, &plan->algo,
                                                 g.workspace, size_t(g.workspace_bytes), cur);
      return st == 0 ? 0 : fail_code(9, "cublasLtMatmul failed with status " + std::to_string(st));
    }
  }
  if (g.c != nullptr) {  // cublasGemmEx adds into its output: the addend first
    int const rc = cuda_check(cudaMemcpyAsync(g.out, g.c, size_t(g.rows) * size_t(g.n) * 2, cudaMemcpyDeviceToDevice,
                                               cur), "addend copy");
    if (rc != 0) return rc;
  }
  Cublas const& c = cublas();
  CublasStatus st = c.set_math_mode(g.handle, g.math_mode);
  if (st == 0) {
    st = c.gemm_ex(g.handle, op_w, kOpN, int(g.n), int(g.rows), int(g.k), &alpha, g.weight, g.elem_type,
                   int(g.weight_transposed ? g.k : g.n), g.x, g.elem_type, int(g.k), &beta, g.out, g.elem_type,
                   int(g.n), kR32F, kDefaultTensorOp);
  }
  CublasStatus const reset = c.set_math_mode(g.handle, kDefaultMath);
  if (st != 0 || reset != 0) {
    return fail_code(9, "cublasGemmEx failed with status " + std::to_string(st != 0 ? st : reset));
  }
  return 0;
}

bool gp::gemms_bound(bool lt) { return lt ? cublas_lt().matmul != nullptr : cublas().gemm_ex != nullptr; }

int gp::finish_after(fo_gather_args const* call, int rc, int32_t* finish_rc) {
  std::string const first = rc != 0 ? std::string(fo_last_error()) : std::string();
  *finish_rc = fo_gather_finish(call);  // always: the caller's stream joins the copy stream, the outputs poisoned
  if (rc != 0 && *finish_rc != 0) {
    fail_code(rc, first + "; then fo_gather_finish: " + fo_last_error());
  } else if (rc != 0) {
    fail_code(rc, first);
  }
  return rc;
}

}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_cublas_bind(const char* path) {
  void* h = loaded_library("fo_cublas_bind", path);
  if (h == nullptr) return 8;
  Cublas c;
  c.gemm_ex = reinterpret_cast<GemmExFn>(dlsym(h, "cublasGemmEx"));
  c.set_math_mode = reinterpret_cast<SetMathModeFn>(dlsym(h, "cublasSetMathMode"));
  if (c.gemm_ex == nullptr || c.set_math_mode == nullptr) {
    return fail_code(8, std::string("fo_cublas_bind: ") + path + " lacks cublasGemmEx / cublasSetMathMode");
  }
  cublas() = c;
  return 0;
}

FO_API int fo_cublaslt_bind(const char* path) {
  void* h = loaded_library("fo_cublaslt_bind", path);
  if (h == nullptr) return 8;
  CublasLt c;
  c.desc_create = reinterpret_cast<LtDescCreateFn>(dlsym(h, "cublasLtMatmulDescCreate"));
  c.desc_set = reinterpret_cast<LtDescSetFn>(dlsym(h, "cublasLtMatmulDescSetAttribute"));
  c.layout_create = reinterpret_cast<LtLayoutCreateFn>(dlsym(h, "cublasLtMatrixLayoutCreate"));
  c.pref_create = reinterpret_cast<LtPrefCreateFn>(dlsym(h, "cublasLtMatmulPreferenceCreate"));
  c.pref_set = reinterpret_cast<LtDescSetFn>(dlsym(h, "cublasLtMatmulPreferenceSetAttribute"));
  c.heuristic = reinterpret_cast<LtHeuristicFn>(dlsym(h, "cublasLtMatmulAlgoGetHeuristic"));
  c.matmul = reinterpret_cast<LtMatmulFn>(dlsym(h, "cublasLtMatmul"));
  c.desc_destroy = reinterpret_cast<LtDestroyFn>(dlsym(h, "cublasLtMatmulDescDestroy"));
  c.layout_destroy = reinterpret_cast<LtDestroyFn>(dlsym(h, "cublasLtMatrixLayoutDestroy"));
  c.pref_destroy = reinterpret_cast<LtDestroyFn>(dlsym(h, "cublasLtMatmulPreferenceDestroy"));
  if (!c.desc_create || !c.desc_set || !c.layout_create || !c.pref_create || !c.pref_set || !c.heuristic ||
      !c.matmul || !c.desc_destroy || !c.layout_destroy || !c.pref_destroy) {
    return fail_code(8, std::string("fo_cublaslt_bind: ") + path + " lacks a cublasLt matmul function");
  }
  cublas_lt() = c;
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
  bool const use_lt = p.workspace != nullptr;
  if (use_lt && (cublas_lt().matmul == nullptr || p.workspace_bytes < 0)) {
    return fail_code(8, "fo_gather_gemms: a workspace but cuBLASLt is not bound (fo_cublaslt_bind), or its size < 0");
  }
  int device = 0;
  if (use_lt) {
    int const e = rc_device(&device);
    if (e != 0) return e;
  }
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  int64_t const elem = 2;
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
    for (int w = 0; w < p.num_weights && rc == 0; ++w) {
      char* out = static_cast<char*>(p.outputs[w]) + int64_t(j) * p.rows * p.n[w] * elem;
      rc = gp::gemm_rows(GemmRows{p.handle, p.elem_type, p.math_mode, p.weight_transposed[w], p.weights[w], p.n[w],
                                  p.k, x, p.rows, nullptr, out, p.workspace, p.workspace_bytes, device}, cur);
    }
  }
  return rc;
}

FO_API int fo_gather_run(const fo_gather_args* call, const fo_gather_gemm_args* gemms, int32_t* finish_rc) {
  if (call == nullptr || finish_rc == nullptr) return fail_code(2, "fo_gather_run: call or finish_rc is null");
  int rc = fo_gather_call(call);
  if (rc == 0 && gemms != nullptr) rc = fo_gather_gemms(gemms);
  return gp::finish_after(call, rc, finish_rc);
}

}  // extern "C"
