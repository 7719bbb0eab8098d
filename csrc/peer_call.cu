// fo_peer_call: the peer route of a two-rank fused reduce_scatter / all_reduce, one host call per fused op.
//
// Reduce-scatter inside the GEMM: each rank first multiplies the rows its peer owns (GEMM 1, into symmetric memory:
// the peer's, stored over NVLink, or its own, as the caller's `partial` pointer says), then its own rows with an
// epilogue that adds the peer's GEMM 1 result as CUTLASS's C operand, loaded by TMA (locally, or straight from the
// peer's memory). No reduction kernel runs: the sum is formed in the epilogue of a GEMM that holds the SMs anyway.
// all_reduce then needs only the other half of the result: by push, GEMM 2 also stores its tiles into the peer's
// landing buffer and one local copy completes the output; by pull, the copy engine pulls it group by group.
//
// One set of buffers serves every call, eager or replayed from a CUDA graph: every call ends with a flag exchange
// that proves the peer has read what the next call overwrites (flashoverlap_sm90.h states the argument). GEMM 2's
// "wait for the peer's GEMM 1" there is a wait kernel before it (gate_in_kernel 0) or the gate before each tile's C
// load, which every store of that tile (D and the aux copy into the peer's landing buffer) follows.
//
// Cross-GPU ordering: fo_notify (system-scope fence + release add on the peer's flag, after the GEMM in stream
// order) pairs with the bounded wait kernel's system-scope acquire. See flashoverlap_sm90.h for the contract.
//
// The timeline tool's probe: fo_peer_args.probe_events, timing events recorded at the call's points on the streams
// where they happen (after GEMM 1, the notify / wait, GEMM 2, the exchange or join, the final copy, each group's
// copies); all null in every other call (flashoverlap_sm90.h lists the indices).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "flashoverlap_sm90.h"
#include "registry.hpp"
#include "route_util.hpp"

namespace flashoverlap {

namespace {

// Error-record tags of the peer route's waits (the NCCL route tags its waits with the group index).
constexpr int kTagPartial = 1000;   // the peer's GEMM 1
constexpr int kTagOwnGroup = 1100;  // + g: this rank's GEMM 2, group g
constexpr int kTagPeerGroup = 1200;  // + g: the peer's GEMM 2, group g
constexpr int kMaxGroups = FO_PEER_MAX_GROUPS;

// The layout routes/peer.py's ctypes mirror (PeerArgs) assumes; tests/test_routes_cpu.py reads these numbers.
static_assert(offsetof(fo_peer_args, launch_id) == 288, "fo_peer_args layout (routes/peer.py PeerArgs)");
static_assert(offsetof(fo_peer_args, probe_events) == 296, "fo_peer_args layout (routes/peer.py PeerArgs)");
static_assert(sizeof(fo_peer_args) == 488, "fo_peer_args layout (routes/peer.py PeerArgs)");

// The timeline probe's events (fo_peer_args.probe_events; null: none, the normal case). A failed record leaves the
// call's protocol as it is (every notify still runs): the call returns the first such error at its end.
struct Probe {
  void* const* events;
  int rc = 0;
  void operator()(int i, cudaStream_t stream) {
    if (events[i] != nullptr && rc == 0) {
      rc = cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(events[i]), stream), "probe event record");
    }
  }
  void group(int base, int g, cudaStream_t stream) {
    if (g < FO_PEER_PROBE_GROUPS) (*this)(base + g, stream);
  }
};

struct PeerEvents {
  cudaEvent_t fork = nullptr, join_side = nullptr, join_pull = nullptr;
};

