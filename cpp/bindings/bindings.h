// The parts of the kvoff._scheduler module (an internal header of cpp/bindings/): each adds its
// names to the module, and module.cpp calls them in order. Also the two Python records that
// both the manager and the scheduler bindings return.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "kvoff/key_filter.h"
#include "kvoff/offloading_manager.h"

namespace kvoff::bindings {

namespace py = pybind11;

/// What CPUOffloadingManager.prepare_store decided (the Python record PrepareStoreOutput).
struct PrepareStoreOutput {
  py::list keys_to_store;
  py::list block_ids;
  py::list evicted_keys;
  py::list skipped_keys;
};

/// A change of the pool for routers (the Python record OffloadingEvent).
struct OffloadingEvent {
  py::list keys;
  std::string medium;
  bool removed = false;
  const char* kind() const { return removed ? "BlockRemoved" : "BlockStored"; }
};

/// The core's events as Python OffloadingEvent records (keys as bytes). Needs bind_manager's
/// OffloadingEvent class.
py::list events_to_py(std::vector<kvoff::OffloadingEvent> events);

/// manager_bindings.cpp: eviction_policies(), PrepareStoreOutput, OffloadingEvent,
/// CPUOffloadingManager and the test hook _probation_ghost_set.
void bind_manager(py::module_& m);

/// scheduler_bindings.cpp: COUNTER_NAMES and _OffloadingScheduler (whose manager property
/// returns a CPUOffloadingManager: bind_manager first).
void bind_scheduler(py::module_& m);

/// fast_hooks.cpp: the _FastHooks type (before bind_scheduler, whose fast_hooks() makes one).
void bind_fast_hooks(py::module_& m);

/// key_filter_bindings.cpp: KeyFilter over a Python buffer (a node pool's shared memory).
void bind_key_filter(py::module_& m);

/// The KeyFilter a Python KeyFilter object holds. Raises TypeError for another object,
/// ValueError for a released filter.
const kvoff::KeyFilter& key_filter_of(py::handle filter);

/// node_pool_stores_bindings.cpp: NodePoolStores and NodePoolLoads (an engine's side of its
/// node pool stores and loads).
void bind_node_pool_stores(py::module_& m);

/// node_pool_manager.cpp: the C++ scheduler's manager over a Python
/// kvoff.node_pool.block_manager.NodePoolBlockManager (a node pool's client).
std::shared_ptr<kvoff::BlockManager> node_pool_manager(py::object manager);

/// A _FastHooks object over `owner`, an _OffloadingScheduler (kept alive by the hooks).
py::object make_fast_hooks(py::object owner);

}  // namespace kvoff::bindings
