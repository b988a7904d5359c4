// Work sharing for the CPU kernels: a call's independent items (matrix panels, attention
// groups) are claimed through an atomic counter by the calling thread and by tasks it schedules
// on XLA's intra-op pool.
//
// The caller claims items too and then waits only for items a running thread has claimed, so a
// pool busy with other work never deadlocks it: unstarted helpers find nothing left and return.
// The shared state lives in a shared_ptr because a helper may start after the call returned;
// such a helper claims nothing, so it never runs `run` on the caller's (by then gone) buffers.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace bapo_kernels {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Runs `run(begin, end)` over the items [0, count) in claims of `chunk` adjacent items, on the
// calling thread and at most `pool.num_threads() - 1` pool tasks; returns when all are done.
inline void ShareOut(xla::ffi::ThreadPool& pool, int64_t count, int64_t chunk,
                     std::function<void(int64_t, int64_t)> run) {
  struct Claims {
    std::function<void(int64_t, int64_t)> run;
    int64_t count, chunk;
    std::atomic<int64_t> next{0};  // first unclaimed item
    std::atomic<int64_t> done{0};  // items finished

    void Take() {
      for (int64_t c = next.fetch_add(chunk); c < count; c = next.fetch_add(chunk)) {
        const int64_t end = std::min(c + chunk, count);
        run(c, end);
        done.fetch_add(end - c, std::memory_order_release);
      }
    }
  };
  auto claims = std::make_shared<Claims>();
  claims->run = std::move(run);
  claims->count = count;
  claims->chunk = std::max<int64_t>(chunk, 1);
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t helpers = std::min(threads, CeilDiv(count, claims->chunk)) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([claims] { claims->Take(); });
  claims->Take();
  while (claims->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace bapo_kernels
