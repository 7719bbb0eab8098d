/* C ABI of libflashoverlap_sm90.so (the only exported symbols). Raw device pointers, cudaStream_t as void*.
 * (The tests' helper kernels live in a library of their own, libflashoverlap_sm90_test.so: csrc/test_api.cu.)
 *
 * Every function returns 0 on success or a nonzero error code; fo_last_error() then returns a message (per
 * thread, valid until the next failing call on that thread).
 *
 * Units: sizes and strides in elements; times in nanoseconds; counters are int32 and compared cyclically
 * ((int)(value - target) >= 0), so they never need resetting.
 */
#ifndef FLASHOVERLAP_SM90_H
#define FLASHOVERLAP_SM90_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FO_API __attribute__((visibility("default")))

/* The failure contract of a fused call's waits (csrc/device_wait.hpp). One block per fault domain: per (device,
 * group) for the peer and ring routes, in the group's symmetric flag page (so a rank can write its peers' blocks),
 * and per caller stream for the NCCL route. Every wait of a call ends at the call's deadline_ns (set by the call's
 * first wait kernel to now + its timeout): a wait that gives up records the first fault here (code 1) and in every
 * peer block listed (code 2); the NCCL route exchanges "a wait of this rank gave up in this call" with one int
 * all-reduce (MAX) in the NCCL group of its last collective (code 3 on the other ranks). While code != 0 the
 * route's last kernel fills the call's output with NaN and copies the first 8 ints into the caller's pinned host
 * mirror; only fo_fault_clear (the host, after raising) clears it. 128 bytes; the host writes rank, npeers, peers. */
#define FO_FAULT_MAX_PEERS 8
typedef struct fo_fault {
  int32_t code;         /* 0 none; 1 a wait of this rank timed out; 2 a peer's did; 3 another rank's (NCCL route);
                           4 this rank failed to issue part of the call; 5 the host watchdog gave up on the
                           call's NCCL kernels (fo_fault_mark) */
  int32_t tag;          /* the wait that gave up (route-coded) */
  int32_t seen;         /* the flag / counter value it last saw */
  int32_t target;       /* the value it waited for */
  int32_t origin;       /* the rank whose wait gave up (-1 unknown) */
  int32_t fault_call;   /* call_counter of the recording rank when it was recorded */
  int32_t launch;       /* current_launch of the recording rank when it was recorded */
  int32_t rank;         /* this rank in the group (host-written) */
  int64_t deadline_ns;  /* the current call's deadline (globaltimer ns) */
  int32_t call_counter; /* calls begun (device-incremented: graph replays count too) */
  int32_t current_launch; /* the host's id of the current call's launch (names its shape in the error) */
  int32_t npeers;       /* entries of peers (host-written) */
  int32_t exchange;     /* NCCL route: (origin + 1) of a fault of this call, all-reduced with MAX */
  struct fo_fault* peers[FO_FAULT_MAX_PEERS]; /* the peers' blocks mapped here (host-written) */
  int64_t reserved;
} fo_fault;

/* On `stream`: zero the block's fault fields (code .. launch, exchange; rank, npeers and peers stay) and the pinned
 * mirror int32[8]. */
FO_API int fo_fault_clear(fo_fault* fault, int* mirror, void* stream);
/* Records `code` (> 0; 5: the host watchdog gave up on an NCCL call, runtime/nccl_watch.py) with tag `tag` and this
 * rank as origin in the call the block is in, unless the block already holds a fault; on `stream` (the watchdog's own:
 * it runs beside a stuck NCCL kernel). In the versioned ABI since 10 (native/kernels.py binds it at load). */
FO_API int fo_fault_mark(fo_fault* fault, int code, int tag, void* stream);

/* ABI version; bumped on any change of the functions below. */
FO_API int fo_abi_version(void);
FO_API const char* fo_last_error(void);

/* Load every kernel of the library on the current device now. CUDA's lazy loading would load a kernel at its
 * first launch, which may synchronize the context: if a wait kernel is spinning for a kernel not yet loaded,
 * that deadlocks (until the wait's timeout; forever for fo_stream_wait_value). Call once per device before the
 * first GEMM or wait (the Python binding does). */
FO_API int fo_preload(void);

/* Compiled GEMM configurations. fo_config_info fills: name (the configuration without dtype/layout, e.g.
 * "coop_128x256x64_c2x1"), and ints[12] = {tile_m, tile_n, tile_k, cluster_m, cluster_n, schedule (0 coop,
 * 1 pingpong), stages (0 auto), epi_m, epi_n (0 auto), dtype (0 bf16, 1 fp16), b_layout (0 [N,K], 1 [K,N]), 0}. */
FO_API int fo_num_configs(void);
FO_API int fo_config_info(int index, char* name, int name_len, int* ints);

/* D[M,N] = A[M,K] @ B (+ bias[N]), fp32 accumulation, D in the input dtype. Configurations with ints[11] >= 1
 * ("_addc"; 2 and 3 also store D to an aux tensor, which only fo_peer_call passes) add a C operand: D = round(A @ B (+ bias)) + C, C [M,N] row-major (row stride ldc, any address this
 * GPU can reach, a peer's memory included), summed in fp32 and rounded once; c_operand must then be given, and
 * must be null for every other configuration.
 * A row-major with row stride lda; B per the configuration's layout with stride ldb; D row-major, row stride ldd.
 * counters: nullptr = no signals; else counters[group_of_tile_row[t]] (or counters[t] when the map is nullptr)
 * gets +1 per finished tile of tile-row t, after the tile's stores are complete and visible at GPU scope.
 * signal_mode: 0 immediate (wait for the stores at the end of each tile), 1 deferred (signal at the next
 * tile's epilogue, flush at kernel end). tile_row_order: nullptr = tile-rows in natural order; else a device
 * int32 permutation of [0, ceil(m / tile_m)): the scheduler's s-th tile-row is tile-row tile_row_order[s] (A is
 * read and D written at that row; csrc/tile_order.hpp). sm_count: SMs the GEMM may use (0 = all); above the device's SM count
 * it is the number of CTAs (persistent CTAs beyond one per SM; >= the tile count: one CTA per tile, so SMs freed
 * by finished tiles go to higher-priority streams first). raster: 0 heuristic,
 * 1 along M, 2 along N (row-major tile order). swizzle: 1/2/4/8 tile-rows (or columns) per band. */
FO_API int fo_gemm_workspace_size(int config, int m, int n, int k, int sm_count, int raster, int swizzle,
                                  size_t* bytes);
FO_API int fo_gemm(int config, const void* a, int64_t lda, const void* b, int64_t ldb, const void* bias,
                   const void* c_operand, int64_t ldc, void* d, int64_t ldd, int m, int n, int k, int* counters,
                   const int* group_of_tile_row, const int* tile_row_order, int signal_mode, int sm_count, int raster,
                   int swizzle, void* workspace, size_t workspace_bytes, void* stream);

