// fo_moe_dispatch_cut: the MoE dispatch cut by expert after its transfers were issued, as one library call (the ABI
// in flashoverlap_sm90.h; Python: routes/moe_cut_lib.py). It composes this library's own steps on one stream,
//
//   fo_moe_plan (the routing plan and the expert pieces' bounds)
//   the own block's units moved into p (fo_moe_move_rows, one launch)
//   per piece q: per peer block in `order`: a stream wait for the unit's landing event, its move into p;
//                then one fo_grouped_gemm per term over p's rows of the piece's experts (range = bounds + q)
//
// which routes/moe_expert_cut.py ran as ~10 Python steps (~360 us of host time per call at Qwen3-MoE 2048 tokens on
// one H200, forty-fourth session, docs/results.md). Every argument is checked before the first launch (a refusal,
// rc 2, enqueues nothing); any failure after it returns a code >= 100 (a CUDA error's, else 100), the steps before
// it enqueued.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashoverlap_sm90.h"
#include "moe_rows.hpp"
#include "route_util.hpp"

// The ctypes mirror's layout (routes/moe_cut_lib.py; tests/test_moe_cut_lib.py compares every field's offset).
static_assert(sizeof(fo_moe_dispatch_args) == 2456 && offsetof(fo_moe_dispatch_args, stream) == 2448,
              "fo_moe_dispatch_args layout");

namespace flashoverlap {

int moe_plan_check(fo_moe_plan_args const& a);         // moe_plan.cu
int grouped_gemm_check(fo_grouped_gemm_args const& a);  // grouped_gemm.cu

namespace {

// Unit u's rows: x's (the own block's) or the receive buffer's.
char const* unit_rows(fo_moe_dispatch_args const& a, int u, int64_t* stride) {
  int const block = u / a.pieces, q = u % a.pieces;
  if (block == a.rank) {
    *stride = a.x_stride;
    return static_cast<char const*>(a.x) + a.x_off[q] * a.x_stride;
  }
  *stride = a.recv_stride;
  return static_cast<char const*>(a.recv) + a.recv_off[u] * a.recv_stride;
}

int check(fo_moe_dispatch_args const& a) {
  if (int rc = moe_plan_check(a.plan)) return rc;
  int const blocks = a.plan.blocks, units = blocks * a.pieces;
  if (a.pieces < 1 || a.pieces != a.plan.pieces) return fail_code(2, "fo_moe_dispatch_cut: pieces must be plan.pieces, >= 1");
  if (a.rank < 0 || a.rank >= blocks) return fail_code(2, "fo_moe_dispatch_cut: rank out of range");
  if (a.terms < 1 || a.terms > FO_MOE_MAX_TERMS) return fail_code(2, "fo_moe_dispatch_cut: terms out of range");
  bool const own_rows = a.recv_off[(a.rank + 1) * a.pieces] > a.recv_off[a.rank * a.pieces];
  if ((own_rows && !a.x) || !a.p || (blocks > 1 && !a.recv)) return fail_code(2, "fo_moe_dispatch_cut: a null pointer");
  if (a.row_bytes <= 0 || a.x_stride < a.row_bytes || a.p_stride < a.row_bytes ||
      (blocks > 1 && a.recv_stride < a.row_bytes))
    return fail_code(2, "fo_moe_dispatch_cut: the row strides must hold a row");
  if (a.recv_off[0] != 0 || a.recv_off[units] != a.plan.rows)
    return fail_code(2, "fo_moe_dispatch_cut: recv_off must run from 0 to plan.rows");
  for (int u = 0; u < units; ++u) {
    if (a.recv_off[u + 1] < a.recv_off[u]) return fail_code(2, "fo_moe_dispatch_cut: recv_off must not decrease");
    if ((u + 1) % a.pieces == 0 && a.recv_off[u + 1] != a.plan.ends[u / a.pieces])
      return fail_code(2, "fo_moe_dispatch_cut: a block's units must end where plan.ends says");
    if (u / a.pieces == a.rank) {  // the own chunks one after another in x, as in the buffer
      int const q = u % a.pieces;
      if (a.x_off[q] < 0 || (q && a.x_off[q] != a.x_off[q - 1] + a.recv_off[u] - a.recv_off[u - 1]))
        return fail_code(2, "fo_moe_dispatch_cut: the own block's chunks must lie one after another in x");
    }
    int64_t stride = 0;
    char const* src = unit_rows(a, u, &stride);
    if (!row_word(a.row_bytes, stride, a.p_stride, src, a.p))
      return fail_code(2, "fo_moe_dispatch_cut: rows, strides and addresses must be multiples of 2 bytes");
  }
  unsigned seen = 1u << a.rank;
  for (int i = 0; i + 1 < blocks; ++i) {
    int const j = a.order[i];
    if (j < 0 || j >= blocks || (seen >> j) & 1u) return fail_code(2, "fo_moe_dispatch_cut: order must list each peer once");
    seen |= 1u << j;
  }
  for (int t = 0; t < a.terms; ++t) {
    fo_grouped_gemm_args g = a.gemm[t];
    g.a = a.p, g.rows = a.plan.rows, g.first = 0, g.last = g.experts;
    if (g.experts != a.plan.experts || g.lda * 2 != a.p_stride || g.k * 2 != a.row_bytes)
      return fail_code(2, "fo_moe_dispatch_cut: a term's experts, K or row stride differ from the plan's and p's");
    if (int rc = grouped_gemm_check(g)) return rc;
  }
  return 0;
}

// Units u .. last - 1 (consecutive buffer rows whose source rows are consecutive too: one unit, or the own block's)
// moved into p in one launch.
int move_units(fo_moe_dispatch_args const& a, int u, int last, cudaStream_t stream) {
  fo_moe_move_args m{};
  int64_t stride = 0;
  m.src[0] = unit_rows(a, u, &stride);
  m.inv = a.plan.inv + a.recv_off[u];
  m.rows = a.recv_off[last] - a.recv_off[u], m.dst_rows = a.plan.rows, m.moves = 1;
  m.dst[0] = a.p, m.row_bytes[0] = a.row_bytes, m.src_stride[0] = stride, m.dst_stride[0] = a.p_stride;
  m.word_bytes[0] = row_word(a.row_bytes, stride, a.p_stride, m.src[0], a.p);
  m.stream = stream;
  return m.rows ? fo_moe_move_rows(&m) : 0;
}

}  // namespace
}  // namespace flashoverlap

