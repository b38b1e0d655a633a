// shardq's greedy pick: the index of each row's largest logit, as an XLA FFI custom call on the
// CPU.
//
//   y[r] = argmax over j of x[r, j]
//
// x is float32 [R, V] (every leading dimension counts as a row); y int32 [R]. The semantics are
// jnp.argmax's: the first index of the largest value, where -0 equals +0; a row holding a NaN
// gives its first NaN's index.
//
// Why it exists: greedy decoding picks one token from the vocabulary-wide logits at every step.
// XLA:CPU runs argmax as a (value, index) reduction one element at a time, which costs a large
// share of an int8 decoding step for a vocabulary of tens of thousands; here sixteen lanes keep
// their own first maximum and the lanes are compared at the end.

#include <climits>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The first index of row's largest value (its first NaN, where it holds one).
int32_t pick(const float* row, int64_t n) {
  float best = row[0];
  int64_t at = 0;
  int64_t j = 0;
  if (std::isnan(best)) return 0;
#if defined(__AVX512F__)
  if (n >= 32) {
    // Each lane keeps the first of its largest values (strictly greater replaces it).
    __m512 lane_best = _mm512_loadu_ps(row);
    __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = lane_at;
    if (_mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q)) {
      for (int64_t i = 0; i < 16; ++i)
        if (std::isnan(row[i])) return static_cast<int32_t>(i);
    }
    for (j = 16; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(row + j);
      idx = _mm512_add_epi32(idx, step);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {
        for (int64_t i = j; i < j + 16; ++i)
          if (std::isnan(row[i])) return static_cast<int32_t>(i);
      }
      const __mmask16 more = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, more, v);
      lane_at = _mm512_mask_mov_epi32(lane_at, more, idx);
    }
    // Across lanes: the largest value, and of the lanes holding it the smallest index.
    alignas(64) float values[16];
    alignas(64) int32_t where[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(where, lane_at);
    best = values[0];
    at = where[0];
    for (int i = 1; i < 16; ++i) {
      if (values[i] > best || (values[i] == best && where[i] < at)) {
        best = values[i];
        at = where[i];
      }
    }
  }
#endif
  for (; j < n; ++j) {  // the tail (or a whole row without AVX-512)
    if (std::isnan(row[j])) return static_cast<int32_t>(j);
    if (row[j] > best) {
      best = row[j];
      at = j;
    }
  }
  return static_cast<int32_t>(at);
}

ffi::Error GreedyPick(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> y) {
  const auto dims = x.dimensions();
  if (dims.size() == 0 || dims.back() == 0) {
    return ffi::Error::InvalidArgument("shardq greedy pick: x [..., V] with V > 0 expected");
  }
  const int64_t n = dims.back();
  if (n > INT32_MAX) {
    return ffi::Error::InvalidArgument("shardq greedy pick: V must fit an int32 index");
  }
  const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
  const float* data = x.typed_data();
  int32_t* out = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) out[r] = pick(data + r * n, n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqGreedyPick, GreedyPick,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