/* GEMM launch cache. Every GEMM launch (fo_gemm, and the GEMMs of fo_fused_call, fo_peer_call, fo_ring_call) looks
 * up the kernel parameters built for an earlier launch of the same configuration with the same arguments --
 * every pointer, leading dimension, size, signal / gate setting, sm_count, raster, swizzle, workspace and the
 * current device; not the stream -- and launches with them (no TMA descriptor encoding, no checks); otherwise it
 * builds them and keeps them (256 per configuration, least recently used replaced). A hit is exactly the launch a
 * miss would make. fo_gemm_cache_enable(0) makes every later launch build its parameters (a diagnostic; 1 turns the
 * cache back on; returns the previous state, 1 or 0). fo_gemm_cache_stats: the launches that hit and missed since
 * the library was loaded, over all configurations (every launch is one or the other; null pointers are skipped).
 * Always returns 0. */
FO_API int fo_gemm_cache_enable(int enabled);
FO_API int fo_gemm_cache_stats(int64_t* hits, int64_t* misses);

/* Bounded wait (one thread on `stream`): polls *counter with ld.acquire.sys and __nanosleep backoff until
 * (int)(*counter - target) >= 0 (acquire at system scope), where target = (expected ? *expected : 0) + increment. With `expected` (device
 * int, graph-replay safe) the kernel stores the new target back, so each call waits for one more epoch.
 * On timeout it records {1, tag, seen value, target} into error_record[0..3] (device-visible memory, e.g.
 * pinned host memory; only the first error is kept) and exits. */
FO_API int fo_wait_counter(const int* counter, int* expected, int increment, int64_t timeout_ns, int* error_record,
                           int tag, void* stream);

/* One thread on `stream`: a system-scope fence, then a system-scope release add of 1 to *counter (which may be a
 * peer GPU's memory mapped here): whoever acquires the new value sees everything `stream` ordered before it.
 * fo_wait_counter's acquire is system-scope too, so the pair works across GPUs. */
FO_API int fo_notify(int* counter, void* stream);

/* cuStreamWaitValue32(stream, counter, target, GEQ): waits without a kernel; NOT bounded (no timeout). */
FO_API int fo_stream_wait_value(void* stream, int* counter, int target);

/* The whole fused op in one host call (csrc/fused_call.cu). Offsets and counts in elements, relative to `buf`
 * (the GEMM's [m, n] output, row stride ldd) or `out` (the op's output). */
typedef struct {
  int32_t tiles;       /* tiles the GEMM signals for this group; 0 = no wait */
  int32_t kind;        /* 0 all_reduce of buf (in place), 1 reduce_scatter buf -> out, 2 send/recv, 3 nothing,
                          4 reduce pieces: one NCCL group of ncclReduce calls, one per p2p entry (peer = root,
                          offset/count in buf), each root receiving at out + out_offset */
  int64_t buf_offset;  /* kinds 0, 1: first element in buf */
  int64_t out_offset;  /* kinds 1, 4: first element in out */
  int64_t count;       /* kind 0: elements reduced; kind 1: elements each rank receives */
  int32_t first_p2p;   /* kinds 2, 4: this group's entries of the p2p array */
  int32_t num_p2p;
  int64_t local_buf;   /* kind 2: this rank's own rows, copied buf -> out (local_count 0: none) */
  int64_t local_out;
  int64_t local_count;
  int64_t copy_src;        /* staging before the collective (copy_width 0: none): copy_height pieces of copy_width */
  int64_t copy_dst;        /* elements, from d + copy_src (pitch copy_src_pitch) to buf + copy_dst (pitch */
  int64_t copy_width;      /* copy_dst_pitch) */
  int64_t copy_height;
  int64_t copy_src_pitch;
  int64_t copy_dst_pitch;
} fo_group_step;

typedef struct {
  int32_t recv;    /* 0: send from buf + offset (kind 4: reduce it); 1: receive into out + offset */
  int32_t peer;    /* rank in the communicator (kind 4: the reduce's root) */
  int64_t offset;  /* elements */
  int64_t count;   /* elements */
} fo_p2p_step;

/* Bind the NCCL library at `path`, which must already be loaded in the process (dlopen RTLD_NOLOAD): the one the
 * caller's communicators were made by. */
FO_API int fo_nccl_bind(const char* path);

/* On cur_stream: counters -> expected (num_groups ints), a fork event, then the signal GEMM (as fo_gemm, into
 * d -- row stride ldd --, signalling counters[group_of_tile_row[t]], in tile_row_order; skipped when m == 0). On
 * side_stream, after the fork: per group g, fo_wait_counter(counters + g, expected + g, steps[g].tiles, ...)
 * unless tiles == 0 (the first one begins the call: deadline = now + timeout_ns, fault->rank = rank), then its staging copy d -> buf (if
 * any), then its NCCL call(s) on `comm` (ncclComm_t; nccl_dtype an ncclDataType_t, sum); the last group's NCCL
 * group also all-reduces fault->exchange (MAX). Then the fault kernel (fo_fault: NaN into out's out_numel elements
 * and the mirror while fault->code != 0), and cur_stream waits for side_stream. A group whose wait or staging copy
 * cannot be enqueued still gets its NCCL call(s) (code 4: the output is poisoned on every rank), so peers are never
 * left waiting; the first error is returned. ncclInProgress (non-blocking communicators) is waited out, bounded by
 * timeout_ns. elem_bytes: the element size of buf and out. */
FO_API int fo_fused_call(int config, const void* a, int64_t lda, const void* b, int64_t ldb, const void* bias,
                         void* d, void* buf, int64_t ldd, int m, int n, int k, const int* group_of_tile_row,
                         const int* tile_row_order, int signal_mode, int sm_count, int raster, int swizzle,
                         void* workspace, size_t workspace_bytes,
                         int* counters, int* expected, int num_groups, const fo_group_step* steps,
                         const fo_p2p_step* p2p, void* out, int elem_bytes, int nccl_dtype, void* comm,
                         int64_t timeout_ns, fo_fault* fault, int* mirror, int32_t launch_id, int64_t out_numel,
                         int32_t rank, void* cur_stream, void* side_stream);

/* Test-only fault injection into fo_fused_call (off unless armed; not part of the versioned ABI: bound optionally by
 * flashoverlap_inductor/runtime/fault_inject.py, which disarms it again). Process-wide. Counts the NCCL enqueue calls
 * fo_fused_call makes (ncclAllReduce, ncclReduceScatter, ncclReduce, ncclSend, ncclRecv; the fault exchange
 * included; not ncclGroupStart/End); the nth one after arming (nth >= 1; nth <= 0 injects no call) is replaced:
 * code != 7 (an ncclResult_t): the call is not made and returns `code` (refused: nothing enqueued); code 7
 * (ncclInProgress): the call is made and reported as in progress, then the next `polls` polls of
 * ncclCommGetAsyncError report ncclInProgress before the real ones. stall_ns > 0: the next fo_fused_call with rows
 * spins that long (ns, GPU timer) on cur_stream after its fork, before its GEMM (the GEMM of this rank starts
 * late; the side stream's first wait has set the call's deadline already). Arming resets the counts of
 * fo_nccl_inject_stats: fired (injected NCCL results), polled (injected in-progress polls), stalled (stalls). */
FO_API int fo_nccl_inject(int64_t nth, int code, int64_t polls, int64_t stall_ns);
FO_API int fo_nccl_inject_stats(int64_t* fired, int64_t* polled, int64_t* stalled);

