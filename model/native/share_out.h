// Work of one XLA FFI call shared out over XLA's own intra-op threads: shardq's native kernels
// (model/native/float_matvec.cc, quant/native/int8_matvec.cc) include it.
#ifndef SHARDQ_NATIVE_SHARE_OUT_H_
#define SHARDQ_NATIVE_SHARE_OUT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace shardq {

// chunk(c) for c in [0, count), the chunks claimed one at a time by whichever thread comes: the
// calling one and (`parallel`) helpers it schedules on `pool`; returns when every chunk is done.
// The state is held by a shared_ptr, since a helper that starts after the work is done still
// reads it (it then finds no chunk left, and never calls `chunk`).
inline void share_out(xla::ffi::ThreadPool& pool, int64_t count, bool parallel,
                      std::function<void(int64_t)> chunk) {
  struct State {
    std::function<void(int64_t)> chunk;
    int64_t count = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};

    void work() {
      int64_t c;
      while ((c = next.fetch_add(1, std::memory_order_relaxed)) < count) {
        chunk(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>();
  state->chunk = std::move(chunk);
  state->count = count;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (parallel && threads > 1) {
    const int64_t helpers = std::min(threads - 1, count - 1);
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->work(); });
  }
  state->work();
  // Every chunk is claimed by now; wait for those other threads are still computing.
  while (state->done.load(std::memory_order_acquire) < count) {
#if defined(__AVX2__)
    _mm_pause();
#endif
  }
}

// Weight bytes one thread takes at a time, and below which a call runs on the calling thread
// alone (waking another thread costs more than reading that much).
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int64_t kParallelBytes = 192 * 1024;

// rows(i, n0, n1) over all n[i] outputs of every kernel i (an output's weights are
// bytes_per_row bytes, stored together), on XLA's intra-op threads when the kernels hold at least
// kParallelBytes. The chunks hold about kChunkBytes each (their count over all kernels rounded up
// to a multiple of the thread count); every kernel's chunks start at its output 0 and hold a
// multiple of 16 outputs (64 bytes of float or int32 results), which keeps two threads' results
// on separate cache lines where a row of results starts on one.
inline void for_outputs(xla::ffi::ThreadPool& pool, const std::vector<int64_t>& n,
                        int64_t bytes_per_row,
                        std::function<void(int64_t, int64_t, int64_t)> rows) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t total = 0;
  for (int64_t ni : n) total += ni;
  const int64_t bytes = total * bytes_per_row;
  if (threads == 1 || bytes < kParallelBytes) {
    for (size_t i = 0; i < n.size(); ++i) rows(static_cast<int64_t>(i), 0, n[i]);
    return;
  }
  int64_t want = (bytes + kChunkBytes - 1) / kChunkBytes;
  want = (want + threads - 1) / threads * threads;
  const int64_t rows_each = (total + want - 1) / want;
  const int64_t chunk_rows = std::max<int64_t>(16, (rows_each + 15) / 16 * 16);
  std::vector<int64_t> kernel, first, last;
  for (size_t i = 0; i < n.size(); ++i) {
    for (int64_t n0 = 0; n0 < n[i]; n0 += chunk_rows) {
      kernel.push_back(static_cast<int64_t>(i));
      first.push_back(n0);
      last.push_back(std::min(n[i], n0 + chunk_rows));
    }
  }
  share_out(pool, static_cast<int64_t>(kernel.size()), true,
            [&](int64_t c) { rows(kernel[c], first[c], last[c]); });
}

}  // namespace shardq

#endif  // SHARDQ_NATIVE_SHARE_OUT_H_
