// shardq's attention of one query position over a float32 KV cache (batch-1 decoding), as an
// XLA FFI custom call on the CPU.
//
// The arithmetic of model/cached_attention.py, one call per layer: the cache is read in blocks
// of kBlock positions in order, each with an online softmax (a running max, denominator and
// weighted sum), so the result does not depend on the cache's length. A position the query
// cannot see has weight exp(-inf) = 0 there; here it is skipped, as is every block that holds
// none the query sees, which adds the same zeros. XLA runs the same step as a dozen small
// operations per layer, each with its own cost beyond its few bytes.
//
// q float32 [B * K, G, H] (already scaled by 1 / sqrt(H)); keys float32 [B * K, H, S] and values
// float32 [B * K, S, H] (model/kv_cache.py's layouts); position int32 [B] (the query's: it sees
// keys at positions <= it); window int32 [1] (it also stops seeing positions before
// position - window + 1; a window of S or more hides nothing). Result float32 [B * K, G, H].
// The int8 entry reads quant/kv_cache.py's int8 cache: keys and values int8 in those layouts,
// with one float32 scale per position and kv head, key scales [B * K, 1, S] and value scales
// [B * K, S, 1]; each key is dequantised as it is read, as that cache's blocks are, and each
// value's scale is folded into its softmax weight.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "share_out.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 256;  // model/cached_attention.py's CACHE_BLOCK

#if defined(__AVX512F__)
// exp of 16 lanes (Cephes' expf polynomial, exact scaling by 2^n): within a few float32 ulps of
// std::exp; a lane at or below -88 gives 0, as exp's underflow does.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-88.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(~under, _mm512_scalef_ps(y, n));
}
#endif

// One stored key or value element as float32, and (AVX-512) sixteen consecutive ones.
inline float element(const float* p, int64_t i) { return p[i]; }
inline float element(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
#endif

// p[c] = exp(s[c] - shift) for c < n; returns their sum.
float exp_and_sum(float* s, int64_t n, float shift) {
  int64_t c = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; c < n; c += 16) {
    const __mmask16 live = n - c >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + c), sh));
    _mm512_mask_storeu_ps(s + c, live, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(live, e));
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; c < n; ++c) {
    s[c] = std::exp(s[c] - shift);
    sum += s[c];
  }
  return sum;
}

// One kv head's rows: g query heads over positions [first, last] (inclusive) of the cache. T is
// the stored element (float or int8); an int8 cache has a scale per position for its keys
// (k_scale) and its values (v_scale), null for a float one.
template <typename T>
void attend(const float* q, const T* keys, const T* values, const float* k_scale,
            const float* v_scale, int64_t g_heads, int64_t h, int64_t s_len, int64_t first,
            int64_t last, float* out) {
  std::vector<float> m(g_heads, -INFINITY), denom(g_heads, 0.0f), acc(g_heads * h, 0.0f);
  std::vector<float> s(g_heads * kBlock);
  for (int64_t start = first / kBlock * kBlock; start <= last; start += kBlock) {
    const int64_t c0 = std::max(first, start), c1 = std::min(last + 1, start + kBlock);
    const int64_t n = c1 - c0;
    // Scores s[g, c] = q[g] . keys[:, c], over the block's visible positions: the keys read
    // row by row (each head dim's positions are contiguous), every query head's sums at once.
    std::fill(s.begin(), s.end(), 0.0f);
    const float* ks = k_scale != nullptr ? k_scale + c0 : nullptr;
    for (int64_t d = 0; d < h; ++d) {
      const T* kd = keys + d * s_len + c0;
      int64_t c = 0;
#if defined(__AVX512F__)
      for (; c + 16 <= n; c += 16) {
        __m512 kv = load16(kd + c);
        if (ks != nullptr) kv = _mm512_mul_ps(kv, _mm512_loadu_ps(ks + c));
        for (int64_t g = 0; g < g_heads; ++g) {
          float* sg = s.data() + g * kBlock + c;
          _mm512_storeu_ps(sg, _mm512_fmadd_ps(_mm512_set1_ps(q[g * h + d]), kv,
                                               _mm512_loadu_ps(sg)));
        }
      }
#endif
      for (; c < n; ++c) {
        const float kc = ks != nullptr ? element(kd, c) * ks[c] : element(kd, c);
        for (int64_t g = 0; g < g_heads; ++g) {
          float& sg = s[g * kBlock + c];
          sg = std::fma(q[g * h + d], kc, sg);
        }
      }
    }
    for (int64_t g = 0; g < g_heads; ++g) {
      float* sg = s.data() + g * kBlock;
      float block_max = -INFINITY;
      for (int64_t c = 0; c < n; ++c) block_max = std::max(block_max, sg[c]);
      const float m_new = std::max(m[g], block_max);
      const float sum = exp_and_sum(sg, n, m_new);
      const float rescale = std::exp(m[g] - m_new);
      if (v_scale != nullptr) {  // each value's scale, folded into its weight
        for (int64_t c = 0; c < n; ++c) sg[c] *= v_scale[c0 + c];
      }
      denom[g] = denom[g] * rescale + sum;
      float* ag = acc.data() + g * h;
      for (int64_t d = 0; d < h; ++d) ag[d] *= rescale;
      // ag += sum over c of p[c] * values[c, :]
      int64_t d = 0;
#if defined(__AVX512F__)
      for (; d + 64 <= h; d += 64) {  // four registers of the head dim, summed over positions
        __m512 a0 = _mm512_loadu_ps(ag + d), a1 = _mm512_loadu_ps(ag + d + 16);
        __m512 a2 = _mm512_loadu_ps(ag + d + 32), a3 = _mm512_loadu_ps(ag + d + 48);
        for (int64_t c = 0; c < n; ++c) {
          const __m512 p = _mm512_set1_ps(sg[c]);
          const T* vc = values + (c0 + c) * h + d;
          a0 = _mm512_fmadd_ps(p, load16(vc), a0);
          a1 = _mm512_fmadd_ps(p, load16(vc + 16), a1);
          a2 = _mm512_fmadd_ps(p, load16(vc + 32), a2);
          a3 = _mm512_fmadd_ps(p, load16(vc + 48), a3);
        }
        _mm512_storeu_ps(ag + d, a0);
        _mm512_storeu_ps(ag + d + 16, a1);
        _mm512_storeu_ps(ag + d + 32, a2);
        _mm512_storeu_ps(ag + d + 48, a3);
      }
#endif
      for (; d < h; ++d) {
        float a = ag[d];
        for (int64_t c = 0; c < n; ++c) {
          a = std::fma(sg[c], element(values, (c0 + c) * h + d), a);
        }
        ag[d] = a;
      }
      m[g] = m_new;
    }
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    for (int64_t d = 0; d < h; ++d) out[g * h + d] = acc[g * h + d] / denom[g];
  }
}

