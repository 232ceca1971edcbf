#include "autograd_state.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

namespace cp_cache {

int64_t current_graph_task_id() {
  return torch::autograd::get_current_graph_task_id();
}

bool in_graph_task() {
  return current_graph_task_id() >= 0;
}

bool current_graph_task_keeps_graph() {
  return in_graph_task() && torch::autograd::get_current_graph_task_keep_graph();
}

bool grad_mode_enabled() {
  return at::GradMode::is_enabled();
}

} // namespace cp_cache