/* The peer route of a two-rank fused reduce_scatter / all_reduce (csrc/peer_call.cu): no NCCL, no reduction
 * kernel. Rank r owns rows [own_row, own_row + rows) of the [m, n] result, its peer [peer_row, peer_row + rows).
 *   cur:  GEMM 1 (config_partial): A's peer rows -> partial; notify peer_flags[0]; wait flags[0] (the peer's
 *         GEMM 1 is done); GEMM 2 (config_add, an _addc configuration): A's own rows + C = peer_partial (the peer's
 *         GEMM 1 result for these rows) -> own_dst, signalling counters per group (all_reduce). Either GEMM 1
 *         stores into the peer's memory (partial mapped here, peer_partial local) or GEMM 2 reads it (partial
 *         local, peer_partial mapped here): the caller chooses by the two pointers.
 *   all_reduce only (num_groups > 0), per group g of GEMM 2's rows: side: wait counters[g], notify peer_flags[1+g],
 *         copy own_dst rows -> out's own rows; pull: wait flags[1+g], copy peer_own rows (the peer's own_dst, read
 *         over NVLink by the copy engine) -> out's peer rows. Both streams are joined back into cur.
 *   reduce_scatter (num_groups 0, no push): after GEMM 2, notify peer_flags[1] and wait flags[1] (the peer's GEMM 2,
 *         the reader of what our GEMM 1 wrote, is done).
 * One set of buffers serves every call (so a call replayed from a CUDA graph needs no host state): what one rank
 * writes and the other reads (partial / peer_partial, own_dst and the landing buffer for all_reduce) is rewritten
 * by call i + 1 only after the reader of call i is done. GEMM 1 of call i + 1 (the partials) follows, in stream
 * order, call i's waits on flags[1 + g], which the peer notifies after its GEMM 2 (the C reader) of call i. GEMM 2 of
 * call i + 1 (own_dst, the peer's landing buffer) waits for the peer's GEMM 1 of call i + 1, which follows the
 * peer's copies out of those buffers for call i (joined into its cur stream) in stream order.
 * expected: device ints, 1 + 2 * FO_PEER_MAX_GROUPS: [0] the epoch of flags[0], [1 + g] of flags[1 + g], and
 * [1 + FO_PEER_MAX_GROUPS + g] the target of counters[g] (resynchronised from counters at every call). */
#define FO_PEER_MAX_GROUPS 64
#define FO_PEER_PROBE_GEMM1 0
#define FO_PEER_PROBE_NOTIFY 1
#define FO_PEER_PROBE_GEMM2 2
#define FO_PEER_PROBE_EXCHANGE 3
#define FO_PEER_PROBE_COPY 4
#define FO_PEER_PROBE_PULL 8
#define FO_PEER_PROBE_GROUPS 8
#define FO_PEER_PROBE_SIDE (FO_PEER_PROBE_PULL + FO_PEER_PROBE_GROUPS)
#define FO_PEER_PROBE_EVENTS (FO_PEER_PROBE_SIDE + FO_PEER_PROBE_GROUPS)
typedef struct {
  int32_t config_partial, config_add;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  const void* bias;
  int32_t n, k, rows, own_row, peer_row;
  int32_t num_groups;            /* 0: reduce_scatter (own_dst is the output); else all_reduce */
  void* partial;                 /* [rows, n] contiguous: GEMM 1's destination (the peer reads it as its C) */
  const void* peer_partial;      /* [rows, n] contiguous: GEMM 2's C (the peer's GEMM 1 wrote it) */
  void* own_dst;                 /* [rows, n], row stride ld_own */
  int64_t ld_own;
  int* flags;                    /* this rank's symmetric flags (1 + num_groups ints used) */
  int* peer_flags;               /* the peer's flags mapped here */
  int* expected;
  const int32_t* group_rows;     /* host, num_groups + 1 boundaries within the rows */
  const int32_t* group_tiles;    /* host, num_groups: tiles of GEMM 2 per group */
  int* counters;                 /* device, num_groups */
  const int* group_of_tile_row;  /* device, GEMM 2's tile-rows -> group */
  const void* peer_own;          /* the peer's own_dst mapped here (contiguous, row stride n) */
  void* out;                     /* [m, n] row stride ld_out (all_reduce) */
  int64_t ld_out;
  int32_t elem_bytes, signal_mode, sm_count, raster, swizzle;
  void* workspace;
  size_t workspace_bytes;
  int64_t timeout_ns;            /* the call's deadline: now + timeout_ns at its first wait (fo_fault) */
  fo_fault* fault;               /* the group's fault block on this device (in the symmetric flag page) */
  void* cur_stream;
  void* side_stream;
  void* pull_stream;
  /* all_reduce by push (num_groups must be 0): GEMM 2 (an add_c 2 / 3 configuration) writes out's own rows and
   * stores the same values into the peer's landing buffer (peer_own, mapped here); then notify peer_flags[1],
   * wait flags[1] (the peer's pushes into own_dst, this rank's landing buffer, are complete) and copy own_dst ->
   * out's peer rows on cur. */
  int32_t push;
  int32_t copy_on_sms;  /* push: the final copy by an SM kernel (1) or the copy engine (0) */
  int32_t gate_in_kernel; /* 1: no wait kernel between the GEMMs; GEMM 2's epilogue waits for flags[0] before each
                             tile's C load (the peer's GEMM 1 is then usually long done). 0: a wait kernel. */
  int* mirror;            /* pinned host int32[8]: the fault block's copy while it holds a fault */
  int32_t launch_id;      /* the host's id of this call's launch (fo_fault.current_launch) */
  /* The timeline probe (python -m flashoverlap_inductor.bench timeline --op ...; routes/peer.py probe_points):
   * optional timing-enabled cudaEvent_t handles, each recorded by the call on the stream where its point happens
   * (null: none, the normal case; one pointer test per point). A failed record never changes the protocol (every
   * notify still runs); the call then returns its error at the end. Indices (FO_PEER_PROBE_*):
   *   0 cur, after GEMM 1;
   *   1 cur, after the notify (gate_in_kernel 1) or the notify + wait kernel (0): the peer's GEMM 1 is done;
   *   2 cur, after GEMM 2 (with gate_in_kernel 1 its gate's waits are inside);
   *   3 cur: reduce_scatter and push, after the flag exchange; pull (num_groups > 0), after the join of the side
   *     and pull streams;
   *   4 cur, push: after the final copy (landing buffer -> out's peer rows);
   *   5-7 unused (null);
   *   8 + g, g < FO_PEER_PROBE_GROUPS, pull: the pull stream after group g's copy (the peer's rows landed);
   *   8 + FO_PEER_PROBE_GROUPS + g, pull: the side stream after group g's copy (own rows -> out).
   * Groups from FO_PEER_PROBE_GROUPS on record none. */
  void* probe_events[FO_PEER_PROBE_EVENTS];
} fo_peer_args;

FO_API int fo_peer_call(const fo_peer_args* args);

