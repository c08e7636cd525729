// Work dealt to the threads from a shared counter instead of a static split.
//
// The engine's two threads share two cores with the server's event loop (and, in benchmarks, the
// HTTP clients): whenever one of them is preempted inside a statically split loop, the other finishes
// its share and waits at the region's end, so every stolen millisecond costs two. Claiming chunks as
// they go lets the running thread take over the preempted one's remaining chunks.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvpilot {

// Items [0, n) in chunks, claimed in order; `chunk` so that each thread claims several (a claim is an
// atomic add on a line both threads write).
class WorkQueue {
 public:
  WorkQueue(int64_t n, int64_t chunk) : n_(n), chunk_(std::max<int64_t>(1, chunk)) {}
  // The next chunk [begin, end); false once every item is claimed.
  bool claim(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (begin >= n_) return false;
    end = std::min(n_, begin + chunk_);
    return true;
  }
  int64_t size() const { return n_; }

 private:
  const int64_t n_, chunk_;
  std::atomic<int64_t> next_{0};
};

// Chunks for about `per_thread` claims by each of the threads at::parallel_for would use.
inline int64_t chunk_for(int64_t n, int64_t per_thread = 8) {
  return std::max<int64_t>(1, n / (std::max(1, at::get_num_threads()) * per_thread));
}

// worker() on up to min(threads, items) threads; each claims from the queue until it is empty (any one
// of them alone covers every item, so fewer threads, e.g. nested inside a parallel region, still do).
template <class Worker>
void on_threads(int64_t items, const Worker& worker) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(); });
}

}  // namespace kvpilot
