// shardq's attention of one query position over a float32 KV cache (batch-1 decoding), as an
// XLA FFI custom call on the CPU.
//
// The arithmetic of model/cached_attention.py, one call per layer: the cache is read in blocks
// of kBlock positions, each block's softmax (its max, denominator and weighted sum) computed
// apart, so that a long cache's blocks share XLA's threads, and the blocks are combined in
// order as an online softmax does: the result does not depend on the cache's length or the
// thread count. A position the query cannot see has weight exp(-inf) = 0 there; here it is
// skipped, as is every block that holds none the query sees, which adds the same zeros. XLA
// runs the same step as a dozen small operations per layer, each with its own cost beyond its
// few bytes.
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

#include "exp16.h"
#include "share_out.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 256;  // model/cached_attention.py's CACHE_BLOCK

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
    const __m512 e = shardq::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + c), sh));
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

#if defined(__AVX512F__)
// Scores of GT query heads (q rows, h apart) over positions [c, c + 16 * V) of keys (h rows,
// s_len apart): each sum over the head dim in order, held in registers (every key vector read
// once for the GT heads), then stored at s (rows kBlock apart).
template <int GT, int V, typename T>
inline void scores_tile(const float* q, const T* keys, const float* ks, int64_t h,
                        int64_t s_len, int64_t c, float* s) {
  __m512 acc[GT][V];
  for (int g = 0; g < GT; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < h; ++d) {
    __m512 kv[V];
    for (int v = 0; v < V; ++v) {
      kv[v] = load16(keys + d * s_len + c + 16 * v);
      if (ks != nullptr) kv[v] = _mm512_mul_ps(kv[v], _mm512_loadu_ps(ks + c + 16 * v));
    }
    for (int g = 0; g < GT; ++g) {
      const __m512 qd = _mm512_set1_ps(q[g * h + d]);
      for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(qd, kv[v], acc[g][v]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(s + g * kBlock + c + 16 * v, acc[g][v]);
}

// acc[g, d:d+64] += sum over c < n of p[g, c] * values[c, d:d+64] for GT heads: each value
// vector read once for the GT heads, each sum over the positions in order.
template <int GT, typename T>
inline void values_tile(const float* p, const T* values, int64_t h, int64_t n, int64_t d,
                        float* acc) {
  __m512 a[GT][4];
  for (int g = 0; g < GT; ++g)
    for (int v = 0; v < 4; ++v) a[g][v] = _mm512_loadu_ps(acc + g * h + d + 16 * v);
  for (int64_t c = 0; c < n; ++c) {
    const T* vc = values + c * h + d;
    const __m512 v0 = load16(vc), v1 = load16(vc + 16), v2 = load16(vc + 32),
                 v3 = load16(vc + 48);
    for (int g = 0; g < GT; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * kBlock + c]);
      a[g][0] = _mm512_fmadd_ps(pg, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(pg, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(pg, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(pg, v3, a[g][3]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc + g * h + d + 16 * v, a[g][v]);
}

// The tiles above for `gt` (1 to 4) heads.
template <typename T>
void scores_tiles(int64_t gt, const float* q, const T* keys, const float* ks, int64_t h,
                  int64_t s_len, int64_t c, bool pair, float* s) {
#define SHARDQ_SCORES(G) \
  case G:                \
    return pair ? scores_tile<G, 2>(q, keys, ks, h, s_len, c, s) \
                : scores_tile<G, 1>(q, keys, ks, h, s_len, c, s);
  switch (gt) { SHARDQ_SCORES(1) SHARDQ_SCORES(2) SHARDQ_SCORES(3) SHARDQ_SCORES(4) }
#undef SHARDQ_SCORES
}

template <typename T>
void values_tiles(int64_t gt, const float* p, const T* values, int64_t h, int64_t n, int64_t d,
                  float* acc) {
  switch (gt) {
    case 1: return values_tile<1>(p, values, h, n, d, acc);
    case 2: return values_tile<2>(p, values, h, n, d, acc);
    case 3: return values_tile<3>(p, values, h, n, d, acc);
    case 4: return values_tile<4>(p, values, h, n, d, acc);
  }
}
#endif

// One block of one kv head's rows: g query heads over positions [c0, c1) of the cache, from a
// fresh softmax: its max per head (m), the sum of exp(score - m) (denom) and the weighted sum
// of the values (acc [g, h]). T is the stored element (float or int8); an int8 cache has a scale
// per position for its keys (k_scale) and its values (v_scale), null for a float one. Query
// heads go four at a time, so each key and value is read once per four heads; every sum runs
// in the same order as one head's alone would.
template <typename T>
void block_partial(const float* q, const T* keys, const T* values, const float* k_scale,
                   const float* v_scale, int64_t g_heads, int64_t h, int64_t s_len, int64_t c0,
                   int64_t c1, float* s, float* m, float* denom, float* acc) {
  const int64_t n = c1 - c0;
  // Scores s[g, c] = q[g] . keys[:, c], over the block's visible positions.
  const float* ks = k_scale != nullptr ? k_scale + c0 : nullptr;
  for (int64_t g0 = 0; g0 < g_heads; g0 += 4) {
    const int64_t gt = std::min<int64_t>(4, g_heads - g0);
    float* sg0 = s + g0 * kBlock;
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += c + 32 <= n ? 32 : 16) {
      scores_tiles(gt, q + g0 * h, keys + c0, ks, h, s_len, c, c + 32 <= n, sg0);
    }
#endif
    for (; c < n; ++c) {
      for (int64_t g = 0; g < gt; ++g) {
        float sg = 0.0f;
        for (int64_t d = 0; d < h; ++d) {
          const float kc = element(keys, d * s_len + c0 + c);
          sg = std::fma(q[(g0 + g) * h + d], ks != nullptr ? kc * ks[c] : kc, sg);
        }
        sg0[g * kBlock + c] = sg;
      }
    }
  }
  // Weights p = exp(s - max) in place of s.
  for (int64_t g = 0; g < g_heads; ++g) {
    float* sg = s + g * kBlock;
    float block_max = -INFINITY;
    for (int64_t c = 0; c < n; ++c) block_max = std::max(block_max, sg[c]);
    m[g] = block_max;
    if (block_max == -INFINITY) {  // no score above -inf: weights 0, as exp(-inf) gives
      std::fill(sg, sg + n, 0.0f);
      denom[g] = 0.0f;
      continue;
    }
    denom[g] = exp_and_sum(sg, n, block_max);
    if (v_scale != nullptr) {  // each value's scale, folded into its weight
      for (int64_t c = 0; c < n; ++c) sg[c] *= v_scale[c0 + c];
    }
  }
  // acc[g] = sum over c of p[g, c] * values[c, :]
  std::fill(acc, acc + g_heads * h, 0.0f);
  const T* vb = values + c0 * h;
  for (int64_t g0 = 0; g0 < g_heads; g0 += 4) {
    const int64_t gt = std::min<int64_t>(4, g_heads - g0);
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 64 <= h; d += 64) values_tiles(gt, s + g0 * kBlock, vb, h, n, d, acc + g0 * h);
#endif
    for (; d < h; ++d) {
      for (int64_t g = g0; g < g0 + gt; ++g) {
        float a = 0.0f;
        for (int64_t c = 0; c < n; ++c) a = std::fma(s[g * kBlock + c], element(vb, c * h + d), a);
        acc[g * h + d] = a;
      }
    }
  }
}

// Checks the shapes; then every (kv head's rows, block of positions they see) is one chunk,
// shared out over XLA's threads, each from a fresh softmax; then each row's blocks are combined
// in order (the online softmax's rescaling, applied once per block). A result does not depend
// on the thread count or on the cache's length. Key scales [B * K, 1, S] and value scales
// [B * K, S, 1] come with an int8 cache (else null).
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
  // The chunks: row r's positions [c0, c1), in order within each row.
  std::vector<int64_t> row_of, c0s, c1s, row_first(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    row_first[r] = static_cast<int64_t>(row_of.size());
    const int64_t pos = std::min<int64_t>(position.typed_data()[r / per_batch], s_len - 1);
    const int64_t first = std::max<int64_t>(0, pos - win + 1);
    if (pos < 0 || first > pos) continue;  // no position seen: no chunk (NaN below)
    for (int64_t start = first / kBlock * kBlock; start <= pos; start += kBlock) {
      row_of.push_back(r);
      c0s.push_back(std::max(first, start));
      c1s.push_back(std::min(pos + 1, start + kBlock));
    }
  }
  row_first[rows] = static_cast<int64_t>(row_of.size());
  const int64_t chunks = row_first[rows];
  const int64_t stride = g_heads * (2 + h);  // a chunk's m [g], denom [g], acc [g, h]
  std::vector<float> partial(chunks * stride);
  shardq::share_out(pool, chunks, chunks > 1, [&](int64_t c) {
    const int64_t r = row_of[c];
    std::vector<float> s(g_heads * kBlock);
    float* p = partial.data() + c * stride;
    block_partial(q.typed_data() + r * g_heads * h, keys + r * h * s_len,
                  values + r * s_len * h, k_scale != nullptr ? k_scale + r * s_len : nullptr,
                  v_scale != nullptr ? v_scale + r * s_len : nullptr, g_heads, h, s_len,
                  c0s[c], c1s[c], s.data(), p, p + g_heads, p + 2 * g_heads);
  });
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * g_heads * h;
    if (row_first[r] == row_first[r + 1]) {  // no position seen: 0 / 0, as XLA's softmax gives
      std::fill(o, o + g_heads * h, NAN);
      continue;
    }
    for (int64_t g = 0; g < g_heads; ++g) {
      float m = -INFINITY, denom = 0.0f;
      float* og = o + g * h;
      std::fill(og, og + h, 0.0f);
      for (int64_t c = row_first[r]; c < row_first[r + 1]; ++c) {
        const float* p = partial.data() + c * stride;
        if (p[g] == -INFINITY) continue;  // a block of zero weights adds nothing
        const float m_new = std::max(m, p[g]);
        const float old = std::exp(m - m_new), mine = std::exp(p[g] - m_new);
        denom = denom * old + p[g_heads + g] * mine;
        const float* ag = p + 2 * g_heads + g * h;
        for (int64_t d = 0; d < h; ++d) og[d] = og[d] * old + ag[d] * mine;
        m = m_new;
      }
      for (int64_t d = 0; d < h; ++d) og[d] /= denom;
    }
  }
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
