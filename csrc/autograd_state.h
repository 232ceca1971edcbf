#pragma once

#include <cstdint>

namespace cp_cache {

// The autograd engine's view of the calling thread. The graph task id is
// thread-local to the thread running a backward (or a checkpoint recompute
// inside it) and -1 everywhere else.
int64_t current_graph_task_id();
bool in_graph_task();
// Whether the running graph task keeps its graph (retain_graph=True);
// false outside a graph task.
bool current_graph_task_keeps_graph();
bool grad_mode_enabled();

} // namespace cp_cache
