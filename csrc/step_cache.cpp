#include "step_cache.h"

#include <c10/util/Exception.h>

#include <functional>
#include <thread>

#include "autograd_state.h"

namespace cp_cache {

uint64_t current_thread_id() {
  return static_cast<uint64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()));
}

StepCache::StepCache(uint64_t id, std::shared_ptr<CacheCounters> counters)
    : id_(id),
      graph_task_id_(current_graph_task_id()),
      thread_id_(current_thread_id()),
      counters_(std::move(counters)),
      pairing_key_(id) {
  TORCH_CHECK(counters_, "StepCache ", id, " needs the counters of its store");
  counters_->on_created();
}

StepCache::~StepCache() {
  counters_->on_released(owned_bytes_);
}

void StepCache::add_step(std::string tag, std::vector<at::Tensor> tensors) {
  int64_t new_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& tensor : tensors) {
      TORCH_CHECK(
          tensor.defined(),
          "StepCache ", id_, ": step ", steps_.size(), " ('", tag,
          "') was given an undefined tensor");
      if (!tensor.has_storage()) {
        continue;
      }
      const auto& storage = tensor.unsafeGetTensorImpl()->unsafe_storage();
      if (storage && storages_.insert(storage.unsafeGetStorageImpl()).second) {
        new_bytes += static_cast<int64_t>(storage.nbytes());
      }
    }
    owned_bytes_ += new_bytes;
    steps_.push_back(StepRecord{std::move(tag), std::move(tensors)});
  }
  if (new_bytes > 0) {
    counters_->add_bytes(new_bytes);
  }
}

uint64_t StepCache::pairing_key() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pairing_key_;
}

void StepCache::set_pairing_key(uint64_t key) {
  std::lock_guard<std::mutex> lock(mutex_);
  pairing_key_ = key;
}

size_t StepCache::num_steps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return steps_.size();
}

StepRecord StepCache::step(size_t index) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK_INDEX(
      index < steps_.size(), "StepCache ", id_, " has ", steps_.size(),
      " steps; step index ", index, " is out of range");
  return steps_[index];
}

std::vector<StepRecord> StepCache::steps() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return steps_;
}

void StepCache::set_meta(const std::string& key, MetadataValue value) {
  std::lock_guard<std::mutex> lock(mutex_);
  metadata_[key] = std::move(value);
}

MetadataValue StepCache::meta(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = metadata_.find(key);
  TORCH_CHECK_VALUE(
      it != metadata_.end(), "StepCache ", id_, " has no metadata key '", key, "'");
  return it->second;
}

bool StepCache::has_meta(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return metadata_.count(key) != 0;
}

std::map<std::string, MetadataValue> StepCache::metadata() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return metadata_;
}

int64_t StepCache::owned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return owned_bytes_;
}

} // namespace cp_cache
