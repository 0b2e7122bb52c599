// kvoff._scheduler: the Python face of the C++ scheduler core (pybind11; it includes no
// torch header). This file only defines the module; its parts are in this folder:
//   convert.h/.cpp             keys, ints, request ids and lists between Python and C++
//   manager_bindings.cpp       CPUOffloadingManager, PrepareStoreOutput, OffloadingEvent
//   scheduler_hooks.h/.cpp     an engine step's arguments parsed for the scheduler's hooks
//   scheduler_bindings.cpp     _OffloadingScheduler, COUNTER_NAMES
//   fast_hooks.cpp             _FastHooks: the per-step hooks as plain CPython methods
//   node_pool_manager.cpp      the scheduler's manager over a node pool's Python client
//   key_filter_bindings.cpp    KeyFilter: a node pool's key filter in shared memory
//   node_pool_stores_bindings.cpp  NodePoolStores, NodePoolLoads: an engine's side of its
//                                  node pool stores and loads
// Keys cross the boundary as bytes (ints are accepted and converted to 8 little-endian bytes);
// C++ exceptions become ValueError (std::invalid_argument) and IndexError (std::out_of_range).
#include <pybind11/pybind11.h>

#include "bindings.h"

namespace py = pybind11;

namespace {

constexpr const char* kModuleDoc = R"doc(kvoff's scheduler core (C++): the CPU block pool and its offloading manager.

Keys name offloaded blocks: ``bytes`` of any non-empty length, or ``int`` (converted to 8
little-endian bytes: [-2**63, 2**63) as two's complement, [2**63, 2**64) unsigned). Keys come
back as ``bytes``. CPU block ids are ints in [0, num_blocks).
)doc";

}  // namespace

PYBIND11_MODULE(_scheduler, m) {
  py::options options;  // in force while the parts below add their names
  options.disable_function_signatures();  // signatures are written in the docstrings
  m.doc() = kModuleDoc;
  kvoff::bindings::bind_manager(m);     // eviction_policies, the manager and its records
  kvoff::bindings::bind_fast_hooks(m);  // _FastHooks, made by _OffloadingScheduler.fast_hooks
  kvoff::bindings::bind_scheduler(m);   // COUNTER_NAMES, _OffloadingScheduler
  kvoff::bindings::bind_key_filter(m);  // KeyFilter
  kvoff::bindings::bind_node_pool_stores(m);  // NodePoolStores, NodePoolLoads
}
