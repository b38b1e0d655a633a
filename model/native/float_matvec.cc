// shardq's float32 product for a few rows (batch-1 decoding), as an XLA FFI custom call on the CPU.
//
//   y[m, n] = sum_k x[m, k] * w[n, k]
//
// x is float32 [M, K]; w float32 [N, K], each output's weights contiguous: the layout a Dense
// kernel takes for decoding (model.layers.use_native_float stores it so), and a tied head's
// embedding table [vocab, embed] as it is. The grouped entry multiplies the same x by several
// kernels (an attention's q, k and v) in one call.
//
// Why it exists: a decoding step multiplies one row by every kernel, and each product is over
// in tens of microseconds. XLA:CPU's one-row float32 dot reads a kernel of a few megabytes
// below what the memory delivers, and runs as one operation per kernel. Here each output's
// weights are read front to back, one output at a time, the outputs split into chunks of
// consecutive outputs that XLA's own intra-op threads claim: each thread reads one stream of
// consecutive bytes, which the hardware prefetcher follows best. Every output's sum runs on one
// thread in a fixed order, so the result does not depend on the thread count.

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "share_out.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// How far ahead of the weights being multiplied their loads are requested, in floats.
constexpr int64_t kPrefetchFloats = 1024;

// sum over i < k of x[i] * w[i], in the same order for every call with this k: 64 floats a step
// in four independent accumulators, then 16 at a time, the last partial vector loaded under a
// mask (its missing lanes zero). `fetch`: request w kPrefetchFloats ahead as it goes.
inline float dot_row(const float* x, const float* w, int64_t k, bool fetch) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    if (fetch) {
      for (int q = 0; q < 4; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchFloats + i + 16 * q),
                     _MM_HINT_T0);
      }
    }
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(w + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), _mm512_loadu_ps(w + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), _mm512_loadu_ps(w + i + 48), a3);
  }
  for (; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (k - i)) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, w + i), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    if (fetch) {
      for (int q = 0; q < 2; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchFloats + i + 16 * q),
                     _MM_HINT_T0);
      }
    }
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(w + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(w + i + 24), a3);
  }
  for (; i + 8 <= k; i += 8) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), a0);
  }
  const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float tail = 0.0f;
  for (; i < k; ++i) tail = std::fma(x[i], w[i], tail);
  return _mm_cvtss_f32(h) + tail;
#else
  (void)fetch;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    for (int q = 0; q < 4; ++q) a[q] = std::fma(x[i + q], w[i + q], a[q]);
  }
  for (; i < k; ++i) a[0] = std::fma(x[i], w[i], a[0]);
  return (a[0] + a[1]) + (a[2] + a[3]);
#endif
}

// One kernel of a call: its weights [n, k] and where its outputs [rows, n] go.
struct Kernel {
  const float* w;
  int64_t n;
  float* out;
};

// x [rows, k] times every kernel, outputs [n0, n1) of kernel `kn` here: one output's weights at
// a time, front to back; the row stays in L1 while further rows of x reuse it.
void outputs(const float* x, int64_t rows, int64_t k, const Kernel& kn, int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; ++j) {
    for (int64_t m = 0; m < rows; ++m) {
      kn.out[m * kn.n + j] = dot_row(x + m * k, kn.w + j * k, k, m == 0);
    }
  }
}

ffi::Error products(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                    const std::vector<Kernel>& kernels) {
  const int64_t rows = x.dimensions()[0], k = x.dimensions()[1];
  std::vector<int64_t> n;
  for (const Kernel& kn : kernels) n.push_back(kn.n);
  shardq::for_outputs(pool, n, k * 4, [&](int64_t i, int64_t n0, int64_t n1) {
    outputs(x.typed_data(), rows, k, kernels[i], n0, n1);
  });
  return ffi::Error::Success();
}

ffi::Error kernel_of(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w,
                     ffi::Result<ffi::Buffer<ffi::F32>>& y, Kernel& kn) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("shardq float kernel: x [M, K] and w [N, K] expected");
  }
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("shardq float kernel: a result [M, N] expected");
  }
  kn = {w.typed_data(), wd[0], y->typed_data()};
  return ffi::Error::Success();
}

ffi::Error FloatMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  std::vector<Kernel> kernels(1);
  if (ffi::Error e = kernel_of(x, w, y, kernels[0]); e.failure()) return e;
  return products(pool, x, kernels);
}

// x, then one w per kernel; one result per kernel.
ffi::Error FloatMatvecGroup(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() == 0 || rets.size() != args.size()) {
    return ffi::Error::InvalidArgument("shardq float kernel: one result per kernel expected");
  }
  std::vector<Kernel> kernels(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto w = args.get<ffi::Buffer<ffi::F32>>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    if (ffi::Error e = kernel_of(x, *w, *y, kernels[i]); e.failure()) return e;
  }
  return products(pool, x, kernels);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqFloatMatvec, FloatMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardqFloatMatvecGroup, FloatMatvecGroup,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
