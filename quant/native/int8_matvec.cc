// shardq's int8 product for a few rows (batch-1 decoding), as an XLA FFI custom call on the CPU.
//
//   y[m, n] = float(sum_k q(x)[m, k] * w[n, k]) * (s_x[m] * w_scale[n])
//
// x is float32 [M, K]; each row is quantised here with its own absmax scale, exactly as
// quant/quantizers.py does it (s = absmax * float32(1 / 127), 1 for a zero or subnormal s,
// q = clip(round(x * (1 / s)), -127, 127), a NaN to 0), so the result is the one XLA's program
// computes, bit for bit.
// w is int8 [N, K] (QuantDense's [out, in] layout: every output's weights contiguous) and
// w_scale float32 [N] (or [1]: one scale for the tensor). The weight-only entry also takes
// [N, B]: one scale per block of K / B weights of a row (an int8 embedding table's, GGUF Q8_0's),
// and its scales may be float16 (as Q8_0 stores them), widened here exactly.
//
// Why it exists: XLA:CPU runs a one-row int8 product as a conversion of the whole kernel to int32
// (or, padded to four rows, as a GEMM built for many rows), reading the weights far slower than
// the memory delivers them. Here each weight byte is loaded once and multiplied in integers at
// the widest the CPU has (AVX512-VNNI or AVX-VNNI dot products, else AVX2 multiply-adds, else
// plain C++), one output's weights at a time, the outputs split into chunks that XLA's own
// intra-op threads claim one at a time.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "share_out.h"  // model/native/
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kQMax = 127.0f;
constexpr float kInvQMax = 1.0f / 127.0f;  // quantizers.INV_QMAX: scales are absmax times it

// How far ahead of the weights being multiplied their loads are requested: one core's hardware
// prefetcher alone leaves the memory bus well below what it delivers to a steady stream.
constexpr int64_t kPrefetchBytes = 4096;

// Rows of activations, quantised: their int8 values and their scales.
struct QuantRows {
  int64_t rows = 0, k = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
};

void quantize_rows(const float* x, int64_t rows, int64_t k, QuantRows& out) {
  out.rows = rows;
  out.k = k;
  out.q.resize(rows * k);
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
    for (int64_t i = 0; i < k; ++i) {
      float v = std::nearbyint(xm[i] * inv);  // round half to even, as jnp.round
      v = std::isnan(v) ? 0.0f : std::min(std::max(v, -kQMax), kQMax);
      qm[i] = static_cast<int8_t>(v);
    }
    out.scale[m] = s;
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SHARDQ_INT8_ZMM 1
// acc += sum over 64 lanes of x * w, as the unsigned-by-signed byte product: |w| (any int8,
// -128 included, fits a u8) times x with w's sign (x lies in [-127, 127], so its negation does
// too). Nothing saturates: four products are at most 4 * 128 * 127 < 2^31.
inline __m512i dot64(__m512i acc, __m512i x, __m512i w) {
  const __m512i zero = _mm512_setzero_si512();
  const __mmask64 negative = _mm512_movepi8_mask(w);
  return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, negative, zero, x));
}

// sum over i < k of xq[i] * w[i]: 256 bytes a step in four independent accumulators, the rest
// 64 bytes at a time, the last partial vector loaded under a mask (its missing lanes zero).
// `fetch`: request the row's bytes kPrefetchBytes ahead as it goes.
inline int32_t dot_row(const int8_t* xq, const int8_t* w, int64_t k, bool fetch) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 256 <= k; i += 256) {
    if (fetch) {
      for (int q = 0; q < 4; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + i + 64 * q),
                     _MM_HINT_T0);
      }
    }
    a0 = dot64(a0, _mm512_loadu_si512(xq + i), _mm512_loadu_si512(w + i));
    a1 = dot64(a1, _mm512_loadu_si512(xq + i + 64), _mm512_loadu_si512(w + i + 64));
    a2 = dot64(a2, _mm512_loadu_si512(xq + i + 128), _mm512_loadu_si512(w + i + 128));
    a3 = dot64(a3, _mm512_loadu_si512(xq + i + 192), _mm512_loadu_si512(w + i + 192));
  }
  for (; i < k; i += 64) {
    if (fetch) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + i), _MM_HINT_T0);
    const __mmask64 m = k - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (k - i)) - 1;
    a0 = dot64(a0, _mm512_maskz_loadu_epi8(m, xq + i), _mm512_maskz_loadu_epi8(m, w + i));
  }
  return _mm512_reduce_add_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}
#elif defined(__AVX2__)
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// acc += sum over 32 lanes of x * w, as dot64 above does it on 64.
inline __m256i dot32(__m256i acc, __m256i xq, __m256i w) {
  const __m256i mag = _mm256_abs_epi8(w);
  const __m256i sx = _mm256_sign_epi8(xq, w);
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, mag, sx);
#else
  const __m256i pairs = _mm256_maddubs_epi16(mag, sx);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