FO_API int fo_moe_dispatch_cut(const fo_moe_dispatch_args* args) {
  if (args == nullptr) return flashoverlap::fail_code(2, "fo_moe_dispatch_cut: null arguments");
  fo_moe_dispatch_args const& a = *args;
  if (int rc = flashoverlap::check(a)) return rc;
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (int rc = flashoverlap::plan_on(a.plan, a.stream)) return rc;
  int const own = a.rank * a.pieces;  // the own block at once (its chunks lie one after another in x)
  if (int rc = flashoverlap::move_units(a, own, own + a.pieces, stream)) return flashoverlap::after_first_launch(rc, "fo_moe_dispatch_cut");
  for (int q = 0; q < a.pieces; ++q) {
    for (int i = 0; i + 1 < a.plan.blocks; ++i) {
      int const u = a.order[i] * a.pieces + q;
      if (a.landed[u] != nullptr) {
        if (cudaError_t e = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(a.landed[u]), 0); e != cudaSuccess)
          return flashoverlap::fail_code(100 + int(e), "fo_moe_dispatch_cut: waiting for a unit's transfer");
      }
      if (int rc = flashoverlap::move_units(a, u, u + 1, stream)) return flashoverlap::after_first_launch(rc, "fo_moe_dispatch_cut");
    }
    for (int t = 0; t < a.terms; ++t) {
      fo_grouped_gemm_args g = a.gemm[t];
      g.a = a.p, g.rows = a.plan.rows, g.first = 0, g.last = g.experts;
      g.range = a.plan.bounds + q, g.stream = a.stream;
      if (int rc = fo_grouped_gemm(&g)) return flashoverlap::after_first_launch(rc, "fo_moe_dispatch_cut");
    }
  }
  return 0;
}
