#include "cache_counters.h"

#include <algorithm>

namespace cp_cache {

void CacheCounters::on_created() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.created;
  ++stats_.live_entries;
  stats_.peak_entries = std::max(stats_.peak_entries, stats_.live_entries);
}

void CacheCounters::on_released(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.released;
  --stats_.live_entries;
  stats_.live_bytes -= bytes;
}

void CacheCounters::add_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.live_bytes += bytes;
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes);
}

void CacheCounters::on_pushed() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.pushed;
}

void CacheCounters::on_popped() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.popped;
}

void CacheCounters::on_skipped_push() {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.skipped_recompute_pushes;
}

void CacheCounters::set_stack_depth(int64_t depth) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.stack_depth = depth;
}

void CacheCounters::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_entries = stats_.live_entries;
  stats_.peak_bytes = stats_.live_bytes;
}

CacheStats CacheCounters::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

} // namespace cp_cache
