#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "step_cache.h"
#include "store.h"

namespace cp_cache {
namespace {

at::Tensor seed_tensor(int64_t value) {
  return at::full({1}, value, at::TensorOptions().dtype(at::kLong));
}

TEST(StepCacheTest, CountsEachStorageOnce) {
  StepCacheStore store;
  auto cache = store.create();
  auto big = at::zeros({100}, at::kFloat);  // 400 bytes
  cache->add_step("full", {big, big.narrow(0, 0, 10), seed_tensor(1)});
  EXPECT_EQ(cache->owned_bytes(), 400 + 8);
  cache->add_step("causal", {big});
  EXPECT_EQ(cache->owned_bytes(), 408);
  EXPECT_EQ(store.stats().live_bytes, 408);
  EXPECT_EQ(cache->num_steps(), 2u);
  EXPECT_EQ(cache->step(1).tag, "causal");
  EXPECT_THROW(cache->step(2), c10::IndexError);
  cache.reset();
  EXPECT_EQ(store.stats().live_bytes, 0);
  EXPECT_EQ(store.stats().live_entries, 0);
}

TEST(StepCacheTest, MetadataRoundTrip) {
  StepCacheStore store;
  auto cache = store.create();
  cache->set_meta("causal", true);
  cache->set_meta("world_size", int64_t{4});
  cache->set_meta("scale", 0.125);
  cache->set_meta("layout", std::string("BNSD"));
  EXPECT_EQ(std::get<bool>(cache->meta("causal")), true);
  EXPECT_EQ(std::get<int64_t>(cache->meta("world_size")), 4);
  EXPECT_DOUBLE_EQ(std::get<double>(cache->meta("scale")), 0.125);
  EXPECT_EQ(std::get<std::string>(cache->meta("layout")), "BNSD");
  EXPECT_FALSE(cache->has_meta("keep_prob"));
  EXPECT_THROW(cache->meta("keep_prob"), c10::ValueError);
}

TEST(HandleTest, CacheLivesExactlyAsLongAsTheStorage) {
  StepCacheStore store;
  auto owned = seed_tensor(42);
  auto cache = store.create();
  cache->add_step("full", {owned});
  EXPECT_EQ(owned.use_count(), 2);
  const uint64_t id = cache->id();
  at::Tensor handle = store.attach(std::move(cache));
  EXPECT_EQ(handle.item<int64_t>(), static_cast<int64_t>(id));
  EXPECT_EQ(handle.scalar_type(), at::kLong);
  EXPECT_EQ(handle.sizes(), at::IntArrayRef({1}));

  at::Tensor shallow = handle.detach();  // new TensorImpl, same storage
  at::Tensor view = handle.view({1});
  handle.reset();
  EXPECT_EQ(store.stats().live_entries, 1);
  EXPECT_EQ(store.resolve(shallow)->id(), id);
  EXPECT_EQ(store.resolve(view)->id(), id);
  shallow.reset();
  EXPECT_EQ(store.stats().live_entries, 1);
  view.reset();
  EXPECT_EQ(store.stats().live_entries, 0);
  EXPECT_EQ(store.stats().released, 1);
  EXPECT_EQ(owned.use_count(), 1);  // the cache let go of its tensor
}

TEST(HandleTest, ForeignTensorsAreRefused) {
  StepCacheStore store;
  StepCacheStore other;
  at::Tensor handle = store.attach(store.create());
  EXPECT_TRUE(store.is_handle(handle));

  EXPECT_THROW(store.resolve(seed_tensor(1)), c10::Error);          // forged
  EXPECT_THROW(store.resolve(handle.clone()), c10::Error);          // copied
  EXPECT_THROW(store.resolve(at::Tensor()), c10::Error);            // undefined
  EXPECT_THROW(store.resolve(at::empty({0}, at::kLong)), c10::Error);
  EXPECT_THROW(other.resolve(handle), c10::Error);                  // other store
  EXPECT_FALSE(other.is_handle(handle));
  EXPECT_FALSE(store.is_handle(handle.clone()));
  try {
    store.resolve(handle.clone());
    FAIL() << "resolve of a copy did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("saved-tensor hook"), std::string::npos);
  }
}

TEST(HandleTest, ReleasedHandleHasExpired) {
  StepCacheStore store;
  at::Tensor handle = store.attach(store.create());
  EXPECT_TRUE(store.release(handle));
  EXPECT_EQ(store.stats().live_entries, 0);
  try {
    store.resolve(handle);
    FAIL() << "resolve of an expired handle did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expired"), std::string::npos);
  }
  EXPECT_THROW(store.release(handle), c10::Error);
}