/* The ring route of a fused reduce_scatter / all_reduce on `world` ranks of one NVLink host (csrc/ring_call.cu): the
 * reduction runs in the GEMMs' epilogues as partial sums travel around the ring; no NCCL, no reduction kernel.
 * The [M, n] result is cut into world * rounds pieces of `rows` rows: piece (c, t) is rows c * M / world + t * rows
 * (chunk c = what rank c owns after the reduce_scatter; round t). Per round t, step s = 0 .. world - 1 on cur,
 * rank r computes piece (c, t) with c = (r + s + 1) % world:
 *   s = 0: a plain GEMM (config_first) into slot (t, 0) of rank r - 1 (mapped here: TMA stores over NVLink);
 *   0 < s < world - 1: an _addc GEMM (config_add) adding C = this rank's slot (t, s - 1) (what rank r + 1 pushed at
 *          its step s - 1 of the same piece) into slot (t, s) of rank r - 1;
 *   s = world - 1: c = r, the sum of all partials: into out's rows (reduce_scatter: out = [M / world, n]) or, for
 *          all_reduce, into this rank's symmetric `own` piece t.
 * After each push (s < world - 1) one kernel adds 1 to rank r - 1's arrival flag (t, s) and advances this rank's
 * epoch of the same flag; step s + 1 waits for it: before each tile's C load (gate_in_kernel) or by a wait kernel.
 * all_reduce, per round t: after step world - 1 every other rank's ready flag (t, r) gets 1; pull stream d (peer
 * p = (r + d) % world) waits for this rank's ready flag (t, p) and copies p's own piece t into out (the copy engine
 * reads it over NVLink) while the next round computes; the side stream copies this rank's own piece t into out.
 * cur then joins every stream and ends with a barrier: it adds 1 to every other rank's done flag and waits for
 * world - 1 adds to its own, so no rank reads any region of the call any more (whatever layout a call of another
 * shape gives the same workspace next). reduce_scatter ends with one flag each way: tell rank r + 1 that its pushes
 * have been read (its slots here, read only by this rank's steps), wait for rank r - 1's word that ours have.
 * One set of buffers serves every call (graph replay safe), as for fo_peer_call: every region one rank writes and
 * another reads is rewritten by call i + 1 only after a flag proves call i's reader is done (all_reduce: the
 * barrier follows every rank's last GEMM step, pulls and copy; reduce_scatter: the final exchange).
 * Buffers: buffers[p] is rank p's workspace mapped here (buffers[rank] local): rounds * (world - 1) slots, then
 * rounds own pieces, each rows * n elements, contiguous. flags[p]: rank p's ring flag area (FO_RING_FLAGS ints,
 * zeroed once); expected: this rank's epochs (FO_RING_FLAGS device ints). Flag indices: arrival (t, s) at
 * t * (world - 1) + s; reduce_scatter's done at rounds * (world - 1); all_reduce's ready (t, p) at
 * rounds * (world - 1) + 1 + t * world + p and its done after them. */
#define FO_RING_MAX_WORLD 8
#define FO_RING_FLAGS 256
typedef struct {
  int32_t config_first, config_add;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  const void* bias;
  int32_t n, k, rows, rounds, world, rank;
  int32_t all_reduce;                      /* 0: reduce_scatter */
  void* buffers[FO_RING_MAX_WORLD];        /* every rank's workspace, mapped here */
  int* flags[FO_RING_MAX_WORLD];           /* every rank's ring flags, mapped here */
  int* expected;
  void* out;
  int64_t ld_out;
  int32_t elem_bytes, signal_mode, sm_count, raster, swizzle, gate_in_kernel;
  void* workspace;                         /* the GEMMs' CUTLASS workspace */
  size_t workspace_bytes;
  int64_t timeout_ns;                      /* the call's deadline: now + timeout_ns at its first wait (fo_fault) */
  fo_fault* fault;                         /* the group's fault block on this device (in the ring flag area) */
  void* cur_stream;
  void* side_stream;                       /* all_reduce: this rank's own pieces -> out */
  void* pull_streams[FO_RING_MAX_WORLD];   /* all_reduce: [d - 1] pulls from rank (rank + d) % world */
  int* mirror;                             /* pinned host int32[8]: the fault block's copy while it holds a fault */
  int32_t launch_id;                       /* the host's id of this call's launch (fo_fault.current_launch) */
} fo_ring_args;

FO_API int fo_ring_call(const fo_ring_args* args);

/* The NVLink peer route of all_gather -> GEMMs (csrc/gather_call.cu; Python: routes/gather_peer.py). The shards
 * travel by copy engine (cudaMemcpyAsync, no SM); the GEMMs are the caller's (cuBLAS on cur_stream, between the two
 * calls below, each pulled shard's after its shard_events[j]).
 * Memory of one (device, group): every rank's gather flag page (FO_GATHER_FLAG_INTS ints, zeroed once; flags[p] is
 * rank p's mapped here): ready[j] at index j and done[j] at FO_GATHER_MAX_WORLD + j, both written only by rank j
 * (one system-scope release add per call each; under FO_GATHER_COPY_NOTIFY ready[j] may instead get a copy-engine
 * write of the value that add would leave); and every rank's symmetric buffer (buffers[p], at least
 * shard_bytes). epoch: a device int of this rank, the number of calls begun (graph-replay safe).
 * fo_gather_call, call e = *epoch + 1, everything on copy_stream after a fork from cur_stream:
 *   1. begin (deadline = now + timeout_ns, fault->call_counter + 1, current_launch, *epoch = e); wait until every
 *      peer j's done in this rank's page >= e - 1 (rank j finished reading this rank's shard of call e - 1; tag
 *      3100 + j);
 *   2. copy a -> buffers[rank] (and, with copy_own, -> staging slot `rank`); add 1 to ready[rank] in every peer's
 *      page;
 *   3. per peer j in arrival order (rank - 1, rank - 2, ... mod world): wait until ready[j] here >= e (tag 3000 + j),
 *      copy buffers[j] -> staging slot j (staging + j * shard_bytes), record shard_events[j], and (with the next
 *      wait) add 1 to done[rank] in rank j's page.
 * fo_gather_finish: cur_stream joins copy_stream, then one kernel fills each of the num_outputs outputs (contiguous,
 * output_numel elements of elem_bytes; NaN of bf16 when bf16, else fp16 / fp32) with NaN while the fault block
 * holds a fault, and copies the block into `mirror`. Every rank adds each of its flags once per call and every wait
 * consumes its epoch whether or not it timed out, so a late rank leaves the protocol in step; a rank that cannot
 * enqueue part of a call records code 4 in its block and every peer's before its next notification. A buffer is
 * rewritten by call e + 1 only after every reader of call e said done (step 1), so one set of buffers serves every
 * call, eager or replayed. Returns the first error. */
#define FO_GATHER_MAX_WORLD 8
#define FO_GATHER_MAX_OUTPUTS 8
#define FO_GATHER_SLOT_SETS 2
#define FO_GATHER_FLAG_INTS (9 * FO_GATHER_MAX_WORLD)
/* options bit: steps 2-3 become one handshake (ready to every peer, then one kernel waits for every peer's ready),
 * after which cur_stream waits for the copy stream; then the pulls (copy engine) back to back, the own slot copy,
 * and one kernel adds done to every peer. No protocol kernel then needs an SM while the caller's GEMMs run (a GEMM
 * that fills every SM would otherwise hold a step kernel, hence the pulls, until its CTAs retire); the GEMMs start
 * one handshake later. Without it, the per-peer steps of 3. below. */
