#include <torch/extension.h>

#include <pybind11/stl.h>

#include "autograd_state.h"
#include "step_cache.h"
#include "store.h"

namespace py = pybind11;

namespace cp_cache {
namespace {

py::dict stats_to_dict(const CacheStats& stats) {
  py::dict out;
  out["live_entries"] = stats.live_entries;
  out["live_bytes"] = stats.live_bytes;
  out["peak_entries"] = stats.peak_entries;
  out["peak_bytes"] = stats.peak_bytes;
  out["created"] = stats.created;
  out["released"] = stats.released;
  out["pushed"] = stats.pushed;
  out["popped"] = stats.popped;
  out["skipped_recompute_pushes"] = stats.skipped_recompute_pushes;
  out["stack_depth"] = stats.stack_depth;
  return out;
}

py::tuple record_to_tuple(const StepRecord& record) {
  return py::make_tuple(record.tag, record.tensors);
}

} // namespace
} // namespace cp_cache

PYBIND11_MODULE(_C, m) {
  using namespace cp_cache;
  m.doc() = "cp_cache native core: step caches, their store, autograd engine state";

  py::class_<StepCache, std::shared_ptr<StepCache>>(m, "StepCache")
      .def_property_readonly("id", &StepCache::id)
      .def_property_readonly("graph_task_id", &StepCache::graph_task_id)
      .def_property_readonly("thread_id", &StepCache::thread_id)
      .def_property("pairing_key", &StepCache::pairing_key, &StepCache::set_pairing_key)
      .def_property_readonly("num_steps", &StepCache::num_steps)
      .def_property_readonly("owned_bytes", &StepCache::owned_bytes)
      .def("add_step", &StepCache::add_step, py::arg("tag"), py::arg("tensors"))
      .def("step", [](const StepCache& self, size_t index) {
        return record_to_tuple(self.step(index));
      }, py::arg("index"))
      .def_property_readonly("steps", [](const StepCache& self) {
        py::list out;
        for (const auto& record : self.steps()) {
          out.append(record_to_tuple(record));
        }
        return out;
      })
      .def("set_meta", &StepCache::set_meta, py::arg("key"), py::arg("value"))
      .def("meta", &StepCache::meta, py::arg("key"))
      .def("has_meta", &StepCache::has_meta, py::arg("key"))
      .def_property_readonly("metadata", &StepCache::metadata)
      .def("__repr__", [](const StepCache& self) {
        return "StepCache(id=" + std::to_string(self.id()) + ", steps=" +
            std::to_string(self.num_steps()) + ", bytes=" +
            std::to_string(self.owned_bytes()) + ")";
      });

  py::class_<StepCacheStore>(m, "StepCacheStore")
      .def(py::init<std::optional<int64_t>>(), py::arg("max_stack_depth") = py::none())
      .def("create", &StepCacheStore::create)
      .def("attach", &StepCacheStore::attach, py::arg("cache"))
      .def("resolve", &StepCacheStore::resolve, py::arg("handle"))
      .def("is_handle", &StepCacheStore::is_handle, py::arg("tensor"))
      .def("release", &StepCacheStore::release, py::arg("handle"))
      .def("push", &StepCacheStore::push, py::arg("cache"))
      .def("pop", &StepCacheStore::pop, py::arg("expected_key") = py::none())
      .def_property_readonly("depth", &StepCacheStore::depth)
      .def("clear", &StepCacheStore::clear)
      .def_property("max_stack_depth", &StepCacheStore::max_stack_depth,
                    &StepCacheStore::set_max_stack_depth)
      .def("stats", [](const StepCacheStore& self) { return stats_to_dict(self.stats()); })
      .def("reset_peak", &StepCacheStore::reset_peak);

  m.def("default_store", &default_store, py::return_value_policy::reference);
  m.def("current_graph_task_id", &current_graph_task_id);
  m.def("in_graph_task", &in_graph_task);
  m.def("current_graph_task_keeps_graph", &current_graph_task_keeps_graph);
  m.def("grad_mode_enabled", &grad_mode_enabled);
}
