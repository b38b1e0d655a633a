// exp of sixteen float32 lanes, for shardq's native kernels that need many exponentials
// (model/native/decode_attention.cc's softmax, model/native/log_sum_exp.cc).
#ifndef SHARDQ_NATIVE_EXP16_H_
#define SHARDQ_NATIVE_EXP16_H_

#if defined(__AVX512F__)
#include <immintrin.h>

namespace shardq {

// Cephes' expf polynomial with exact scaling by 2^n: within a few float32 ulps of std::exp; a
// lane at or below -88 gives 0, as exp's underflow does.
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

}  // namespace shardq

#endif  // __AVX512F__
#endif  // SHARDQ_NATIVE_EXP16_H_
