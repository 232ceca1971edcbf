#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "cache_counters.h"
#include "step_cache.h"

namespace cp_cache {

// Where step caches live between an attention forward and its backward.
//
// Handle discipline: attach() returns a CPU int64 [1] tensor whose storage
// owns the cache; the cache dies with the last tensor sharing that storage.
// resolve() finds it again from any such tensor, and refuses anything else.
//
// Stack discipline (the LIFO baseline): push() in forward unless the thread
// runs an autograd graph task (a checkpoint recompute), pop() in backward,
// checking the pairing key (by default the cache id) the forward recorded.
class StepCacheStore {
 public:
  explicit StepCacheStore(std::optional<int64_t> max_stack_depth = std::nullopt);
  StepCacheStore(const StepCacheStore&) = delete;
  StepCacheStore& operator=(const StepCacheStore&) = delete;

  std::shared_ptr<StepCache> create();

  at::Tensor attach(std::shared_ptr<StepCache> cache);
  std::shared_ptr<StepCache> resolve(const at::Tensor& handle) const;
  bool is_handle(const at::Tensor& tensor) const;
  // Drops the cache behind a handle before the handle dies (e.g. after a
  // backward that does not keep its graph); resolving it afterwards raises.
  // Returns whether a cache was dropped.
  bool release(const at::Tensor& handle);

  bool push(std::shared_ptr<StepCache> cache);
  std::shared_ptr<StepCache> pop(std::optional<uint64_t> expected_key = std::nullopt);
  int64_t depth() const;
  int64_t clear();
  std::optional<int64_t> max_stack_depth() const;
  void set_max_stack_depth(std::optional<int64_t> max_depth);

  CacheStats stats() const;
  void reset_peak();

 private:
  const uint64_t token_;
  const std::shared_ptr<CacheCounters> counters_;
  std::atomic<uint64_t> next_id_{1};

  mutable std::mutex stack_mutex_;
  std::vector<std::shared_ptr<StepCache>> stack_;
  std::optional<int64_t> max_stack_depth_;
};

// The process-wide store the Python package uses.
StepCacheStore& default_store();

} // namespace cp_cache