#endif

int32_t dot_tail(const int8_t* xq, const int8_t* w, int64_t from, int64_t k) {
  int32_t s = 0;
  for (int64_t i = from; i < k; ++i) s += int32_t(xq[i]) * int32_t(w[i]);
  return s;
}

#if !defined(SHARDQ_INT8_ZMM)
// dot_row on 32-byte vectors (128 bytes a step in four accumulators), the rest in plain C++.
inline int32_t dot_row(const int8_t* xq, const int8_t* w, int64_t k, bool fetch) {
#if defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  auto at = [](const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
    if (fetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + i + 64), _MM_HINT_T0);
    }
    a0 = dot32(a0, at(xq + i), at(w + i));
    a1 = dot32(a1, at(xq + i + 32), at(w + i + 32));
    a2 = dot32(a2, at(xq + i + 64), at(w + i + 64));
    a3 = dot32(a3, at(xq + i + 96), at(w + i + 96));
  }
  for (; i + 32 <= k; i += 32) a0 = dot32(a0, at(xq + i), at(w + i));
  return hsum(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3))) +
         dot_tail(xq, w, i, k);
#else
  (void)fetch;
  return dot_tail(xq, w, 0, k);
#endif
}
#endif

// Outputs [n0, n1) of every row: acc[m * n_total + n]. One output's weights at a time, front to
// back: each thread then reads one stream of consecutive bytes, which the hardware prefetcher
// follows best; the row stays in L1 while further activation rows (m > 0) reuse it.
void product_rows(const QuantRows& xr, const int8_t* w, int64_t n0, int64_t n1, int64_t n_total,
                  int32_t* acc) {
  const int64_t k = xr.k;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < xr.rows; ++m) {
      acc[m * n_total + n] = dot_row(xr.q.data() + m * k, w + n * k, k, m == 0);
    }
  }
}

// float16 bits -> float32, exactly (every float16 is a float32).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(float(man), -24);  // zero or subnormal
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(float(man | 0x400), int(exp) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &mag, 4);
  bits |= sign;
  std::memcpy(&mag, &bits, 4);
  return mag;
#endif
}

// Weight-only (w8): float rows times the int8 kernel, each weight converted to float32 in
// registers (exactly: every int8 is a float32) and multiplied-and-added in float32, each block
// of k / blocks weights of a row summed apart and scaled by its own scale (blocks = 1: one scale
// per row). The scale of output n's block b is ws[(n - n0) * row_stride + b] (row_stride 0: one
// scale for the tensor). The sums run in another order than XLA's dot, so the result matches it
// to float32 rounding, not bit for bit. One output's weights at a time, as product_rows reads
// them.
void float_rows(const float* x, int64_t rows, int64_t k, const int8_t* w, const float* ws,
                int64_t row_stride, int64_t blocks, int64_t n0, int64_t n1, int64_t n_total,
                float* out) {
  const int64_t bk = k / blocks;
  int64_t n = n0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  auto whole = [](const int8_t* p) {  // 16 weights as float32
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  for (; n < n1; ++n) {
    const int8_t* wn = w + n * k;
    const float* sn = ws + (n - n0) * row_stride;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xm = x + m * k;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
      if (bk == 32) {
        // Blocks of 32 (an int8 table's, GGUF Q8_0's): two blocks a step, each summed in two
        // halves and scaled into its own accumulator.
        auto block = [&](int64_t i) {
          return _mm512_fmadd_ps(_mm512_loadu_ps(xm + i + 16), whole(wn + i + 16),
                                 _mm512_mul_ps(_mm512_loadu_ps(xm + i), whole(wn + i)));
        };
        int64_t b = 0;
        for (; b + 2 <= blocks; b += 2) {
          if (m == 0) {
            _mm_prefetch(reinterpret_cast<const char*>(wn + kPrefetchBytes + 32 * b),
                         _MM_HINT_T0);
          }
          acc0 = _mm512_fmadd_ps(block(32 * b), _mm512_set1_ps(sn[b]), acc0);
          acc1 = _mm512_fmadd_ps(block(32 * b + 32), _mm512_set1_ps(sn[b + 1]), acc1);
        }
        if (b < blocks) acc0 = _mm512_fmadd_ps(block(32 * b), _mm512_set1_ps(sn[b]), acc0);
      } else {
        // Any other block: four partial sums (64 weights a step, then 32, 16 and the last
        // under a mask), independent chains of multiply-adds, then the block's scale.
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t i0 = b * bk, i1 = i0 + bk;
          __m512 p0 = _mm512_setzero_ps(), p1 = p0, p2 = p0, p3 = p0;
          int64_t i = i0;
          for (; i + 64 <= i1; i += 64) {
            if (m == 0) {
              _mm_prefetch(reinterpret_cast<const char*>(wn + kPrefetchBytes + i), _MM_HINT_T0);
            }
            p0 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i), whole(wn + i), p0);
            p1 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i + 16), whole(wn + i + 16), p1);
            p2 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i + 32), whole(wn + i + 32), p2);
            p3 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i + 48), whole(wn + i + 48), p3);
          }
          if (i + 32 <= i1) {
            p0 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i), whole(wn + i), p0);
            p1 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i + 16), whole(wn + i + 16), p1);
            i += 32;
          }
          if (i + 16 <= i1) {
            p2 = _mm512_fmadd_ps(_mm512_loadu_ps(xm + i), whole(wn + i), p2);
            i += 16;
          }
          if (i < i1) {  // the missing lanes load as zeros
            const __mmask16 tail = __mmask16((1u << (i1 - i)) - 1);
            const __m512 wt =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, wn + i)));
            p3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, xm + i), wt, p3);
          }
          const __m512 part = _mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3));
          acc0 = _mm512_fmadd_ps(part, _mm512_set1_ps(sn[b]), acc0);
        }
      }
      out[m * n_total + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
  }
