// shardq's log-sum-exp of each row of logits, as an XLA FFI custom call on the CPU.
//
//   y[r] = log(sum over j of exp(x[r, j]))
//
// x is float32 [R, V] (every leading dimension counts as a row); y float32 [R]. The arithmetic
// is jax.nn.logsumexp's: the row's max m (0 where it is not finite), then m + log(sum of
// exp(x - m)); a row holding a NaN gives NaN.
//
// Why it exists: scoring a window normalises every position's logits over the whole
// vocabulary, tens of thousands of exponentials per position, and XLA:CPU's exp runs far
// below what sixteen-lane arithmetic does. Rows are shared out over XLA's intra-op threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "exp16.h"
#include "share_out.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerChunk = 8;

// The row's largest value, or NaN where it holds one.
float row_max(const float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 lane = _mm512_set1_ps(m);
  __mmask16 nan = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lane = _mm512_max_ps(lane, v);
  }
  if (nan != 0) return std::numeric_limits<float>::quiet_NaN();
  m = _mm512_reduce_max_ps(lane);
#endif
  for (; j < n; ++j) {
    if (std::isnan(row[j])) return std::numeric_limits<float>::quiet_NaN();
    m = std::max(m, row[j]);
  }
  return m;
}

// sum over j of exp(row[j] - shift).
float sum_exp(const float* row, int64_t n, float shift) {
  int64_t j = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (; j + 64 <= n; j += 64) {
    for (int a = 0; a < 4; ++a) {
      acc[a] = _mm512_add_ps(
          acc[a], shardq::exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j + 16 * a), sh)));
    }
  }
  for (; j + 16 <= n; j += 16) {
    acc[0] = _mm512_add_ps(acc[0], shardq::exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), sh)));
  }
  sum = _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#endif
  for (; j < n; ++j) sum += std::exp(row[j] - shift);
  return sum;
}

float log_sum_exp(const float* row, int64_t n) {
  const float m = row_max(row, n);
  if (std::isnan(m) || m == std::numeric_limits<float>::infinity()) return m;  // NaN; inf
  const float shift = std::isfinite(m) ? m : 0.0f;  // as jax.nn.logsumexp's
  return std::log(sum_exp(row, n, shift)) + shift;
}

ffi::Error LogSumExp(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto dims = x.dimensions();
  if (dims.size() == 0 || dims.back() == 0) {
    return ffi::Error::InvalidArgument("shardq log-sum-exp: x [..., V] with V > 0 expected");
  }
  const int64_t n = dims.back();
  const int64_t rows = static_cast<int64_t>(x.element_count()) / n;
  const float* data = x.typed_data();
  float* out = y->typed_data();
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  shardq::share_out(pool, chunks, chunks > 1, [&](int64_t c) {
    for (int64_t r = c * kRowsPerChunk; r < std::min(rows, (c + 1) * kRowsPerChunk); ++r) {
      out[r] = log_sum_exp(data + r * n, n);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqLogSumExp, LogSumExp,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