#define FO_GATHER_GEMM_AFTER_HANDSHAKE 1
/* options bit (gather_start="push"; what "auto" takes on 2 ranks where its buffer fits): the push schedule. buffers[p]
 * are then every rank's receive buffers of FO_GATHER_SLOT_SETS sets of world slots (slot j of set b at buffers[p] +
 * b * set_bytes + j * shard_bytes: rank j's shard; a workspace of its own, never shared with the schedules above;
 * set_bytes is fixed per workspace, whatever the call's shard size, so calls of other sizes on the other set never
 * overwrite a slot that a set's waits do not guard); a
 * call uses set slot_set, which the host picks alike on every rank (alternating, so a rank may push call e + 1 while
 * its peers still read call e). The page also holds, per set b (M = FO_GATHER_MAX_WORLD, S = FO_GATHER_SLOT_SETS):
 * done_b[j] at 2M + bM + j and ready_b[j] at (2 + S)M + bM + j (each written only by rank j, once per set-b call), and
 * this rank's own counters uses_b at (2 + 2S)M + b (its pushes begun into set b) and reads_b at (2 + 2S)M + S + b (its
 * set-b calls whose shards it waited for), and, under FO_GATHER_COPY_NOTIFY, its epoch as its last set-b call began at
 * (2 + 2S)M + 2S + b. Counters, not the epoch, so captured and eager calls may use the sets in any order alike on
 * every rank; a rank on another set than its peers waits out its bound (a fault: poisoned, raised, resynchronized),
 * never reads a stale slot. On cur_stream, one short kernel before the caller's GEMMs: begin (as 1.) and wait until
 * every peer j's done_b[j] here reaches uses_b, then uses_b + 1 (tag 3100 + j; with alternating sets the peers' call
 * e - 2, met by then); then on copy_stream after a fork: copy a into slot `rank` of set b of every peer's buffer (peer
 * to peer, copy engine), add 1 to ready[rank] and ready_b[rank] in every peer's page after the last push (under
 * FO_GATHER_COPY_NOTIFY below: per peer, right after its push), per peer j in arrival order wait until ready_b[j] here
 * >= reads_b + 1 (tag 3000 + j; then reads_b + 1) and record shard_events[j], and, with copy_own, copy every slot of
 * set b and a into staging (the gathered rows). cur_stream waits for no handshake: the caller's GEMMs read a at once
 * and slot j of set b here after shard_events[j] (staging is then that set for fo_gather_gemms). fo_gather_finish
 * joins first, then adds 1 to done[rank] and done_b[rank] in every peer's page on cur_stream (only for a call whose
 * begin was enqueued on this host thread, and only after a join: every read of the slots is over), then poisons as
 * below. staging may be null without copy_own. Every call, whichever schedule, notifies ready[rank] and done[rank]
 * once (their waits count calls). */
#define FO_GATHER_PUSH 2
/* options bit, with FO_GATHER_PUSH on 3+ ranks (the experiment gather_copy_notify; 4 H200s: correct, no faster): each peer is
 * told right after its push, by two 4-byte copy-engine copies of this rank's own values into its page, the epoch
 * snapshot of set b into ready[rank] and uses_b into ready_b[rank]: the values the adds would leave (one writer per
 * flag; the writes of a rank land in call order, as fo_gather_finish joins the copy stream before the next call
 * begins), and no step kernel, which would wait for an SM the caller's GEMM holds, sits behind the pushes. A peer
 * whose push or copy could not be enqueued, and every peer after an enqueue failure, is told by the add after the
 * failure is recorded; peers told by copy before it learn of the failure at a later call (no wrong value). Whether a
 * copy-engine write after a copy-engine copy on one stream orders the data before the flag for a peer's
 * system-scope acquire is not documented: to be checked on GPUs before the bit is relied on. */
#define FO_GATHER_COPY_NOTIFY 4
/* options bit, with FO_GATHER_PUSH (routes/moe_peer.py: the MoE ops' all_to_all of variable blocks): rank r pushes
 * blocks[j] (block_bytes[j], its own size per peer, 0 allowed) into slot r of set slot_set of rank j's buffer, slot j
 * of set b at b * set_bytes + j * slot_bytes (world * slot_bytes <= set_bytes; every block and recv_bytes <=
 * slot_bytes). The push of block j first waits for block_events[j] where given (recorded on cur after the work that
 * wrote it: each block travels as soon as it exists). After the wait for peer j's push, the copy stream copies
 * recv_bytes[j] of slot j here into recv[j] (copy engine) before it records shard_events[j]. The flags, waits,
 * notifications, finish and poisoning are the push schedule's, unchanged: both ends of a pair issue one push and one
 * read per call whatever the sizes, so the counters stay in step. phase 1 enqueues only the begin on cur (and the
 * fork), before the caller writes the blocks; phase 2, the same args on the same host thread, the rest; phase 0 both.
 * Excludes copy_own and FO_GATHER_COPY_NOTIFY. */
#define FO_GATHER_BLOCKS 8
typedef struct {
  int32_t world, rank;
  int64_t shard_bytes;                        /* bytes of one shard ([shard_rows, K], contiguous) */
  const void* a;                              /* this rank's shard, contiguous */
  void* buffers[FO_GATHER_MAX_WORLD];         /* every rank's symmetric buffer, mapped here */
  int* flags[FO_GATHER_MAX_WORLD];            /* every rank's gather flag page, mapped here */
  int* epoch;                                 /* device int: calls begun on this (device, group) */
  void* staging;                              /* world * shard_bytes, local: shard j at staging + j * shard_bytes */
  int32_t copy_own;                           /* 1: also copy a into staging slot `rank` */
  int32_t launch_id;                          /* the host's id of this call's launch (fo_fault.current_launch) */
  int64_t timeout_ns;                         /* the call's deadline: now + timeout_ns when it begins */
  fo_fault* fault;                            /* the group's fault block on this device (in the flag page) */
  int* mirror;                                /* pinned host int32[8] */
  void* cur_stream;
  void* copy_stream;
  void* shard_events[FO_GATHER_MAX_WORLD];    /* cudaEvent_t per peer (the caller's), recorded after its pull */
  int32_t num_outputs;                        /* fo_gather_finish: outputs to poison on a fault */
  int32_t elem_bytes;                         /* 2 or 4 */
  int32_t bf16;                               /* elem_bytes 2: 1 bf16, 0 fp16 */
  int32_t options;                            /* bits FO_GATHER_GEMM_AFTER_HANDSHAKE, FO_GATHER_PUSH */
  void* outputs[FO_GATHER_MAX_OUTPUTS];
  int64_t output_numel[FO_GATHER_MAX_OUTPUTS];
  int32_t slot_set;                           /* FO_GATHER_PUSH: the set of slots this call writes and reads
                                               * (0 .. FO_GATHER_SLOT_SETS - 1, the same on every rank); else 0 */
  int64_t set_bytes;                          /* FO_GATHER_PUSH: bytes from one slot set to the next in every
                                               * receive buffer, >= world * shard_bytes; the same on every rank and
                                               * for every call on one workspace (its capacity / SLOT_SETS) */
  /* FO_GATHER_BLOCKS only (zero otherwise): per peer j */
  const void* blocks[FO_GATHER_MAX_WORLD];    /* the rows this rank sends to rank j (null where block_bytes[j] is 0) */
  int64_t block_bytes[FO_GATHER_MAX_WORLD];   /* their bytes, 0 .. slot_bytes */
  void* block_events[FO_GATHER_MAX_WORLD];    /* cudaEvent_t the push of block j waits for (null: the fork only) */
  void* recv[FO_GATHER_MAX_WORLD];            /* where rank j's block (slot j here) is copied to */
  int64_t recv_bytes[FO_GATHER_MAX_WORLD];    /* its bytes, 0 .. slot_bytes (0: not copied) */
  int64_t slot_bytes;                         /* the slots' stride in a set, the same on every rank */
  int32_t phase;                              /* 0: the whole call; 1: its begin only; 2: the rest, after phase 1 */
  int32_t reserved;
} fo_gather_args;