#endif
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < rows; ++m) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        float part = 0.0f;
        for (int64_t i = b * bk; i < (b + 1) * bk; ++i) part += x[m * k + i] * float(w[n * k + i]);
        sum += part * ws[(n - n0) * row_stride + b];
      }
      out[m * n_total + n] = sum;
    }
  }
}

// One kernel of a call: its int8 weights [n, k], its scales and where its outputs go.
struct Kernel {
  const int8_t* w;
  const void* scale;  // float32, or (`half`, weight-only entry only) float16 bits
  int64_t n, n_scales;
  void* out;  // int32 sums (per-token entry) or float32 results (weight-only entry)
  bool half = false;

  const float* scales() const { return static_cast<const float*>(scale); }
};

// The operands' sizes: x [rows, k]; a kernel w [n, k] with w_scale [n] or [1] (or, where
// `blocked` (the weight-only entries), [n, blocks]: one scale per block of k / blocks weights of
// a row, float32 or float16).
ffi::Error kernel_of(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S8>& w,
                     const ffi::AnyBuffer& w_scale, void* out, bool blocked, Kernel& kn,
                     int64_t& blocks) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("shardq int8 kernel: x [M, K] and w [N, K] expected");
  }
  const bool half = w_scale.element_type() == ffi::DataType::F16;
  if (w_scale.element_type() != ffi::DataType::F32 && !(blocked && half)) {
    return ffi::Error::InvalidArgument(
        blocked ? "shardq int8 kernel: w_scale must be float32 or float16"
                : "shardq int8 kernel: w_scale must be float32");
  }
  const int64_t k = xd[1], n = wd[0], n_scales = static_cast<int64_t>(w_scale.element_count());
  kn = {w.typed_data(), w_scale.untyped_data(), n, n_scales, out, half};
  blocks = 1;
  if (blocked && n > 0 && n_scales > n && n_scales % n == 0 && k % (n_scales / n) == 0) {
    blocks = n_scales / n;
  } else if (n_scales != n && n_scales != 1) {
    return ffi::Error::InvalidArgument(
        blocked ? "shardq int8 kernel: w_scale must hold N, 1 or N x (a divisor of K) values"
                : "shardq int8 kernel: w_scale must hold N or 1 values");
  }
  return ffi::Error::Success();
}

// x times every kernel with per-token int8 activations: x quantised once for all of them.
ffi::Error int8_products(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                         std::vector<Kernel>& kernels) {
  const int64_t rows = x.dimensions()[0], k = x.dimensions()[1];
  QuantRows xr;
  quantize_rows(x.typed_data(), rows, k, xr);
  std::vector<std::vector<int32_t>> acc(kernels.size());
  std::vector<int64_t> n;
  for (size_t i = 0; i < kernels.size(); ++i) {
    acc[i].resize(rows * kernels[i].n);
    n.push_back(kernels[i].n);
  }
  shardq::for_outputs(pool, n, k, [&](int64_t i, int64_t n0, int64_t n1) {
    product_rows(xr, kernels[i].w, n0, n1, kernels[i].n, acc[i].data());
  });
  for (size_t i = 0; i < kernels.size(); ++i) {
    const Kernel& kn = kernels[i];
    float* out = static_cast<float*>(kn.out);
    for (int64_t m = 0; m < rows; ++m) {
      const float s = xr.scale[m];
      for (int64_t j = 0; j < kn.n; ++j) {
        // the same operations, in the same order, as quant/dense.py's dequantisation
        out[m * kn.n + j] = static_cast<float>(acc[i][m * kn.n + j]) *
                            (s * kn.scales()[kn.n_scales == 1 ? 0 : j]);
      }
    }
  }
  return ffi::Error::Success();
}

