#include "store.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <sstream>

#include "autograd_state.h"

namespace cp_cache {
namespace {

std::atomic<uint64_t> next_store_token{1};

// Lives in the handle's storage context; its address is the handle's data.
struct HandleContext {
  int64_t value;  // the cache id: what the handle tensor reads as
  uint64_t store_token;
  uint64_t cache_id;
  mutable std::mutex mutex;
  std::shared_ptr<StepCache> cache;  // null once released
};

void delete_handle_context(void* context) {
  delete static_cast<HandleContext*>(context);
}

std::string describe(const at::Tensor& tensor) {
  if (!tensor.defined()) {
    return "an undefined tensor";
  }
  std::ostringstream out;
  out << "a tensor of dtype " << tensor.scalar_type();
  if (tensor.is_nested()) {
    out << ", nested";
  } else if (tensor.layout() == at::kStrided) {
    out << ", shape " << tensor.sizes();
  } else {
    out << ", layout " << tensor.layout();
  }
  out << " on " << tensor.device();
  return out.str();
}

// The context of a tensor whose storage a handle of *some* store created,
// or null. Never dereferences a context it did not make.
HandleContext* handle_context(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) {
    return nullptr;
  }
  const auto& storage = tensor.unsafeGetTensorImpl()->unsafe_storage();
  if (!storage) {
    return nullptr;
  }
  const auto& data_ptr = storage.data_ptr();
  if (data_ptr.get_deleter() != &delete_handle_context) {
    return nullptr;
  }
  return static_cast<HandleContext*>(data_ptr.get_context());
}

} // namespace

StepCacheStore::StepCacheStore(std::optional<int64_t> max_stack_depth)
    : token_(next_store_token.fetch_add(1)),
      counters_(std::make_shared<CacheCounters>()) {
  set_max_stack_depth(max_stack_depth);
}

std::shared_ptr<StepCache> StepCacheStore::create() {
  return std::make_shared<StepCache>(next_id_.fetch_add(1), counters_);
}

at::Tensor StepCacheStore::attach(std::shared_ptr<StepCache> cache) {
  TORCH_CHECK(cache, "attach: cache must not be None");
  auto context = std::make_unique<HandleContext>();
  context->value = static_cast<int64_t>(cache->id());
  context->store_token = token_;
  context->cache_id = cache->id();
  context->cache = std::move(cache);
  void* data = &context->value;
  return at::for_blob(data, {1})
      .options(at::TensorOptions().dtype(at::kLong).device(at::kCPU))
      .context(context.release(), &delete_handle_context)
      .make_tensor();
}

bool StepCacheStore::is_handle(const at::Tensor& tensor) const {
  const HandleContext* context = handle_context(tensor);
  return context != nullptr && context->store_token == token_;
}

std::shared_ptr<StepCache> StepCacheStore::resolve(const at::Tensor& handle) const {
  const HandleContext* context = handle_context(handle);
  TORCH_CHECK(
      context != nullptr,
      "cp_cache: expected a step-cache handle (the seed output of the attention "
      "forward), got ", describe(handle),
      " whose storage no handle created. Likely causes: a saved-tensor hook "
      "that copies saved tensors (e.g. torch.autograd.graph.save_on_cpu), "
      "a .clone()/.to() of the handle, or a seed tensor from another "
      "implementation of the op");
  TORCH_CHECK(
      context->store_token == token_,
      "cp_cache: the handle of cache ", context->cache_id,
      " belongs to another step-cache store");
  std::lock_guard<std::mutex> lock(context->mutex);
  TORCH_CHECK(
      context->cache,
      "cp_cache: the handle of cache ", context->cache_id,
      " has expired: its cache was released after an earlier backward that "
      "did not keep the graph (call backward with retain_graph=True to run "
      "it twice)");
  return context->cache;
}