FO_API int fo_gather_call(const fo_gather_args* args);
FO_API int fo_gather_finish(const fo_gather_args* args);

/* fo_gather_gemms (gather_gemms.cu): the route's GEMMs between fo_gather_call and fo_gather_finish, in one host call,
 * through the cuBLAS bound by fo_cublas_bind (the one torch loaded: dlopen with RTLD_NOLOAD) on `handle` (torch's,
 * bound to cur_stream), issued as torch.mm issues them. Shard j in arrival order (rank, rank - 1, ...): after its
 * pull event (not the local shard, read from `a`), per weight w: outputs[w][j * rows : (j + 1) * rows] = shard @ w.
 * Contiguous shards only ([rows, K] each; staging as fo_gather_args's), no bias; bf16 / fp16.
 * With `workspace` (and the cuBLASLt torch loaded bound by fo_cublaslt_bind): each GEMM is one cublasLtMatmul on the
 * handle cast to cuBLASLt's, with the descriptors and the heuristic's first algorithm for its shape made once per
 * (device, shape, workspace_bytes) and kept (the same product, compute and scale type as cublasGemmEx's; about half
 * its host time per GEMM); a shape the heuristic has no algorithm for, or a GEMM with an operand off a 256-byte
 * boundary, takes cublasGemmEx. The workspace is the caller's, used in stream order on cur_stream only. */
typedef struct {
  int32_t world, rank;
  int64_t rows, k;                               /* a shard's rows (>= 2) and K (>= 2) */
  const void* a;                                 /* this rank's shard, contiguous [rows, K] */
  const void* staging;                           /* [world, rows, K]: pulled shard j at j * rows * K */
  void* shard_events[FO_GATHER_MAX_WORLD];       /* cudaEvent_t per peer: its pull landed (fo_gather_call's) */
  void* cur_stream;
  void* handle;                                  /* cublasHandle_t, its stream cur_stream */
  int32_t elem_type;                             /* cudaDataType_t: 14 bf16, 2 fp16 */
  int32_t math_mode;                             /* cublasMath_t for each GEMM (reset to the default after it) */
  int32_t num_weights;                           /* 1 .. FO_GATHER_MAX_OUTPUTS */
  int32_t weight_transposed[FO_GATHER_MAX_OUTPUTS]; /* 1: W.t() of a contiguous [N, K]; 0: contiguous [K, N] */
  const void* weights[FO_GATHER_MAX_OUTPUTS];
  int64_t n[FO_GATHER_MAX_OUTPUTS];              /* each weight's N (>= 2) */
  void* outputs[FO_GATHER_MAX_OUTPUTS];          /* each [world * rows, N], contiguous */
  void* workspace;                               /* null: cublasGemmEx; else cuBLASLt with this workspace */
  int64_t workspace_bytes;                       /* the workspace's size (a heuristic preference: part of the key) */
} fo_gather_gemm_args;

FO_API int fo_cublas_bind(const char* path);
FO_API int fo_cublaslt_bind(const char* path);
FO_API int fo_gather_gemms(const fo_gather_gemm_args* args);
/* fo_gather_run: one call of the gather protocol in one host call: fo_gather_call, then (where it succeeded and
 * `gemms` is not null) fo_gather_gemms, then always fo_gather_finish, whose status goes to *finish_rc. Returns the
 * first failure of the first two (0: both succeeded); where the finish failed too, fo_last_error names both. */
FO_API int fo_gather_run(const fo_gather_args* call, const fo_gather_gemm_args* gemms, int32_t* finish_rc);

/* fo_scatter_run (csrc/scatter_run.cu; Python: routes/scatter_pull.py): GEMM -> reduce_scatter on 2 ranks of one
 * NVLink host as one host call, on the gather protocol's push workspace, flags and copy stream (`call`: options
 * FO_GATHER_PUSH, world 2, `a` = `part`, shard_bytes = half_rows * n * elem bytes, outputs[0] = `out` for the
 * poison; staging, copy_own and shard_events unused). Rank r, peer p = 1 - r, the output rows in halves (half h is
 * rank h's result), each half cut into `pieces` row ranges alike on both ranks (piece i: rows [i * half_rows /
 * pieces, (i + 1) * half_rows / pieces)):
 *   1. on cur_stream, one kernel: begin the call (as fo_gather_call), add 1 to ready[r] in p's page (every call
 *      does once), write this call's piece values src[i] = sent + i + 1 (sent += pieces), and wait until p's
 *      done_b[p] here reaches uses_b (p finished reading the slot set b this call overwrites; then uses_b + 1);
 *   2. per piece i: part rows of piece i = a[p's half, piece i] @ w (cuBLAS, on cur_stream); then on the copy
 *      stream after it: those rows into slot r of set b in p's receive buffer (copy engine), then src[i] into
 *      piece_ready[r] in p's page (a 4-byte copy-engine write: no SM, so no GEMM delays it);
 *   3. per piece i on cur_stream: one kernel waits until piece_ready[p] here reaches recv + 1 (then recv + 1; tag
 *      3000 + p; bounded by the call's deadline), then out rows of piece i = a[r's half, piece i] @ w + the
 *      received rows of piece i (one cublasLtMatmul with C = the slot, beta 1; cublasGemmEx after a copy into out
 *      where an operand is off a 256-byte boundary or no plan exists); with pieces = 1 instead: out = a[r's half] @ w
 *      at once (beside the push), the wait, then out += the slot (one add kernel, fp32 sums rounded once: torch's
 *      add_);
 *   4. always fo_gather_finish(call) (join, done and done_b to p, poison), its status in *finish_rc.
 * Flags (this rank's page, after the push counters): piece_ready[j] at (2 + 2S)M + 3S + j (written only by rank j,
 * absolute: the pieces j pushed here so far), sent and recv at (3 + 2S)M + 3S and + 1 (this rank's own), src[0 ..
 * FO_SCATTER_MAX_PIECES) after them. Both ranks cut alike (pieces, half_rows, cuts: from the shape, the settings and
 * the cost data, which the ranks agree on), so each wait pairs with one write; a rank out of step waits out its bound:
 * a fault (poisoned, raised, resynchronized).
 * all_reduce = 1 (the pull route's all_reduce, routes/reduce_pull.py): `out` is the whole [2 * half_rows, N] result,
 * `part` unused, call.a = out; the 2 * half_rows rows cut into `pieces` ranges alike on both ranks (`cuts`); this
 * rank's receive region is all of set b in its buffer (2 shards: the peer's whole partial). Step 1 as above; then per
 * piece i on cur_stream: out rows of piece i = a rows of piece i @ w (this rank's partial); on the copy stream after
 * it, those rows into the same rows of set b in p's buffer, then src[i] into piece_ready[r] in p's page; and once piece
 * i + 1 is issued (piece i: after the last), on cur_stream: wait for the copy stream's push of piece i (an event) and
 * for piece_ready[p] to reach recv + 1 (a bounded kernel), then out rows of piece i += the received rows (the add
 * kernel: fp32 sums rounded once, the same bits on both ranks). Step 4 as above. */
