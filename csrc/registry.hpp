// Internal registry of the compiled GEMM configurations (one translation unit per configuration registers
// itself at load time). Not part of the C ABI: see flashoverlap_sm90.h for that.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace flashoverlap {

enum DType : int { kBF16 = 0, kFP16 = 1 };
enum BLayout : int { kBNK = 0, kBKN = 1 };  // B given as [N,K] (K contiguous, a Linear weight) or [K,N]
enum Schedule : int { kCooperative = 0, kPingpong = 1 };

// One GEMM call: D[M,N] = A[M,K] @ B (+ bias[N]); row strides in elements; A and D row-major.
// Every field but `stream` is an input of the kernel's parameters, and so part of the key of the GEMM units' launch
// cache (gemm_sm90.cu: LaunchKey; a static_assert there on sizeof(GemmCall) catches a field added here only).
struct GemmCall {
  void const* a;
  int64_t lda;
  void const* b;
  int64_t ldb;  // [N,K] layout: stride between rows of N; [K,N] layout: stride between rows of K
  void const* bias;
  void* d;
  int64_t ldd;
  int m, n, k;
  int* counters;
  int const* group_of_tile_row;
  int const* tile_row_order;  // nullptr: natural order; else a permutation of [0, ceil(m / tile_m)) (tile_order.hpp)
  int signal_mode;
  int sm_count;  // 0: all SMs
  int raster;    // 0 heuristic, 1 along M, 2 along N
  int swizzle;   // 1, 2, 4, 8
  void* workspace;
  size_t workspace_bytes;
  cudaStream_t stream;
  void const* c = nullptr;  // _addc configurations only: D = round(A @ B (+ bias)) + C, C [M,N] row-major, ld ldc
  int64_t ldc = 0;
  void* aux = nullptr;  // add_c 2 / 3 only: D stored a second time here ([M,N] row-major, ld ldaux)
  int64_t ldaux = 0;
  int const* gate_flag = nullptr;  // peer gate before each tile's C load (tile_signal.hpp: peer_gate); null: none
  int const* gate_target = nullptr;
  long long gate_timeout_ns = 0;
  int* gate_error_record = nullptr;  // the route's fo_fault block (device_wait.hpp): deadline and fault record
  int gate_tag = 0;
};

struct GemmConfig {
  char const* name;  // "<schedule>_<tm>x<tn>x<tk>_c<cm>x<cn>[...]": the configuration, without dtype/layout
  int tile_m, tile_n, tile_k;
  int cluster_m, cluster_n;
  int schedule;
  int stages;  // 0 = auto
  int epi_m, epi_n;  // 0 = auto
  int dtype;
  int b_layout;
  int add_c;  // 1: the epilogue adds a C operand (GemmCall::c), which it then needs; 2 / 3: and stores D a second
              // time to GemmCall::aux (2: through shared memory and TMA; 3: from registers)
  size_t (*workspace_size)(GemmCall const&);
  // Launches on call.stream. Returns 0 or writes a message to err and returns a nonzero code. Thread-safe; the
  // kernel's parameters come from the unit's launch cache when an earlier launch had the same GemmCall (but stream).
  int (*run)(GemmCall const&, std::string& err);
  // Loads the kernel now (CUDA lazy loading would otherwise load it at its first launch, which needs a context
  // synchronization: a spinning waiter that depends on a not-yet-loaded kernel then deadlocks).
  int (*preload)(std::string& err);
};

void register_config(GemmConfig const& cfg);
// The GEMM units' launch caches (api.cu): on unless fo_gemm_cache_enable(0) turned them off; every launch counts
// as a hit or a miss (fo_gemm_cache_stats).
bool gemm_cache_enabled();
void count_gemm_launch(bool cached);
int num_configs();
GemmConfig const* config_at(int index);

}  // namespace flashoverlap
