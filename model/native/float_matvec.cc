// shardq's float32 product for a few rows (batch-1 decoding), as an XLA FFI custom call on the CPU.
//
//   y[m, n] = sum_k x[m, k] * w[k, n]
//
// x is float32 [M, K]; w float32 [K, N], Dense's [in, out] layout: each input's weights to
// every output contiguous. The grouped entry multiplies the same x by several kernels (an
// attention's q, k and v) in one call.
//
// Why it exists: a decoding step multiplies one row by every kernel, and each product is over
// in tens of microseconds. XLA:CPU's one-row float32 dot reads a kernel of a few megabytes
// well below what the memory delivers, and runs as one operation per kernel. Here a kernel's
// rows are read front to back, in chunks of consecutive rows that XLA's own intra-op threads
// claim one at a time; each chunk's partial sums land in its own buffer and the partials are
// added in chunk order, so the result does not depend on which thread ran which chunk.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "share_out.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Weight bytes one thread takes at a time, and below which a call runs on the calling thread
// alone (waking another thread costs more than reading that much).
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int64_t kParallelBytes = 192 * 1024;
constexpr int64_t kMinChunkRows = 64;
// How far ahead of the rows being multiplied their loads are requested.
constexpr int64_t kPrefetchBytes = 8192;

// One kernel of a call: its weights [k, n] and where its outputs go.
struct Kernel {
  const float* w;
  int64_t n;
  float* out;
};

// partial[m * n + j] += sum over rows [k0, k1) of x[m, k] * w[k, j], eight rows at a time (each
// output's partial read and written once per eight rows: eight weight streams at once), then
// one row at a time. Every output's sum runs in the same order on every path.
void rows_times_kernel(const float* x, int64_t rows, int64_t k, const float* w, int64_t n,
                       int64_t k0, int64_t k1, float* partial) {
  int64_t r = k0;
#if defined(__AVX512F__)
  const int64_t nv = n - n % 16;
  // whole eight-row groups ahead, at least kPrefetchBytes
  const int64_t ahead = 8 * (kPrefetchBytes / (32 * n) + 1);
  for (; r + 8 <= k1; r += 8) {
    const float* w0 = w + r * n;
    const bool fetch = r + ahead + 8 <= k1;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xm = x + m * k + r;
      __m512 xs[8];
      for (int q = 0; q < 8; ++q) xs[q] = _mm512_set1_ps(xm[q]);
      float* pm = partial + m * n;
      for (int64_t j = 0; j < nv; j += 16) {
        if (m == 0 && fetch) {
          for (int64_t q = 0; q < 8; ++q) {
            _mm_prefetch(reinterpret_cast<const char*>(w0 + (ahead + q) * n + j), _MM_HINT_T0);
          }
        }
        __m512 acc = _mm512_loadu_ps(pm + j);
        for (int q = 0; q < 8; ++q) {
          acc = _mm512_fmadd_ps(xs[q], _mm512_loadu_ps(w0 + q * n + j), acc);
        }
        _mm512_storeu_ps(pm + j, acc);
      }
      for (int64_t j = nv; j < n; ++j) {
        float acc = pm[j];
        for (int64_t q = 0; q < 8; ++q) acc = std::fma(xm[q], w0[q * n + j], acc);
        pm[j] = acc;
      }
    }
  }
#endif
  for (; r < k1; ++r) {
    const float* wr = w + r * n;
    for (int64_t m = 0; m < rows; ++m) {
      const float xv = x[m * k + r];
      float* pm = partial + m * n;
      for (int64_t j = 0; j < n; ++j) pm[j] = std::fma(xv, wr[j], pm[j]);
    }
  }
}

// x [rows, k] times every kernel: each kernel's rows split into chunks that XLA's intra-op
// threads claim (when the kernels are large enough to pay for waking them), each chunk's
// partial sums in its own part of one buffer, then each kernel's partials added in chunk order.
// One buffer, allocated and freed by the calling thread: a buffer per chunk would be an
// allocation per chunk on whichever thread ran it, and a free across threads, on every call.
ffi::Error products(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                    const std::vector<Kernel>& kernels) {
  const float* xs = x.typed_data();
  const int64_t rows = x.dimensions()[0], k = x.dimensions()[1];
  struct Chunk {
    int64_t kernel, first, last, offset;  // kernel's rows [first, last), partials at offset
  };
  std::vector<Chunk> chunk;
  int64_t bytes = 0, floats = 0;
  for (size_t i = 0; i < kernels.size(); ++i) {
    const int64_t row_bytes = std::max<int64_t>(1, kernels[i].n * 4);
    // Chunks of whole eight-row groups, about kChunkBytes each and at least kMinChunkRows rows
    // (a chunk's partials, added after, stay a small share of its bytes), fixed by the kernel's
    // shape alone.
    const int64_t chunk_rows =
        std::max<int64_t>(kMinChunkRows, (kChunkBytes / row_bytes + 7) / 8 * 8);
    for (int64_t r = 0; r < k; r += chunk_rows) {
      chunk.push_back({static_cast<int64_t>(i), r, std::min(k, r + chunk_rows), floats});
      floats += (rows * kernels[i].n + 15) / 16 * 16;  // chunks' partials on their own lines
    }
    bytes += kernels[i].n * k * 4;
  }
  const int64_t chunks = static_cast<int64_t>(chunk.size());
  // uninitialised here: each chunk zeroes its own part on the thread that runs it
  std::unique_ptr<float, decltype(&std::free)> partial(
      static_cast<float*>(std::aligned_alloc(64, std::max<int64_t>(16, floats) * 4)), &std::free);
  if (partial == nullptr) return ffi::Error::Internal("shardq float kernel: out of memory");
  shardq::share_out(pool, chunks, bytes >= kParallelBytes, [&](int64_t c) {
    const Chunk& ch = chunk[c];
    const Kernel& kn = kernels[ch.kernel];
    float* p = partial.get() + ch.offset;
    std::fill(p, p + rows * kn.n, 0.0f);
    rows_times_kernel(xs, rows, k, kn.w, kn.n, ch.first, ch.last, p);
  });
  std::vector<bool> started(kernels.size(), false);
  for (const Chunk& ch : chunk) {
    const Kernel& kn = kernels[ch.kernel];
    const int64_t size = rows * kn.n;
    const float* p = partial.get() + ch.offset;
    if (!started[ch.kernel]) {
      std::memcpy(kn.out, p, size * sizeof(float));
      started[ch.kernel] = true;
    } else {
      for (int64_t i = 0; i < size; ++i) kn.out[i] += p[i];
    }
  }
  for (size_t i = 0; i < kernels.size(); ++i) {  // a kernel of no rows: zeros
    if (!started[i]) std::memset(kernels[i].out, 0, rows * kernels[i].n * sizeof(float));
  }
  return ffi::Error::Success();
}

ffi::Error kernel_of(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w, float* out,
                     Kernel& kn) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("shardq float kernel: x [M, K] and w [K, N] expected");
  }
  kn = {w.typed_data(), wd[1], out};
  return ffi::Error::Success();
}

ffi::Error FloatMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  std::vector<Kernel> kernels(1);
  if (ffi::Error e = kernel_of(x, w, y->typed_data(), kernels[0]); e.failure()) return e;
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
    if (ffi::Error e = kernel_of(x, *w, (*y)->typed_data(), kernels[i]); e.failure()) return e;
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
