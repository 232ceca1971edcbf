#include <gtest/gtest.h>

#include <torch/torch.h>

#include "autograd_state.h"
#include "store.h"

namespace cp_cache {
namespace {

struct Observed {
  int64_t graph_task_id = -2;
  bool keeps_graph = false;
  bool pushed = true;
};

// Identity whose backward does what a checkpoint recompute does: it runs a
// forward (here, a push) while the engine executes a graph task.
struct PushInBackward : public torch::autograd::Function<PushInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x,
                               StepCacheStore* store, Observed* observed) {
    ctx->saved_data["store"] = reinterpret_cast<int64_t>(store);
    ctx->saved_data["observed"] = reinterpret_cast<int64_t>(observed);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* store = reinterpret_cast<StepCacheStore*>(ctx->saved_data["store"].toInt());
    auto* observed = reinterpret_cast<Observed*>(ctx->saved_data["observed"].toInt());
    observed->graph_task_id = current_graph_task_id();
    observed->keeps_graph = current_graph_task_keeps_graph();
    observed->pushed = store->push(store->create());
    return {grads[0], torch::autograd::Variable(), torch::autograd::Variable()};
  }
};

TEST(AutogradStateTest, OutsideBackward) {
  EXPECT_EQ(current_graph_task_id(), -1);
  EXPECT_FALSE(in_graph_task());
  EXPECT_FALSE(current_graph_task_keeps_graph());
  EXPECT_TRUE(grad_mode_enabled());
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(grad_mode_enabled());
}

TEST(AutogradStateTest, PushIsSkippedInsideAGraphTask) {
  StepCacheStore store;
  Observed observed;
  auto x = torch::ones({3}, torch::requires_grad());
  auto y = PushInBackward::apply(x, &store, &observed);
  EXPECT_TRUE(store.push(store.create()));  // outside: pushed
  y.sum().backward();
  EXPECT_GE(observed.graph_task_id, 0);
  EXPECT_FALSE(observed.keeps_graph);
  EXPECT_FALSE(observed.pushed);
  auto stats = store.stats();
  EXPECT_EQ(stats.skipped_recompute_pushes, 1);
  EXPECT_EQ(stats.pushed, 1);
  EXPECT_EQ(store.depth(), 1);
  EXPECT_EQ(stats.live_entries, 1);  // the skipped cache died at once

  auto y2 = PushInBackward::apply(x, &store, &observed);
  y2.sum().backward({}, /*retain_graph=*/true);
  EXPECT_TRUE(observed.keeps_graph);
  EXPECT_EQ(current_graph_task_id(), -1);
}

} // namespace
} // namespace cp_cache