// Checks the shapes, then one kv head's rows per chunk, shared out over XLA's threads. Key
// scales [B * K, 1, S] and value scales [B * K, S, 1] come with an int8 cache (else null).
template <typename T>
ffi::Error attention(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& q,
                     ffi::Span<const int64_t> kd, const T* keys, ffi::Span<const int64_t> vd,
                     const T* values, const float* k_scale, const float* v_scale,
                     const ffi::Buffer<ffi::S32>& position, const ffi::Buffer<ffi::S32>& window,
                     float* out) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || kd[0] != qd[0] ||
      vd[0] != qd[0] || kd[1] != qd[2] || vd[2] != qd[2] || vd[1] != kd[2] ||
      window.element_count() != 1 || position.element_count() < 1 ||
      qd[0] % static_cast<int64_t>(position.element_count()) != 0) {
    return ffi::Error::InvalidArgument(
        "shardq attention: q [B*K, G, H], keys [B*K, H, S], values [B*K, S, H], position [B], "
        "window [1] expected");
  }
  const int64_t rows = qd[0], g_heads = qd[1], h = qd[2], s_len = kd[2];
  const int64_t per_batch = rows / static_cast<int64_t>(position.element_count());
  const int64_t win = window.typed_data()[0];
  shardq::share_out(pool, rows, rows > 1, [&](int64_t r) {
    const int64_t pos = std::min<int64_t>(position.typed_data()[r / per_batch], s_len - 1);
    const int64_t first = std::max<int64_t>(0, pos - win + 1);
    const float* qr = q.typed_data() + r * g_heads * h;
    float* o = out + r * g_heads * h;
    if (pos < 0 || first > pos) {  // no position seen: 0 / 0, as XLA's softmax gives
      std::fill(o, o + g_heads * h, NAN);
      return;
    }
    attend(qr, keys + r * h * s_len, values + r * s_len * h,
           k_scale != nullptr ? k_scale + r * s_len : nullptr,
           v_scale != nullptr ? v_scale + r * s_len : nullptr, g_heads, h, s_len, first, pos, o);
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                           ffi::Buffer<ffi::S32> position, ffi::Buffer<ffi::S32> window,
                           ffi::ResultBuffer<ffi::F32> out) {
  return attention<float>(pool, q, keys.dimensions(), keys.typed_data(), values.dimensions(),
                          values.typed_data(), nullptr, nullptr, position, window,
                          out->typed_data());
}

ffi::Error DecodeAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::S8> keys, ffi::Buffer<ffi::S8> values,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> position, ffi::Buffer<ffi::S32> window,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto kd = keys.dimensions();
  if (kd.size() != 3 || k_scale.element_count() != kd[0] * kd[2] ||
      v_scale.element_count() != kd[0] * kd[2]) {
    return ffi::Error::InvalidArgument(
        "shardq attention: key scales [B*K, 1, S] and value scales [B*K, S, 1] expected");
  }
  return attention<int8_t>(pool, q, kd, keys.typed_data(), values.dimensions(),
                           values.typed_data(), k_scale.typed_data(), v_scale.typed_data(),
                           position, window, out->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqDecodeAttentionInt8, DecodeAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