#define FO_SCATTER_MAX_PIECES 8
typedef struct {
  int64_t half_rows, n, k;                       /* each half's rows (>= pieces; all_reduce: 2 x half_rows >=
                                                    pieces), N (>= 2), K (>= 2) */
  int32_t pieces;                                /* 1 .. FO_SCATTER_MAX_PIECES */
  int32_t weight_transposed;                     /* 1: W.t() of a contiguous [N, K]; 0: contiguous [K, N] */
  const void* a;                                 /* [2 * half_rows, K] contiguous */
  const void* weight;
  void* part;                                    /* [half_rows, N] contiguous, local: the peer's half (pushed) */
  void* out;                                     /* [half_rows, N] contiguous: this rank's result (all_reduce:
                                                    [2 * half_rows, N]) */
  void* handle;                                  /* cublasHandle_t, its stream cur_stream */
  int32_t elem_type;                             /* cudaDataType_t: 14 bf16, 2 fp16 */
  int32_t math_mode;                             /* cublasMath_t for cublasGemmEx (reset to the default after) */
  void* workspace;                               /* cuBLASLt's (null: cublasGemmEx for every GEMM) */
  int64_t workspace_bytes;
  int32_t all_reduce;                            /* 1: GEMM -> all_reduce (below); 0: reduce_scatter */
  int64_t cuts[FO_SCATTER_MAX_PIECES + 1];       /* all_reduce: piece i's rows [cuts[i], cuts[i + 1]), cuts[0] = 0 <
                                                    ... < cuts[pieces] = 2 * half_rows; all zero: even pieces */
} fo_scatter_gemm_args;

FO_API int fo_scatter_run(const fo_gather_args* call, const fo_scatter_gemm_args* gemm, int32_t* finish_rc);

/* The MoE whole-block path's routing plan (flashoverlap_inductor/routes/moe_plan_kernel.py; csrc/moe_plan.cu): on
 * `stream`, zero work[0, work_len) (int64), then two kernels fill idx (int64 [rows]: each index entry mod rows), inv
 * (the last expert row naming each buffer row; 0 for none), hits, count (int64 [blocks * experts]), facts (the settle
 * vector, FO_MOE_SETTLE_LEN int64 fields FAIL ROWS IDX_MAX IDX_MIN OFFS_STEP UNNAMED OFFS_LAST KEY_STEP) and table
 * (int32 [blocks, table_cols]: block j's cumulative expert offsets clamped to its rows; columns past experts 0).
 * count, facts, inv and hits lie inside work. ends: block j's end row (ends[blocks - 1] == rows; unused entries
 * rows). With pieces > 0 the judge also writes bounds[0 .. pieces] (routes/moe_expert_cut.py): bounds[0] = 0,
 * bounds[pieces] = experts, bounds[q + 1] = the fewest experts whose rows in every block end within cuts[q][j] (the
 * table's entries at most the cut), at least bounds[q]. */
#define FO_MOE_MAX_BLOCKS 8
#define FO_MOE_MAX_PIECES 8
#define FO_MOE_MAX_EXPERTS 1024
#define FO_MOE_SETTLE_LEN 8
#define FO_MOE_POISON_SLOTS 4
typedef struct {
  const void* index;                /* rows int32 / int64 entries (index_bytes 4 / 8) */
  const void* offs;                 /* experts int32 / int64 cumulative offsets (offs_bytes 4 / 8) */
  int32_t index_bytes, offs_bytes;
  int64_t rows;                     /* in [1, 2^31) */
  int32_t experts, blocks;          /* in [1, FO_MOE_MAX_EXPERTS], [1, FO_MOE_MAX_BLOCKS] */
  int64_t ends[FO_MOE_MAX_BLOCKS];
  int64_t* work;                    /* zeroed here first: work_len int64 */
  int64_t work_len;
  int64_t *count, *facts, *inv, *hits;
  int64_t* idx;
  int32_t* table;
  int32_t table_cols;               /* >= experts */
  int32_t pieces;                   /* 0: no piece bounds; else in [1, FO_MOE_MAX_PIECES] */
  int64_t cuts[FO_MOE_MAX_PIECES][FO_MOE_MAX_BLOCKS];  /* cuts[q][j], q < pieces - 1: block j's rows in chunks 0..q */
  int32_t* bounds;                  /* pieces + 1 int32 (pieces > 0): the expert pieces' bounds, written by the judge */
  void* stream;
} fo_moe_plan_args;
FO_API int fo_moe_plan(const fo_moe_plan_args* args);

/* The deferred MoE settle's poison (routes/moe_deferred.py): on `stream`, outputs 0..outputs-1 (numel[k] elements of
 * elem_bytes[k] each, contiguous) filled with nan_bits[k] where any of the world vectors (FO_MOE_SETTLE_LEN int64
 * each, rank order) is bad: a failure (FAIL != 0: UNSENT included), an index out of range, offsets that decrease or
 * do not end at the rows, unnamed rows, a key step below 0. Nothing is written when every vector is good. With
 * `mirror` (page-locked host memory the device can address, world * FO_MOE_SETTLE_LEN int64; refused otherwise)
 * the kernel also copies the vectors there, good or bad: the host reads them after an event recorded behind it. */
typedef struct {
  const int64_t* every;
  int64_t* mirror;                  /* null, or a page-locked host copy of every, written by the kernel */
  int32_t world;                    /* in [1, 8] */
  int32_t outputs;                  /* in [1, FO_MOE_POISON_SLOTS] */
  void* out[FO_MOE_POISON_SLOTS];
  int64_t numel[FO_MOE_POISON_SLOTS];
  int32_t elem_bytes[FO_MOE_POISON_SLOTS];  /* 2, 4 or 8 */
  uint64_t nan_bits[FO_MOE_POISON_SLOTS];
  void* stream;
} fo_moe_poison_args;
FO_API int fo_moe_poison(const fo_moe_poison_args* args);

/* The MoE dispatch's moves into expert order (routes/moe_fast.py): on `stream`, for each move k < moves and each
 * source row r < rows, dst[k] row inv[r] = src[k] row r (row_bytes[k] bytes, moved as word_bytes[k]-byte words: 16,
 * 8, 4 or 2, dividing the row, the strides and both base addresses); rows whose inv is outside [0, dst_rows) are not
 * moved. Strides in bytes. */
#define FO_MOE_MOVE_SLOTS 4
typedef struct {
  const int64_t* inv;
  int64_t rows, dst_rows;
  int32_t moves;                    /* in [1, FO_MOE_MOVE_SLOTS] */
  int32_t reserved;
  const void* src[FO_MOE_MOVE_SLOTS];
  void* dst[FO_MOE_MOVE_SLOTS];
  int64_t row_bytes[FO_MOE_MOVE_SLOTS];
  int64_t src_stride[FO_MOE_MOVE_SLOTS];
  int64_t dst_stride[FO_MOE_MOVE_SLOTS];
  int32_t word_bytes[FO_MOE_MOVE_SLOTS];
  void* stream;
} fo_moe_move_args;
FO_API int fo_moe_move_rows(const fo_moe_move_args* args);

