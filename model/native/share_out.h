// Work of one XLA FFI call shared out over XLA's own intra-op threads: shardq's native kernels
// (model/native/float_matvec.cc, quant/native/int8_matvec.cc) include it.
#ifndef SHARDQ_NATIVE_SHARE_OUT_H_
#define SHARDQ_NATIVE_SHARE_OUT_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

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

}  // namespace shardq

#endif  // SHARDQ_NATIVE_SHARE_OUT_H_