TEST(StackTest, LifoWithIdCheck) {
  StepCacheStore store;
  auto first = store.create();
  auto second = store.create();
  const uint64_t first_id = first->id();
  const uint64_t second_id = second->id();
  EXPECT_TRUE(store.push(first));
  EXPECT_TRUE(store.push(second));
  first.reset();
  second.reset();
  EXPECT_EQ(store.depth(), 2);
  EXPECT_EQ(store.stats().stack_depth, 2);
  EXPECT_EQ(store.stats().live_entries, 2);

  // Backward of the first forward runs first: mis-pairing is detected and
  // the stack is left as it was.
  EXPECT_THROW(store.pop(first_id), c10::Error);
  EXPECT_EQ(store.depth(), 2);
  EXPECT_EQ(store.pop(second_id)->id(), second_id);
  EXPECT_EQ(store.pop()->id(), first_id);
  EXPECT_EQ(store.stats().live_entries, 0);

  auto keyed = store.create();
  keyed->set_pairing_key(77);
  EXPECT_TRUE(store.push(keyed));
  EXPECT_THROW(store.pop(keyed->id()), c10::Error);
  EXPECT_EQ(store.pop(77), keyed);
  keyed.reset();
  EXPECT_THROW(store.pop(), c10::Error);
  const auto stats = store.stats();
  EXPECT_EQ(stats.pushed, 3);
  EXPECT_EQ(stats.popped, 3);
  EXPECT_EQ(stats.stack_depth, 0);
}

TEST(StackTest, ClearReportsAndDepthLimit) {
  StepCacheStore store(2);
  EXPECT_TRUE(store.push(store.create()));
  EXPECT_TRUE(store.push(store.create()));
  try {
    store.push(store.create());
    FAIL() << "push past the depth limit did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("depth 2, limit 2"), std::string::npos);
  }
  EXPECT_EQ(store.clear(), 2);
  EXPECT_EQ(store.depth(), 0);
  EXPECT_EQ(store.stats().live_entries, 0);
  EXPECT_THROW(StepCacheStore(0), c10::ValueError);
}

TEST(StatsTest, PeakAndReset) {
  StepCacheStore store;
  {
    auto a = store.create();
    a->add_step("full", {at::zeros({4}, at::kFloat)});
    auto b = store.create();
    b->add_step("full", {at::zeros({2}, at::kFloat)});
  }
  auto stats = store.stats();
  EXPECT_EQ(stats.peak_entries, 2);
  EXPECT_EQ(stats.peak_bytes, 24);
  EXPECT_EQ(stats.live_entries, 0);
  store.reset_peak();
  stats = store.stats();
  EXPECT_EQ(stats.peak_entries, 0);
  EXPECT_EQ(stats.peak_bytes, 0);
  EXPECT_EQ(stats.created, 2);
  EXPECT_EQ(stats.released, 2);
}

// 8 threads x 100k mixed operations: attach/resolve/drop handles, push/pop,
// with handles released on threads other than their creator.
TEST(StressTest, CountersStayExactUnderConcurrency) {
  StepCacheStore store;
  constexpr int kThreads = 8;
  constexpr int kOpsPerThread = 100000;
  std::mutex shared_mutex;
  std::vector<at::Tensor> shared_handles;  // handed between threads
  std::atomic<int64_t> pushes{0};
  std::atomic<int64_t> pops{0};
  std::atomic<int64_t> creates{0};

  auto worker = [&](int seed) {
    std::mt19937 rng(seed);
    std::vector<at::Tensor> mine;
    for (int op = 0; op < kOpsPerThread; ++op) {
      switch (rng() % 5) {
        case 0: {
          auto cache = store.create();
          ++creates;
          mine.push_back(store.attach(std::move(cache)));
          break;
        }
        case 1:
          if (!mine.empty()) {
            EXPECT_EQ(store.resolve(mine.back())->id(),
                      static_cast<uint64_t>(mine.back().data_ptr<int64_t>()[0]));
            std::lock_guard<std::mutex> lock(shared_mutex);
            shared_handles.push_back(std::move(mine.back()));
            mine.pop_back();
          }
          break;
        case 2: {
          at::Tensor taken;
          {
            std::lock_guard<std::mutex> lock(shared_mutex);
            if (!shared_handles.empty()) {
              taken = std::move(shared_handles.back());
              shared_handles.pop_back();
            }
          }
          // `taken` dies here, on this thread: its cache is released.
          break;
        }
        case 3: {
          auto cache = store.create();
          ++creates;
          if (store.push(std::move(cache))) {
            ++pushes;
          }
          break;
        }
        case 4:
          try {
            store.pop();
            ++pops;
          } catch (const c10::Error&) {
            // empty stack: another thread popped first
          }
          break;
      }
    }
  };

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back(worker, t + 1);
  }
  for (auto& thread : threads) {
    thread.join();
  }
  const int64_t on_stack = pushes.load() - pops.load();
  EXPECT_EQ(store.depth(), on_stack);
  auto stats = store.stats();
  EXPECT_EQ(stats.pushed, pushes.load());
  EXPECT_EQ(stats.popped, pops.load());
  EXPECT_EQ(stats.created, creates.load());
  EXPECT_EQ(stats.live_entries,
            on_stack + static_cast<int64_t>(shared_handles.size()));
  EXPECT_EQ(stats.created - stats.released, stats.live_entries);

  shared_handles.clear();
  EXPECT_EQ(store.clear(), on_stack);
  stats = store.stats();
  EXPECT_EQ(stats.live_entries, 0);
  EXPECT_EQ(stats.live_bytes, 0);
  EXPECT_EQ(stats.created, stats.released);
  EXPECT_EQ(stats.stack_depth, 0);
}

} // namespace
} // namespace cp_cache
