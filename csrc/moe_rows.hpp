// What the MoE units share (moe_plan.cu's row moves, moe_dispatch_cut.cu, moe_combine_blocks.cu): the word a row moves
// in, a row copied by one warp, a one-call entry's plan and its failure after the first launch. Not part of the C ABI.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flashoverlap_sm90.h"

namespace flashoverlap {

int fail_code(int code, std::string msg);  // api.cu

// The widest of 16, 8, 4 and 2 bytes dividing the row's bytes, both strides and both addresses (0: none).
inline int row_word(int64_t row, int64_t s1, int64_t s2, void const* a, void const* b) {
  for (int w : {16, 8, 4, 2}) {
    if (row % w == 0 && s1 % w == 0 && s2 % w == 0 && reinterpret_cast<uintptr_t>(a) % w == 0 &&
        reinterpret_cast<uintptr_t>(b) % w == 0)
      return w;
  }
  return 0;
}

template <class W>
__device__ __forceinline__ void copy_words(char const* src, char* dst, long long words, int lane) {
  W const* s = reinterpret_cast<W const*>(src);
  W* d = reinterpret_cast<W*>(dst);
  for (long long w = lane; w < words; w += 32) d[w] = s[w];
}

// One row of row_bytes bytes copied by the 32 lanes of a warp (lane: this thread's) in word-byte words (row_word's).
__device__ __forceinline__ void copy_row(char const* src, char* dst, long long row_bytes, int word, int lane) {
  long long const words = row_bytes / word;
  switch (word) {
    case 16: copy_words<uint4>(src, dst, words, lane); break;
    case 8: copy_words<unsigned long long>(src, dst, words, lane); break;
    case 4: copy_words<unsigned int>(src, dst, words, lane); break;
    default: copy_words<unsigned short>(src, dst, words, lane); break;
  }
}

// A step's failure once a one-call entry (`who`) enqueued its first launch: never a refusal (a code below 100 says
// nothing was enqueued), so a step's refusal becomes 100.
inline int after_first_launch(int rc, char const* who) {
  if (rc == 0 || rc >= 100) return rc;
  return fail_code(100, std::string(who) + ": a step failed after the first launch: " + fo_last_error());
}

// The routing plan `plan` launched on `stream` (a one-call entry's first step; the plan's own stream is ignored).
inline int plan_on(fo_moe_plan_args plan, void* stream) {
  plan.stream = stream;
  return fo_moe_plan(&plan);
}

}  // namespace flashoverlap
