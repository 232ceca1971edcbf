#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <variant>
#include <vector>

#include "cache_counters.h"

namespace cp_cache {

using MetadataValue = std::variant<bool, int64_t, double, std::string>;

// One ring step of one attention call: what it computed (tag) and the tensors
// its backward needs (e.g. the dropout seed/offset), owned by the cache.
struct StepRecord {
  std::string tag;
  std::vector<at::Tensor> tensors;
};

// The state one attention call's backward needs from its forward. Owned
// through shared_ptr by a handle (StepCacheStore::attach) or by the stack;
// the destructor returns the entry and its bytes to the store's counters.
class StepCache {
 public:
  StepCache(uint64_t id, std::shared_ptr<CacheCounters> counters);
  ~StepCache();
  StepCache(const StepCache&) = delete;
  StepCache& operator=(const StepCache&) = delete;

  uint64_t id() const { return id_; }
  int64_t graph_task_id() const { return graph_task_id_; }
  uint64_t thread_id() const { return thread_id_; }

  // What a backward names to claim this cache from the stack (default: the
  // id). A content fingerprint lets a checkpoint recompute, whose own push is
  // skipped, claim the original forward's entry when both computed the same.
  uint64_t pairing_key() const;
  void set_pairing_key(uint64_t key);

  void add_step(std::string tag, std::vector<at::Tensor> tensors);
  size_t num_steps() const;
  StepRecord step(size_t index) const;
  std::vector<StepRecord> steps() const;

  void set_meta(const std::string& key, MetadataValue value);
  MetadataValue meta(const std::string& key) const;
  bool has_meta(const std::string& key) const;
  std::map<std::string, MetadataValue> metadata() const;

  // Bytes of the storages the cache owns, each storage counted once.
  int64_t owned_bytes() const;

 private:
  const uint64_t id_;
  const int64_t graph_task_id_;
  const uint64_t thread_id_;
  const std::shared_ptr<CacheCounters> counters_;

  mutable std::mutex mutex_;
  uint64_t pairing_key_;
  std::vector<StepRecord> steps_;
  std::map<std::string, MetadataValue> metadata_;
  std::unordered_set<const void*> storages_;
  int64_t owned_bytes_ = 0;
};

uint64_t current_thread_id();

} // namespace cp_cache
