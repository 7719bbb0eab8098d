// Per-tile completion signal for CUTLASS 3.x sm90 TMA epilogues: an EVT root node (ours).
//
// The node passes its child's result through unchanged. Once an output tile's TMA stores are complete and visible
// at GPU scope, one thread adds 1 to the counter of the tile's group:
//
//     counters[group_of_tile_row ? group_of_tile_row[m] : m] += 1        (m = the tile's tile-row index)
//
// Ordering, executed by the warp that issued the tile's TMA stores (warp 0 of the epilogue warpgroup; bulk
// async-groups belong to the issuing threads):
//     cp.async.bulk.wait_group 0        full completion of the bulk stores (NOT the ".read" form, which only
//                                       says the shared-memory source was read)
//     fence.proxy.async.global          async-proxy writes -> generic proxy
//     __syncwarp                        every lane's groups are done before lane 0 signals
//     red.release.gpu.global.add.s32    lane 0: release at GPU scope, then the add
// All threads' shared-memory writes of the tile were ordered before the TMA stores by the epilogue's own
// fence + named barrier, so the one issuing warp covers the whole tile.
//
// Two modes (runtime, Params::mode):
//   kImmediate: wait and signal in end(), right after the tile's last store is issued. Simple, but the issuing
//               warp stalls for the store drain before the next tile's MMAs.
//   kDeferred:  remember the counter; signal it at the start of this thread's NEXT tile epilogue (by then the
//               stores, issued a whole mainloop earlier, are long complete, so the wait costs nothing), and
//               flush the last one when the epilogue object is destroyed at the end of the kernel.
// Tiles outside the problem (cluster / swizzle padding of the persistent scheduler) never signal, so a group's
// counter grows by exactly (tile-rows in the group) x ceil(N / tile_n) per GEMM.
#pragma once

#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "device_wait.hpp"

namespace flashoverlap {

enum SignalMode : int { kImmediate = 0, kDeferred = 1 };

// Make this warp's completed TMA stores visible at GPU scope, then add 1 to *counter (lane 0).
// Must be called by all 32 lanes of the TMA-issuing warp.
CUTLASS_DEVICE void signal_tile_done(int* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
  }
#endif
}

// Peer gate (the peer and ring routes' GEMMs that add a peer's partial, csrc/peer_call.cu, ring_call.cu): before
// the epilogue's producer warp loads a tile's C (the peer's partial sums), lane 0 waits until *flag >= *target
// (system-scope acquire; the peer adds to the flag after its GEMM 1), until the call's deadline in the route's fault
// block (`fault`, the fo_fault that gate_error_record points to; now + timeout_ns when null). A timeout is recorded
// there and in the peers' blocks, and the load goes on: the route's last kernel then poisons the output (NaN), so
// the wrong sum never leaves the call. The wait is satisfied long before the first epilogue in practice, so GEMM 2
// starts right after GEMM 1 without a stream-level barrier in between.
CUTLASS_DEVICE void peer_gate(int const* flag, int const* target_ptr, long long timeout_ns, fo_fault* fault, int tag) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if ((threadIdx.x & 31) == 0) {
    bounded_wait(flag, *reinterpret_cast<int const volatile*>(target_ptr), wait_deadline(fault, timeout_ns), fault,
                 nullptr, tag);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the acquire, then the TMA (async-proxy) load of C
  }
  __syncwarp();
#endif
}

struct Sm90TileSignal {
  struct SharedStorage {};
  struct Arguments {
    int* counters = nullptr;                 // nullptr: no signals at all
    int const* group_of_tile_row = nullptr;  // nullptr: one counter per tile-row
    int mode = kDeferred;
    int const* gate_flag = nullptr;          // peer gate (see peer_gate); nullptr: none
    int const* gate_target = nullptr;
    long long gate_timeout_ns = 0;
    int* gate_error_record = nullptr;       // the route's fo_fault block (device_wait.hpp)
    int gate_tag = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.mode == kImmediate || args.mode == kDeferred;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90TileSignal() {}
  CUTLASS_HOST_DEVICE Sm90TileSignal(Params const& p, SharedStorage const&) : params(p) {}
  // The node lives in the kernel's epilogue object for the whole persistent loop (one copy per thread), so the
  // deferred counter survives from one tile to the next; the last one is flushed here, at kernel end.
  CUTLASS_HOST_DEVICE ~Sm90TileSignal() {
#if defined(__CUDA_ARCH__)
    if (pending != nullptr) {
      signal_tile_done(pending);
    }
#endif
  }
  CUTLASS_HOST_DEVICE Sm90TileSignal(Sm90TileSignal const& o) : params(o.params), pending(nullptr) {}
  CUTLASS_HOST_DEVICE Sm90TileSignal& operator=(Sm90TileSignal const& o) {
    params = o.params;
    pending = nullptr;
    return *this;
  }

  Params params;
  int* pending = nullptr;  // deferred mode, TMA-issuing warp only: counter of the previous tile, not yet signalled

  CUTLASS_DEVICE bool is_producer_load_needed() const { return params.gate_flag != nullptr; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  struct ProducerLoadCallbacks : cutlass::epilogue::fusion::EmptyProducerLoadCallbacks {
    Params const* p;
    CUTLASS_DEVICE explicit ProducerLoadCallbacks(Params const* params) : p(params) {}
    CUTLASS_DEVICE void begin() {  // per tile, in the epilogue's producer (C load) warp, before its TMA loads
      if (p->gate_flag != nullptr) {
        peer_gate(p->gate_flag, p->gate_target, p->gate_timeout_ns,
                  reinterpret_cast<fo_fault*>(p->gate_error_record), p->gate_tag);
      }
    }
  };

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return ProducerLoadCallbacks(&params);
  }

  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    Sm90TileSignal* node;
    int* counter;  // this tile's counter; nullptr on threads outside the issuing warp or when not signalling
    CUTLASS_DEVICE ConsumerStoreCallbacks(Sm90TileSignal* n, int* c) : node(n), counter(c) {}

    CUTLASS_DEVICE void begin() {
      // Deferred: the previous tile's stores were issued one mainloop ago; complete them and signal.
      if (node->pending != nullptr) {
        signal_tile_done(node->pending);
        node->pending = nullptr;
      }
    }

    template <class ElementAcc, class ElementIn, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementIn, FragmentSize> visit(cutlass::Array<ElementAcc, FragmentSize> const&, int,
                                                                 int, int,
                                                                 cutlass::Array<ElementIn, FragmentSize> const& x) {
      return x;
    }

    CUTLASS_DEVICE void end() {
      if (counter == nullptr) {
        return;
      }
      if (node->params.mode == kImmediate) {
        signal_tile_done(counter);
      } else {
        node->pending = counter;
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    int* counter = nullptr;
    if (params.counters != nullptr && args.thread_idx < 32) {  // the TMA-issuing warp
      auto [M, N, K, L] = args.problem_shape_mnkl;
      auto [m, n, k, l] = args.tile_coord_mnkl;
      int const tile_m = int(cute::size<0>(args.tile_shape_mnk));
      int const tile_n = int(cute::size<1>(args.tile_shape_mnk));
      int const mi = int(m);
      if (mi * tile_m < int(M) && int(n) * tile_n < int(N)) {
        int const g = params.group_of_tile_row != nullptr ? __ldg(params.group_of_tile_row + mi) : mi;
        counter = params.counters + g;
      }
    }
    return ConsumerStoreCallbacks(this, counter);
  }
};

}  // namespace flashoverlap