/* The experts' grouped GEMM with device offsets (csrc/grouped_gemm.cu): on `stream`, for each expert e in [first,
 * last), D rows [s_e, t_e) = A rows [s_e, t_e) @ W_e^T, W_e = w + e * w_stride ([n, k]: k contiguous, or with
 * b_layout 1 n contiguous, i.e. a [k, n] matrix), s_e / t_e the
 * running maxima of 0 and offs[0 .. e-1] / offs[0 .. e] (offs[e-1] / offs[e] for good offsets), both at most rows.
 * With `range` (two int32 on the device, read by the kernels) only the experts of [first, last) within [range[0],
 * range[1]) get rows: a piece whose expert bounds the device computed. bf16 in and out, fp32 accumulation; other
 * rows of D are not written. n, k, lda, ldd, w_stride multiples of 8; a, w, d 16-byte aligned; `workspace` (128-byte
 * aligned) of at least fo_grouped_gemm_workspace's bytes for the same arguments, not shared by calls in flight. */
typedef struct {
  const void* a;                    /* [rows, lda] bf16 */
  const void* w;                    /* experts x [n, k] (b_layout 0) or [k, n] (1) bf16, w_stride apart */
  void* d;                          /* [rows, ldd] bf16 */
  const void* offs;                 /* experts int32 / int64 cumulative row offsets (offs_bytes 4 / 8) */
  const int32_t* range;             /* null, or on the device [lo, hi): experts outside it get no rows */
  int64_t rows, n, k, lda, ldd, w_stride;
  int32_t experts, first, last, offs_bytes;
  void* workspace;
  int64_t workspace_bytes;
  int32_t device;
  int32_t b_layout;                 /* 0: w holds [n, k] per expert (k contiguous); 1: [k, n] (n contiguous) */
  void* stream;
} fo_grouped_gemm_args;
FO_API int fo_grouped_gemm_workspace(const fo_grouped_gemm_args* args, int64_t* bytes);
FO_API int fo_grouped_gemm(const fo_grouped_gemm_args* args);

/* The MoE dispatch cut by expert after its transfers were issued, in one call (csrc/moe_dispatch_cut.cu; Python:
 * routes/moe_cut_lib.py, routes/moe_expert_cut.py), on `stream`: fo_moe_plan (plan.pieces == pieces > 0, plan.bounds
 * given: the expert pieces' bounds), the own block's units moved into p, then per piece q: for each peer block j of
 * order[0 .. plan.blocks - 2] the stream waits for landed[u] (u = j * pieces + q; a cudaEvent_t, null: nothing to
 * wait for) and unit u moves into p; then each term t's grouped GEMM over p's rows of the piece's experts
 * (gemm[t] with range = plan.bounds + q, first 0, last experts) into gemm[t].d. Unit u's buffer rows are
 * [recv_off[u], recv_off[u + 1]) (plan.inv of them: their rows of p); its rows lie in recv at recv_off[u] (peers)
 * or in x at x_off[q] (the own block j == rank: its chunks one after another, moved in one launch). A move is p row
 * inv[r] = the unit's row r (row_bytes each, the widest of 16 / 8 / 4 / 2-byte words dividing the row, the strides
 * and the addresses). Everything is checked before the first launch: a refusal (rc 2) enqueues nothing; a failure
 * after it returns a code >= 100 (a CUDA error's, else 100) with the steps before it enqueued. */
#define FO_MOE_MAX_UNITS (FO_MOE_MAX_BLOCKS * FO_MOE_MAX_PIECES)
#define FO_MOE_MAX_TERMS 4
typedef struct {
  fo_moe_plan_args plan;
  int32_t rank, pieces;             /* rank < plan.blocks; pieces == plan.pieces */
  int32_t terms, reserved;          /* terms in [1, FO_MOE_MAX_TERMS] */
  const void* x;                    /* the own block's rows, x_stride bytes apart */
  const void* recv;                 /* the receive buffer, recv_stride bytes apart */
  void* p;                          /* plan.rows rows, p_stride bytes apart */
  int64_t x_stride, recv_stride, p_stride, row_bytes;
  int64_t x_off[FO_MOE_MAX_PIECES];           /* the own block's unit q starts at x row x_off[q] */
  int64_t recv_off[FO_MOE_MAX_UNITS + 1];     /* units' buffer rows, blocks * pieces + 1 entries */
  void* landed[FO_MOE_MAX_UNITS];             /* cudaEvent_t per unit, or null */
  int32_t order[FO_MOE_MAX_BLOCKS];           /* the peer blocks in the order their units are moved */
  fo_grouped_gemm_args gemm[FO_MOE_MAX_TERMS];  /* a == p; range, first, last and stream are set here */
  void* stream;
} fo_moe_dispatch_args;
FO_API int fo_moe_dispatch_cut(const fo_moe_dispatch_args* args);

/* The MoE combine's whole-block compute in one call (csrc/moe_combine_blocks.cu; Python: routes/moe_combine_lib.py,
 * routes/moe_fast.py), on `stream`: fo_moe_plan (plan.pieces 0), then per block j of order[0 .. plan.blocks - 1]
 * (every block once): for each term t the block's expert rows gathered from a[t] (row r = a[t] row plan.inv[s_j + r],
 * s_j the block's first buffer row, 0 for block 0, else plan.ends[j - 1]) into scratch[t], then the term's grouped
 * GEMM (gemm[t] with a = scratch[t], the block's rows, offs = the plan's table row j) into out[j] (t == 0) or into
 * sum and then added into out[j] (t > 0: each term rounded to bf16, then summed in fp32 and rounded, as torch adds
 * bf16 tensors); then ready[j] (a cudaEvent_t, or null) is recorded. out[j]: the block's rows, out_stride bytes
 * apart. Checked before the first launch (a refusal, rc 2, enqueues nothing); a failure after it returns a code >= 100
 * (a CUDA error's, else 100), the steps before it enqueued. */
typedef struct {
  fo_moe_plan_args plan;
  int32_t terms, reserved;          /* terms in [1, FO_MOE_MAX_TERMS] */
  const void* a[FO_MOE_MAX_TERMS];  /* plan.rows rows each (the experts' rows in expert order), a_stride[t] bytes apart */
  int64_t a_stride[FO_MOE_MAX_TERMS];
  void* scratch[FO_MOE_MAX_TERMS];  /* the largest block's rows of gemm[t].k bf16, contiguous */
  void* sum;                        /* terms > 1: the largest block's rows of gemm[0].n bf16, contiguous */
  void* out[FO_MOE_MAX_BLOCKS];     /* block j's gemm[0].n-wide bf16 rows */
  int64_t out_stride;
  void* ready[FO_MOE_MAX_BLOCKS];   /* cudaEvent_t per block, or null */
  int32_t order[FO_MOE_MAX_BLOCKS];  /* each block once */
  fo_grouped_gemm_args gemm[FO_MOE_MAX_TERMS];  /* w, n, k, experts, b_layout, workspace, device; the rest set here */
  void* stream;
} fo_moe_combine_args;
FO_API int fo_moe_combine_blocks(const fo_moe_combine_args* args);

#ifdef __cplusplus
}
#endif

#endif /* FLASHOVERLAP_SM90_H */
