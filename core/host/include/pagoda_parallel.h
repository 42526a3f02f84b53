// Lists of work items for the threads of one parallel region (ATen's pool), each thread taking the next item as
// it finishes the last: on a machine with more runnable threads than cores, a thread the OS holds up takes fewer
// items instead of holding up the region's end.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

namespace pagoda {

// fn(0 .. n - 1); serial for one item, one thread, or inside a parallel region
template <typename F>
void parallel_items(int64_t n, const F& fn) {
  if (n <= 0) return;
  if (n == 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(i);
  });
}

// A spin-then-yield wait: the thread being waited for may need this core
inline void wait_briefly(int64_t& spins) {
  if (++spins < 64) return;
  spins = 0;
  std::this_thread::yield();
}

// fn1(0 .. n1 - 1), then fn2(0 .. n2 - 1), in one parallel region (one fork and join): a thread that draws an
// item of the second list waits until every item of the first is done (the ones it waits for are held by
// running threads, so it always ends). An item that throws ends the region: the other threads stop drawing
// items and stop waiting (the first list can no longer complete), and the exception reaches the caller.
template <typename F1, typename F2>
void parallel_two_phases(int64_t n1, const F1& fn1, int64_t n2, const F2& fn2) {
  const int64_t total = n1 + n2;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> failed{false};
  auto work = [&]() {
    try {
      for (int64_t i = next++; i < total && !failed.load(std::memory_order_relaxed); i = next++) {
        if (i < n1) {
          fn1(i);
          done.fetch_add(1, std::memory_order_release);
          continue;
        }
        int64_t spins = 0;
        while (done.load(std::memory_order_acquire) < n1) {
          if (failed.load(std::memory_order_relaxed)) return;
          wait_briefly(spins);
        }
        fn2(i - n1);
      }
    } catch (...) {
      failed.store(true, std::memory_order_relaxed);
      throw;
    }
  };
  if (total <= 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    work();
    return;
  }
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) { work(); });
}

}  // namespace pagoda