bool StepCacheStore::release(const at::Tensor& handle) {
  resolve(handle);  // same checks, same messages
  HandleContext* context = handle_context(handle);
  std::shared_ptr<StepCache> dropped;
  {
    std::lock_guard<std::mutex> lock(context->mutex);
    dropped = std::move(context->cache);
    context->cache = nullptr;
  }
  return dropped != nullptr;  // destroyed here, outside the lock
}

bool StepCacheStore::push(std::shared_ptr<StepCache> cache) {
  TORCH_CHECK(cache, "push: cache must not be None");
  if (in_graph_task()) {
    counters_->on_skipped_push();
    return false;
  }
  std::lock_guard<std::mutex> lock(stack_mutex_);
  const auto depth = static_cast<int64_t>(stack_.size());
  TORCH_CHECK(
      !max_stack_depth_ || depth < *max_stack_depth_,
      "cp_cache: step-cache stack is full (depth ", depth, ", limit ",
      max_stack_depth_.value_or(0),
      "): forwards ran without their backward (eval with grad enabled, "
      "dropped graphs); use the handle policy or run under torch.no_grad()");
  stack_.push_back(std::move(cache));
  counters_->on_pushed();
  counters_->set_stack_depth(depth + 1);
  return true;
}

std::shared_ptr<StepCache> StepCacheStore::pop(std::optional<uint64_t> expected_key) {
  std::shared_ptr<StepCache> top;
  {
    std::lock_guard<std::mutex> lock(stack_mutex_);
    TORCH_CHECK(
        !stack_.empty(),
        "cp_cache: pop from an empty step-cache stack",
        expected_key ? " (backward expected key " + std::to_string(*expected_key) + ")" : "",
        ": this backward has no forward entry (a second backward of the same "
        "graph, or a forward that skipped its push); the stack policy cannot "
        "serve it, the handle policy can");
    const auto& candidate = stack_.back();
    TORCH_CHECK(
        !expected_key || *expected_key == candidate->pairing_key(),
        "cp_cache: step-cache stack mis-pairing: backward expected key ",
        expected_key.value_or(0), " but the top of the stack is cache ",
        candidate->id(), " with key ", candidate->pairing_key(), " (depth ",
        stack_.size(),
        "); backwards ran in another order than their forwards (pipeline "
        "schedules, threads) or a recompute drew other dropout seeds. The "
        "stack policy cannot serve this; the handle policy can");
    top = std::move(stack_.back());
    stack_.pop_back();
    counters_->on_popped();
    counters_->set_stack_depth(static_cast<int64_t>(stack_.size()));
  }
  return top;
}

int64_t StepCacheStore::depth() const {
  std::lock_guard<std::mutex> lock(stack_mutex_);
  return static_cast<int64_t>(stack_.size());
}

int64_t StepCacheStore::clear() {
  std::vector<std::shared_ptr<StepCache>> dropped;
  {
    std::lock_guard<std::mutex> lock(stack_mutex_);
    dropped.swap(stack_);
    counters_->set_stack_depth(0);
  }
  return static_cast<int64_t>(dropped.size());  // destroyed here, outside the lock
}

std::optional<int64_t> StepCacheStore::max_stack_depth() const {
  std::lock_guard<std::mutex> lock(stack_mutex_);
  return max_stack_depth_;
}

void StepCacheStore::set_max_stack_depth(std::optional<int64_t> max_depth) {
  TORCH_CHECK_VALUE(
      !max_depth || *max_depth > 0,
      "max_stack_depth must be positive or None, got ", max_depth.value_or(0));
  std::lock_guard<std::mutex> lock(stack_mutex_);
  max_stack_depth_ = max_depth;
}

CacheStats StepCacheStore::stats() const {
  return counters_->snapshot();
}

void StepCacheStore::reset_peak() {
  counters_->reset_peak();
}

StepCacheStore& default_store() {
  static StepCacheStore store;
  return store;
}

} // namespace cp_cache