// Per host thread and device, like fused_call.cu's events.
int events(PeerEvents*& out) {
  thread_local std::unordered_map<int, PeerEvents> table;
  int device = 0;
  int rc = cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (rc != 0) return rc;
  PeerEvents& ev = table[device];
  if (ev.fork == nullptr) {
    for (cudaEvent_t* e : {&ev.fork, &ev.join_side, &ev.join_pull}) {
      if ((rc = cuda_check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate")) != 0) return rc;
    }
  }
  out = &ev;
  return 0;
}

// The call's last kernel on cur: NaN into the output while the fault block holds a fault, and the host mirror.
int finish(fo_peer_args const& p, GemmConfig const& c, void* out, int64_t rows, int64_t ld, cudaStream_t cur) {
  return launch_fault_finish(p.fault, p.mirror, out, rows, p.n, ld, p.elem_bytes, nan_bits(p.elem_bytes, c.dtype == 0),
                             cur);
}

int gemm(GemmConfig const& c, fo_peer_args const& p, int row, void const* c_operand, void* d, int64_t ldd,
         int* counters, int const* group_of_tile_row, cudaStream_t stream, void* aux = nullptr, bool gate = false) {
  StepOperands const ops{p.a, p.lda, p.b, p.ldb, p.bias, p.n, p.k, p.elem_bytes, p.signal_mode, p.sm_count,
                         p.raster, p.swizzle, p.workspace, p.workspace_bytes};
  GemmCall call = step_call(ops, row, p.rows, c_operand, d, ldd, stream);
  call.counters = counters;
  call.group_of_tile_row = group_of_tile_row;
  call.aux = aux;
  call.ldaux = p.n;
  if (gate) {  // wait for flags[0] >= expected[0] (advanced by the notify kernel before this GEMM)
    call.gate_flag = p.flags;
    call.gate_target = p.expected;
    call.gate_timeout_ns = (long long)p.timeout_ns;
    call.gate_error_record = reinterpret_cast<int*>(p.fault);
    call.gate_tag = kTagPartial;
  }
  return run_step(c, call);
}

// A plain copy on SMs, 16 bytes per thread and step (grid-stride): for the push route's final copy, which runs
// when GEMM 2 has freed every SM and is faster there than a copy-engine transfer.
__global__ void copy16_kernel(uint4* __restrict__ dst, uint4 const* __restrict__ src, size_t count) {
  size_t const stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) dst[i] = src[i];
}

int copy_on_sms(void* dst, void const* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return 0;
  if (bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16) {
    return cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "peer route copy");
  }
  size_t const count = bytes / 16;
  size_t const blocks = (count + 511) / 512;
  copy16_kernel<<<unsigned(blocks < 1056 ? blocks : 1056), 512, 0, stream>>>(static_cast<uint4*>(dst),
                                                                            static_cast<uint4 const*>(src), count);
  return cuda_check(cudaGetLastError(), "peer route copy kernel");
}

int check_args(fo_peer_args const& p, GemmConfig const*& c1, GemmConfig const*& c2) {
  c1 = config_at(p.config_partial);
  c2 = config_at(p.config_add);
  if (c1 == nullptr || c2 == nullptr) return fail_code(1, "fo_peer_call: no such configuration");
  if (c1->add_c != 0 || (p.push ? c2->add_c < 2 : c2->add_c != 1)) {
    return fail_code(2, "fo_peer_call: config_partial must be a plain configuration, config_add an _addc one (with "
                        "an aux store exactly when push is set)");
  }
  if (p.push && (p.num_groups != 0 || p.peer_own == nullptr || p.out == nullptr)) {
    return fail_code(2, "fo_peer_call: push needs num_groups 0, peer_own and out");
  }
  if (p.rows <= 0 || p.n <= 0 || p.k <= 0) return fail_code(2, "fo_peer_call: sizes must be positive");
  if (p.timeout_ns <= 0) return fail_code(2, "fo_peer_call: timeout_ns must be positive");
  if (p.partial == nullptr || p.peer_partial == nullptr || p.own_dst == nullptr || p.flags == nullptr ||
      p.peer_flags == nullptr || p.expected == nullptr || p.fault == nullptr) {
    return fail_code(2, "fo_peer_call: partial, peer_partial, own_dst, flags, peer_flags, expected and fault are "
                        "required");
  }
  if (p.num_groups < 0 || p.num_groups > kMaxGroups) {
    return fail_code(2, "fo_peer_call: num_groups must be in [0, FO_PEER_MAX_GROUPS]");
  }
  if ((p.num_groups > 0 && (p.group_rows == nullptr || p.group_tiles == nullptr ||
                                                p.counters == nullptr || p.peer_own == nullptr || p.out == nullptr))) {
    return fail_code(2, "fo_peer_call: all_reduce needs group_rows, group_tiles, counters, peer_own and out");
  }
  for (int g = 0; g < p.num_groups; ++g) {
    if (p.group_rows[g] > p.group_rows[g + 1] || p.group_rows[0] != 0 || p.group_rows[p.num_groups] != p.rows) {
      return fail_code(2, "fo_peer_call: group_rows must rise from 0 to rows");
    }
  }
  return 0;
}

}  // namespace

