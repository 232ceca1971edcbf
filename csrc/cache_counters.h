#pragma once

#include <cstdint>
#include <mutex>

namespace cp_cache {

// A consistent snapshot of a store's counters.
struct CacheStats {
  int64_t live_entries = 0;
  int64_t live_bytes = 0;
  int64_t peak_entries = 0;
  int64_t peak_bytes = 0;
  int64_t created = 0;
  int64_t released = 0;
  int64_t pushed = 0;
  int64_t popped = 0;
  int64_t skipped_recompute_pushes = 0;
  int64_t stack_depth = 0;
};

// Live/peak accounting shared by a store and every cache it created. Caches
// are destroyed on autograd worker threads, so every update takes the lock;
// one lock keeps live and peak values consistent with each other.
class CacheCounters {
 public:
  void on_created();
  void on_released(int64_t bytes);
  void add_bytes(int64_t bytes);
  void on_pushed();
  void on_popped();
  void on_skipped_push();
  void set_stack_depth(int64_t depth);
  void reset_peak();
  CacheStats snapshot() const;

 private:
  mutable std::mutex mutex_;
  CacheStats stats_;
};

} // namespace cp_cache