// x (float) times every kernel, each weight converted in registers (weight-only).
ffi::Error weight_only_products(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                                std::vector<Kernel>& kernels, const std::vector<int64_t>& blocks) {
  const int64_t rows = x.dimensions()[0], k = x.dimensions()[1];
  std::vector<int64_t> n;
  for (const Kernel& kn : kernels) n.push_back(kn.n);
  shardq::for_outputs(pool, n, k, [&](int64_t i, int64_t n0, int64_t n1) {
    if (n1 <= n0) return;
    const Kernel& kn = kernels[i];
    const int64_t row_stride = kn.n_scales == 1 ? 0 : blocks[i];
    const int64_t first = n0 * row_stride, count = (n1 - n0 - 1) * row_stride + blocks[i];
    const float* ws = kn.scales() + first;
    std::vector<float> widened;  // this chunk's float16 scales, as float32
    if (kn.half) {
      const uint16_t* h = static_cast<const uint16_t*>(kn.scale) + first;
      widened.resize(count);
      for (int64_t j = 0; j < count; ++j) widened[j] = half_to_float(h[j]);
      ws = widened.data();
    }
    float_rows(x.typed_data(), rows, k, kn.w, ws, row_stride, blocks[i], n0, n1, kn.n,
               static_cast<float*>(kn.out));
  });
  return ffi::Error::Success();
}

ffi::Error Int8Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::AnyBuffer w_scale, ffi::ResultBuffer<ffi::F32> y) {
  std::vector<Kernel> kernels(1);
  int64_t blocks;
  if (ffi::Error e = kernel_of(x, w, w_scale, y->typed_data(), false, kernels[0], blocks);
      e.failure()) {
    return e;
  }
  return int8_products(pool, x, kernels);
}

ffi::Error WeightInt8Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S8> w, ffi::AnyBuffer w_scale,
                            ffi::ResultBuffer<ffi::F32> y) {
  std::vector<Kernel> kernels(1);
  std::vector<int64_t> blocks(1);
  if (ffi::Error e = kernel_of(x, w, w_scale, y->typed_data(), true, kernels[0], blocks[0]);
      e.failure()) {
    return e;
  }
  return weight_only_products(pool, x, kernels, blocks);
}

// The grouped entries' operands: x, then (w, w_scale) per kernel; one result per kernel.
ffi::Error kernels_of(const ffi::Buffer<ffi::F32>& x, const ffi::RemainingArgs& args,
                      const ffi::RemainingRets& rets, bool blocked, std::vector<Kernel>& kernels,
                      std::vector<int64_t>& blocks) {
  if (args.size() == 0 || args.size() % 2 || rets.size() != args.size() / 2) {
    return ffi::Error::InvalidArgument(
        "shardq int8 kernel: (w, w_scale) pairs and one result per pair expected");
  }
  kernels.resize(rets.size());
  blocks.resize(rets.size());
  for (size_t i = 0; i < rets.size(); ++i) {
    auto w = args.get<ffi::Buffer<ffi::S8>>(2 * i);
    auto s = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (s.has_error()) return s.error();
    if (y.has_error()) return y.error();
    if (ffi::Error e = kernel_of(x, *w, *s, (*y)->typed_data(), blocked, kernels[i], blocks[i]);
        e.failure()) {
      return e;
    }
  }
  return ffi::Error::Success();
}

ffi::Error Int8MatvecGroup(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                           ffi::RemainingRets rets) {
  std::vector<Kernel> kernels;
  std::vector<int64_t> blocks;
  if (ffi::Error e = kernels_of(x, args, rets, false, kernels, blocks); e.failure()) return e;
  return int8_products(pool, x, kernels);
}

ffi::Error WeightInt8MatvecGroup(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  std::vector<Kernel> kernels;
  std::vector<int64_t> blocks;
  if (ffi::Error e = kernels_of(x, args, rets, true, kernels, blocks); e.failure()) return e;
  return weight_only_products(pool, x, kernels, blocks);
}

// The single entries' signature: (thread pool; x f32 [M, K], w s8 [N, K], w_scale f32 (or, for
// the weight-only entry, f16)) -> y f32.
auto matvec_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S8>>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

// The grouped entries': (thread pool; x f32 [M, K], then (w, w_scale) per kernel) -> one y each.
auto group_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .RemainingArgs()
      .RemainingRets();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqInt8Matvec, Int8Matvec, matvec_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqWeightInt8Matvec, WeightInt8Matvec, matvec_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqInt8MatvecGroup, Int8MatvecGroup, group_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqWeightInt8MatvecGroup, WeightInt8MatvecGroup,
                              group_binding());

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
