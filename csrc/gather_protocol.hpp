// The gather protocol's shared parts (csrc/gather_call.cu defines them): the flag page's layout, the step kernel's
// arguments and launch, the per-thread events; used by gather_call.cu (fo_gather_call / fo_gather_finish) and
// scatter_run.cu (fo_scatter_run). Not part of the C ABI. flashoverlap_sm90.h states the protocol.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flashoverlap_sm90.h"

namespace flashoverlap::gp {

constexpr int kMaxWorld = FO_GATHER_MAX_WORLD;
constexpr int kMaxOutputs = FO_GATHER_MAX_OUTPUTS;
constexpr int kReady = 0;           // ready[j] at kReady + j: rank j's shard of the current call is in its buffer
                                    // (push: in slot j of this rank's buffer)
constexpr int kDone = kMaxWorld;    // done[j] at kDone + j: rank j finished reading this rank's shard (push: the
                                    // slot this rank writes in j's buffer), added once per call by every schedule
constexpr int kSlotSets = FO_GATHER_SLOT_SETS;
constexpr int kSetDone = 2 * kMaxWorld;  // push: done_b[j] at kSetDone + b * kMaxWorld + j: rank j finished reading
                                         // the slot this rank writes in set b of j's buffer (once per set-b call)
constexpr int kSetReady = kSetDone + kSlotSets * kMaxWorld;  // push: ready_b[j]: rank j's pushes into set b here
constexpr int kSetUses = kSetReady + kSlotSets * kMaxWorld;  // push: uses_b at kSetUses + b, this rank's own: its
                                                             // pushes begun into set b
constexpr int kSetReads = kSetUses + kSlotSets;  // push: reads_b at kSetReads + b, this rank's own: its set-b calls
constexpr int kSetEpoch = kSetReads + kSlotSets;  // FO_GATHER_COPY_NOTIFY: at kSetEpoch + b, this rank's epoch as
                                                  // its last set-b call began (what ready[rank] in a peer's page
                                                  // reads once that call's shard is there; copied, never added)
constexpr int kBlocks = FO_GATHER_BLOCKS;
constexpr int kCopyNotifyMinWorld = 3;  // FO_GATHER_COPY_NOTIFY acts from this many ranks on (2: one push anyway)
// fo_scatter_run's pieces (flashoverlap_sm90.h): piece_ready[j] at kPieceReady + j (written only by rank j, absolute:
// the pieces it pushed here so far, by a copy-engine write), this rank's own counters sent (its pieces pushed) and
// recv (its pieces waited for), and src[i]: the value piece i of its current call writes into its peer's page.
constexpr int kPieceReady = kSetEpoch + kSlotSets;
constexpr int kPieceSent = kPieceReady + kMaxWorld;
constexpr int kPieceRecv = kPieceSent + 1;
constexpr int kPieceSrc = kPieceRecv + 1;
constexpr int kMaxPieces = FO_SCATTER_MAX_PIECES;
static_assert(kPieceSrc + kMaxPieces <= FO_GATHER_FLAG_INTS, "the gather flag page holds every flag and counter");
static_assert(sizeof(fo_gather_args) == 776 && offsetof(fo_gather_args, slot_set) == 424, "fo_gather_args layout");
static_assert(offsetof(fo_gather_args, set_bytes) == 432 && offsetof(fo_gather_args, slot_bytes) == 760,
              "fo_gather_args layout");
constexpr int kTagReady = 3000;     // + j: rank j's shard of this call
constexpr int kTagDone = 3100;      // + j: rank j finished reading this rank's previous shard
constexpr int kTagEnqueue = 3200;   // + step: a part of the call this rank could not enqueue

// One kernel of the protocol (one thread): optionally begin the call, optionally record an enqueue failure, add 1
// to each flag of `notify`, then wait for each flag of `wait` to reach epoch + wait_offset (every wait bounded by
// the call's deadline; a timeout is recorded in this rank's block and every peer's, and the next wait goes on).
struct GatherStep {
  fo_fault* fault;
  int* epoch;
  long long timeout_ns;
  int launch_id;
  int begin;      // the call's first kernel: deadline, call_counter, current_launch, epoch + 1
  int fail_tag;   // nonzero: this rank failed to enqueue part of the call (code 4, here and in every peer's block)
  int num_notify;
  int* notify[2 * kMaxWorld];
  int num_wait;
  int wait_offset;
  int* counter;   // non-null: the waits' target is *counter + wait_offset (not epoch + wait_offset)
  int advance;    // with counter: *counter += 1 after the waits (whether or not one gave up)
  int* snapshot;  // with begin, non-null: *snapshot = the new epoch (FO_GATHER_COPY_NOTIFY's per-set epoch)
  int pieces;     // with begin, > 0 (fo_scatter_run): piece_src[i] = *piece_sent + i + 1, then *piece_sent += pieces
  int* piece_sent;
  int* piece_src;
  int const* wait[kMaxWorld];
  int tag[kMaxWorld];
};

struct GatherEvents {
  cudaEvent_t fork = nullptr, join = nullptr, ready = nullptr;  // ready: every peer's shard is in its buffer
  cudaEvent_t piece[kMaxPieces] = {};  // fo_scatter_run: piece i of the part computed (cur), before its push (copy)
  cudaEvent_t pushed[kMaxPieces] = {};  // its all_reduce: piece i pushed (copy), before the add that rewrites it (cur)
  // The push schedule's call on this thread and device, from fo_gather_call to fo_gather_finish: whether its begin
  // was enqueued (then its finish owes every peer a done), and an enqueue failure no step kernel recorded yet.
  bool push_begun = false;
  int push_fail_tag = 0;
  int fork_rc = 0;  // FO_GATHER_BLOCKS: the fork's record in phase 1, for phase 2's pushes
};

// Per host thread and device, like ring_call.cu's events (made on first use).
int events(GatherEvents*& out);

// A step of call p with only its fault block, epoch, bound and launch id set.
GatherStep step_base(fo_gather_args const& p);

// One step kernel (one thread) on `stream`.
int launch_step(GatherStep const& s, cudaStream_t stream);

// The push's per-set flag of rank j in `page`: done_b[j] (first = kSetDone) or ready_b[j] (first = kSetReady).
inline int* set_flag(int* page, int first, int b, int j) { return page + first + b * kMaxWorld + j; }

// gather_gemms.cu: out [rows, n] = x [rows, k] @ w (+ c: the addend, laid out as out, beta 1), one GEMM on cur
// through the bound cuBLAS: cublasLtMatmul with the shape's kept plan where `workspace` is given and every operand
// lies on a 256-byte boundary, else cublasGemmEx (after copying c into out). Row-major, contiguous, 2-byte elements.
struct GemmRows {
  void* handle;
  int elem_type, math_mode, weight_transposed;
  void const* weight;
  int64_t n, k;
  void const* x;
  int64_t rows;
  void const* c;
  void* out;
  void* workspace;
  int64_t workspace_bytes;
  int device;
};
int gemm_rows(GemmRows const& g, cudaStream_t cur);
bool gemms_bound(bool lt);  // fo_cublas_bind ran (lt: fo_cublaslt_bind)
// fo_gather_finish(call) after a call's body returned rc, its status into *finish_rc; returns rc, with
// fo_last_error naming the body's failure and the finish's when both failed.
int finish_after(fo_gather_args const* call, int rc, int32_t* finish_rc);

}  // namespace flashoverlap::gp
