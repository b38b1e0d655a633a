// shardq's int8 product for a few rows (batch-1 decoding), as an XLA FFI custom call on the CPU.
//
//   y[m, n] = float(sum_k q(x)[m, k] * w[n, k]) * (s_x[m] * w_scale[n])
//
// x is float32 [M, K]; each row is quantised here with its own absmax scale, exactly as
// quant/quantizers.py does it (s = absmax * float32(1 / 127), 1 for a zero or subnormal s,
// q = clip(round(x * (1 / s)), -127, 127), a NaN to 0), so the result is the one XLA's program
// computes, bit for bit.
// w is int8 [N, K] (QuantDense's [out, in] layout: every output's weights contiguous) and
// w_scale float32 [N] (or [1]: one scale for the tensor).
//
// Why it exists: XLA:CPU runs a one-row int8 product as a conversion of the whole kernel to int32
// (or, padded to four rows, as a GEMM built for many rows), reading the weights far slower than
// the memory delivers them. Here each weight byte is loaded once and multiplied in integers at
// the widest the CPU has (AVX512-VNNI or AVX-VNNI dot products, else AVX2 multiply-adds, else
// plain C++), the outputs split into chunks that XLA's own intra-op threads claim one at a time.

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kQMax = 127.0f;
constexpr float kInvQMax = 1.0f / 127.0f;  // quantizers.INV_QMAX: scales are absmax times it

// Weight bytes one thread takes at a time, and below which a product runs on the calling thread
// alone (waking another thread costs more than reading that much).
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int64_t kParallelBytes = 192 * 1024;
// How far ahead of the weights being multiplied their loads are requested: one core's hardware
// prefetcher alone leaves the memory bus well below what it delivers to a steady stream.
constexpr int64_t kPrefetchBytes = 8192;

// One row of activations, quantised: its int8 values, their magnitudes (the unsigned operand of
// the byte dot products) and its scale.
struct QuantRows {
  int64_t rows = 0, k = 0;
  std::vector<int8_t> q;
  std::vector<uint8_t> mag;
  std::vector<float> scale;
};

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantRows& out) {
  out.rows = rows;
  out.k = k;
  out.q.resize(rows * k);
  out.mag.resize(rows * k);
  out.scale.resize(rows);
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * k;
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < k; ++i) {
      float a = std::fabs(xm[i]);
      nan |= std::isnan(a);
      amax = a > amax ? a : amax;
    }
    float s = nan ? NAN : amax * kInvQMax;
    if (s < FLT_MIN) s = 1.0f;  // false for NaN: a NaN row keeps its NaN scale
    const float inv = 1.0f / s;
    int8_t* qm = out.q.data() + m * k;
    uint8_t* am = out.mag.data() + m * k;
    for (int64_t i = 0; i < k; ++i) {
      float v = std::nearbyint(xm[i] * inv);  // round half to even, as jnp.round
      v = std::isnan(v) ? 0.0f : std::min(std::max(v, -kQMax), kQMax);
      qm[i] = static_cast<int8_t>(v);
      am[i] = static_cast<uint8_t>(v < 0 ? -v : v);
    }
    out.scale[m] = s;
  }
}

#if defined(__AVX2__)
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// acc += sum over 32 lanes of mag * (w with x's sign): the sign moves onto w so that the
// unsigned-by-signed byte product applies (|x| <= 127 and |w| <= 127, so nothing saturates).
inline __m256i dot32(__m256i acc, __m256i mag, __m256i xq, __m256i w) {
  const __m256i sw = _mm256_sign_epi8(w, xq);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, mag, sw);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, mag, sw);
#else
  const __m256i pairs = _mm256_maddubs_epi16(mag, sw);  // |sum of 2| <= 2 * 127 * 127 < 2^15
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
#endif

int32_t dot_tail(const int8_t* xq, const int8_t* w, int64_t from, int64_t k) {
  int32_t s = 0;
  for (int64_t i = from; i < k; ++i) s += int32_t(xq[i]) * int32_t(w[i]);
  return s;
}