// fo_preload (api.cu): load this file's kernel too (lazy loading may synchronize the context under a spinning wait).
int peer_call_preload() {
  cudaFuncAttributes attr{};
  return cuda_check(cudaFuncGetAttributes(&attr, copy16_kernel), "fo_preload (peer route)");
}

}  // namespace flashoverlap

using namespace flashoverlap;

extern "C" {

FO_API int fo_peer_call(const fo_peer_args* args) {
  if (args == nullptr) return fail_code(2, "fo_peer_call: args is null");
  fo_peer_args const& p = *args;
  GemmConfig const *c1 = nullptr, *c2 = nullptr;
  int rc = check_args(p, c1, c2);
  if (rc != 0) return rc;
  auto cur = static_cast<cudaStream_t>(p.cur_stream);
  auto side = static_cast<cudaStream_t>(p.side_stream);
  auto pull = static_cast<cudaStream_t>(p.pull_stream);
  int const G = p.num_groups;
  PeerEvents* ev = nullptr;
  if ((rc = events(ev)) != 0) return rc;
  Probe probe{p.probe_events};
  int* const counter_targets = p.expected + 1 + kMaxGroups;
  if (G > 0) {  // epoch resync of GEMM 2's counters (every earlier user was joined into `cur`), begin, then fork
    rc = cuda_check(cudaMemcpyAsync(counter_targets, p.counters, size_t(G) * sizeof(int), cudaMemcpyDeviceToDevice,
                                    cur), "epoch resync");
    // The call's deadline starts before the fork: the side and pull streams' waits may run before anything else
    // on `cur`, and a wait that read the block's previous deadline (0 on a fresh block, or a call's long ago)
    // would give up at once.
    if (rc == 0) rc = route_wait(p, nullptr, nullptr, 0, kTagPartial, cur, nullptr, false, true);
    if (rc == 0) rc = cuda_check(cudaEventRecord(ev->fork, cur), "fork record");
    if (rc == 0) rc = cuda_check(cudaStreamWaitEvent(side, ev->fork, 0), "fork wait");
    if (rc == 0) rc = cuda_check(cudaStreamWaitEvent(pull, ev->fork, 0), "fork wait");
    if (rc != 0) return rc;
  }
  // GEMM 1: the peer's rows, then (one kernel) tell the peer and wait until its GEMM 1 (our C) is complete.
  rc = gemm(*c1, p, p.peer_row, nullptr, p.partial, p.n, nullptr, nullptr, cur);
  if (rc == 0) probe(FO_PEER_PROBE_GEMM1, cur);
  bool const begin = G == 0;  // else begun before the fork
  if (rc == 0 && p.gate_in_kernel) {  // notify and advance the epoch; GEMM 2's epilogue waits before loading C
    rc = route_wait(p, nullptr, p.expected, 1, kTagPartial, cur, p.peer_flags, false, begin);
  } else if (rc == 0) {
    rc = route_wait(p, p.flags, p.expected, 1, kTagPartial, cur, p.peer_flags, true, begin);
  }
  if (rc == 0) probe(FO_PEER_PROBE_NOTIFY, cur);
  bool const gate = p.gate_in_kernel != 0;
  if (p.push) {  // all_reduce by push: GEMM 2 -> out's own rows + the peer's landing buffer; then ours -> out
    char* const out = static_cast<char*>(p.out);
    if (rc == 0) {
      rc = gemm(*c2, p, p.own_row, p.peer_partial, out + int64_t(p.own_row) * p.ld_out * p.elem_bytes, p.ld_out,
                nullptr, nullptr, cur, const_cast<void*>(p.peer_own), gate);
    }
    if (rc == 0) probe(FO_PEER_PROBE_GEMM2, cur);
    if (rc == 0) {
      rc = route_wait(p, p.flags + 1, p.expected + 1, 1, kTagPeerGroup, cur, p.peer_flags + 1, true);
    }
    if (rc == 0) probe(FO_PEER_PROBE_EXCHANGE, cur);
    if (rc == 0 && p.copy_on_sms && p.ld_out == p.n) {
      rc = copy_on_sms(out + int64_t(p.peer_row) * p.ld_out * p.elem_bytes, p.own_dst,
                       size_t(p.rows) * size_t(p.n) * size_t(p.elem_bytes), cur);
    } else if (rc == 0) {
      rc = copy_rows(out + int64_t(p.peer_row) * p.ld_out * p.elem_bytes, p.ld_out, p.own_dst, p.n, 0, p.rows, p.n,
                     p.elem_bytes, cur);
    }
    if (rc == 0) probe(FO_PEER_PROBE_COPY, cur);
    if (rc == 0) rc = finish(p, *c2, out, 2 * int64_t(p.rows), p.ld_out, cur);
    return rc != 0 ? rc : probe.rc;
  }
  // GEMM 2: own rows + the peer's partial of them.
  if (rc == 0) {
    rc = gemm(*c2, p, p.own_row, p.peer_partial, p.own_dst, p.ld_own, G > 0 ? p.counters : nullptr,
              G > 0 ? p.group_of_tile_row : nullptr, cur, nullptr, gate);
  }
  if (rc == 0) probe(FO_PEER_PROBE_GEMM2, cur);
  if (G == 0) {  // reduce_scatter: one flag each way after GEMM 2 (our C reads are done; see the header)
    if (rc == 0) rc = route_wait(p, p.flags + 1, p.expected + 1, 1, kTagPeerGroup, cur, p.peer_flags + 1, true);
    if (rc == 0) probe(FO_PEER_PROBE_EXCHANGE, cur);
    if (rc == 0) rc = finish(p, *c2, p.own_dst, p.rows, p.ld_own, cur);
    return rc != 0 ? rc : probe.rc;
  }
  for (int g = 0; g < G && rc == 0; ++g) {
    int const r0 = p.group_rows[g], r1 = p.group_rows[g + 1];
    rc = route_wait(p, p.counters + g, counter_targets + g, p.group_tiles[g], kTagOwnGroup + g, side,
                    p.peer_flags + 1 + g);
    if (rc == 0) {
      rc = copy_rows(static_cast<char*>(p.out) + int64_t(p.own_row) * p.ld_out * p.elem_bytes, p.ld_out, p.own_dst,
                     p.ld_own, r0, r1, p.n, p.elem_bytes, side);
    }
    if (rc == 0) probe.group(FO_PEER_PROBE_SIDE, g, side);
    if (rc == 0) {
      rc = route_wait(p, p.flags + 1 + g, p.expected + 1 + g, 1, kTagPeerGroup + g, pull, nullptr);
    }
    if (rc == 0) {
      rc = copy_rows(static_cast<char*>(p.out) + int64_t(p.peer_row) * p.ld_out * p.elem_bytes, p.ld_out, p.peer_own,
                     p.n, r0, r1, p.n, p.elem_bytes, pull);
    }
    if (rc == 0) probe.group(FO_PEER_PROBE_PULL, g, pull);
  }
  // Join even after a failure, so `cur` never runs ahead of work already queued on the side streams.
  int rc_join = cuda_check(cudaEventRecord(ev->join_side, side), "join record");
  if (rc_join == 0) rc_join = cuda_check(cudaEventRecord(ev->join_pull, pull), "join record");
  if (rc_join == 0) rc_join = cuda_check(cudaStreamWaitEvent(cur, ev->join_side, 0), "join wait");
  if (rc_join == 0) rc_join = cuda_check(cudaStreamWaitEvent(cur, ev->join_pull, 0), "join wait");
  if (rc == 0 && rc_join == 0) probe(FO_PEER_PROBE_EXCHANGE, cur);
  if (rc == 0 && rc_join == 0) rc = finish(p, *c2, p.out, 2 * int64_t(p.rows), p.ld_out, cur);
  return rc != 0 ? rc : (rc_join != 0 ? rc_join : probe.rc);
}

}  // extern "C"