// Outputs [n0, n1) of every row: acc[m * n_total + n].
void product_rows(const QuantRows& xr, const int8_t* w, int64_t n0, int64_t n1, int64_t n_total,
                  int32_t* acc) {
  const int64_t k = xr.k;
  int64_t n = n0;
#if defined(__AVX2__)
  const int64_t kv = k - k % 32;
  // Four outputs at a time: four independent weight streams and accumulators per activation row;
  // the four weight rows stay in L1 while further activation rows (m > 0) reuse them.
  for (; n + 4 <= n1; n += 4) {
    const int8_t* w0 = w + n * k;
    for (int64_t m = 0; m < xr.rows; ++m) {
      const int8_t* xq = xr.q.data() + m * k;
      const uint8_t* mg = xr.mag.data() + m * k;
      __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < kv; i += 32) {
        if (m == 0) {  // two lines ahead per step: the quad's 4 * k bytes over k / 32 steps
          _mm_prefetch(reinterpret_cast<const char*>(w0 + kPrefetchBytes + 4 * i), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w0 + kPrefetchBytes + 4 * i + 64),
                       _MM_HINT_T0);
        }
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i));
        const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + i));
        a0 = dot32(a0, g, x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + i)));
        a1 = dot32(a1, g, x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k + i)));
        a2 = dot32(a2, g, x,
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + 2 * k + i)));
        a3 = dot32(a3, g, x,
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + 3 * k + i)));
      }
      int32_t* out = acc + m * n_total + n;
      out[0] = hsum(a0) + dot_tail(xq, w0, kv, k);
      out[1] = hsum(a1) + dot_tail(xq, w0 + k, kv, k);
      out[2] = hsum(a2) + dot_tail(xq, w0 + 2 * k, kv, k);
      out[3] = hsum(a3) + dot_tail(xq, w0 + 3 * k, kv, k);
    }
  }
#endif
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < xr.rows; ++m) {
      acc[m * n_total + n] = dot_tail(xr.q.data() + m * k, w + n * k, 0, k);
    }
  }
}

// A product split into chunks of outputs, claimed one at a time by whichever thread comes: the
// calling one and the helpers it schedules. Held by a shared_ptr, since a helper that starts
// after the work is done still reads it.
struct Job {
  const QuantRows* xr;
  const int8_t* w;
  int64_t n, chunk_rows, chunks;
  int32_t* acc;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    int64_t c;
    while ((c = next.fetch_add(1, std::memory_order_relaxed)) < chunks) {
      const int64_t n0 = c * chunk_rows;
      product_rows(*xr, w, n0, std::min(n, n0 + chunk_rows), n, acc);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> w_scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("shardq_int8_matvec: x [M, K] and w [N, K] expected");
  }
  const int64_t rows = xd[0], k = xd[1], n = wd[0];
  const int64_t n_scales = w_scale.element_count();
  if (n_scales != n && n_scales != 1) {
    return ffi::Error::InvalidArgument("shardq_int8_matvec: w_scale must hold N or 1 values");
  }
  QuantRows xr;
  quantize_rows(x.typed_data(), rows, k, xr);
  std::vector<int32_t> acc(rows * n);

  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || n * k < kParallelBytes) {
    product_rows(xr, w.typed_data(), 0, n, n, acc.data());
  } else {
    auto job = std::make_shared<Job>();
    job->xr = &xr;
    job->w = w.typed_data();
    job->n = n;
    // Whole chunks for every thread (a multiple of the thread count), each a multiple of 4 rows.
    int64_t want = (n * k + kChunkBytes - 1) / kChunkBytes;
    want = (want + threads - 1) / threads * threads;
    const int64_t rows_each = (n + want - 1) / want;
    job->chunk_rows = std::max<int64_t>(4, (rows_each + 3) / 4 * 4);
    job->chunks = (n + job->chunk_rows - 1) / job->chunk_rows;
    job->acc = acc.data();
    const int64_t helpers = std::min(threads - 1, job->chunks - 1);
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->work(); });
    job->work();
    // Every chunk is claimed by now; wait for those other threads are still computing.
    while (job->done.load(std::memory_order_acquire) < job->chunks) {
#if defined(__AVX2__)
      _mm_pause();
#endif
    }
  }

  const float* ws = w_scale.typed_data();
  float* out = y->typed_data();
  for (int64_t m = 0; m < rows; ++m) {
    const float s = xr.scale[m];
    for (int64_t j = 0; j < n; ++j) {
      // the same operations, in the same order, as quant/dense.py's dequantisation
      out[m * n + j] = static_cast<float>(acc[m * n + j]) * (s * ws[n_scales == 1 ? 0 : j]);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqInt8Matvec, Int8Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Which instruction set the build uses, for the benchmark's record.
extern "C" const char* ShardqInt8MatvecIsa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512_vnni";
#elif defined(__AVXVNNI__)
  return "avx_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}
