// kvoff._scheduler, the manager's part: CPUOffloadingManager (the CPU pool and its eviction
// policy), its two records PrepareStoreOutput and OffloadingEvent, eviction_policies() and
// the policy test hook _probation_ghost_set. Argument conversion lives in convert.h; the
// module definition in module.cpp.
#include <pybind11/pybind11.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "kvoff/eviction_policy.h"
#include "kvoff/offloading_manager.h"

namespace kvoff::bindings {

namespace {

/// Runs `f` without the GIL, for calls that wait (write-through). Not py::gil_scoped_release:
/// its destructor re-takes the GIL, and a daemon thread that does so while the interpreter
/// finalizes is unwound by pthread_exit through that noexcept destructor, which aborts the
/// process. Here a thread that comes back during finalization never takes the GIL again (as
/// Python 3.14 itself does), and otherwise re-takes it outside any destructor.
template <typename F>
auto without_gil(F&& f) {
  PyThreadState* state = PyEval_SaveThread();
  const auto retake = [state] {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing() != 0;
#else
    const bool finalizing = _Py_IsFinalizing() != 0;
#endif
    while (finalizing) {
      std::this_thread::sleep_for(std::chrono::hours(1));  // the process is exiting
    }
    PyEval_RestoreThread(state);
  };
  try {
    auto result = f();
    retake();
    return result;
  } catch (...) {  // e.g. std::bad_alloc: back to Python with the GIL, then raise
    retake();
    throw;
  }
}

std::string list_repr(const py::list& l) { return py::repr(l).cast<std::string>(); }

// ------------------------------------------------------------------------- docstrings

constexpr const char* kManagerDoc = R"doc(CPUOffloadingManager(num_blocks: int, eviction_policy: str = "lru", enable_events: bool = False, store_threshold: int = 0, max_tracker_size: int = 64000)

Tracks which offloaded blocks a CPU pool of ``num_blocks`` slots holds and evicts by policy.

A key is *missing*, *pending* (``prepare_store`` gave it a slot; bytes being written; never a
lookup hit) or *ready* (``complete_store(success=True)`` ran; a lookup hit). Ready blocks being
loaded (between ``prepare_load`` and ``complete_load``) are pinned and never evicted; pending
blocks are never evicted either.

Guarantees: ``prepare_store`` is all-or-nothing (None changes no state); keys of one
``prepare_store`` call are never evicted for each other; every method validates its whole
batch before changing anything (an exception leaves the manager unchanged); ``touch`` and
``prepare_store`` leave ``keys[0]`` the most recent, so a prefix's tail is evicted before its
head. O(1) per key. Not thread-safe.

Store admission (``store_threshold`` >= 2, vLLM's ``store_threshold``/``max_tracker_size``): a
key that is not held is stored only once it was offered to ``prepare_store`` at least
``store_threshold`` times (each occurrence in a successful call is one offer; ``lookup`` counts
nothing). A tracker of at most ``max_tracker_size`` keys counts the offers and forgets the least
recently offered key that is not a key of the call. Keys offered too few times are skipped
(``PrepareStoreOutput.skipped_keys``, ``stores_skipped``): no slot, no event, still missing.
Held keys are never skipped. Unlike vLLM, a ``prepare_store`` that returns None counts no offer
(it changes nothing; callers retry it), and the tracker orders ``keys[0]`` most recent (a
prefix's tail is forgotten first).

Args:
    num_blocks (int): pool size in CPU blocks (slots), 1 .. 2**31-1.
    eviction_policy (str): a name from ``eviction_policies()``: "lru" (the default), "arc" or
        "probation" (docs/eviction-policies.md).
    enable_events (bool): record ``OffloadingEvent``s for ``take_events()``.
    store_threshold (int): offers before a key is stored, 0 .. 2**20 (0 or 1: no filter, no
        tracker; the default 0).
    max_tracker_size (int): keys the tracker holds at most, 1 .. 2**31-1 (default 64000; about
        104 bytes each; unused while store_threshold < 2, where 0 is accepted too).

Raises:
    ValueError: num_blocks, store_threshold or max_tracker_size out of range (naming the value
        and the range), or an unknown eviction_policy (listing the choices).
    TypeError: num_blocks, store_threshold or max_tracker_size is not an int.
    MemoryError: the host cannot hold the pool's index and policy (about 110 bytes per block,
        more with "arc" or "probation"): refused before allocating when they exceed physical
        memory (or the cgroup limit), or when an allocation fails. The message names
        num_blocks, the bytes needed and the fix (a smaller cpu_bytes_to_use); nothing stays
        allocated.
)doc";

constexpr const char* kKeysNote = R"doc(
    keys (Sequence[bytes | int]): a list or tuple (any ordered sequence) of keys.

Raises:
    TypeError: keys is not an ordered sequence, or a key is neither bytes nor int (naming it).
    ValueError: a key is b'' or an int outside [-2**63, 2**64) (naming it).)doc";

std::string doc(const char* head, const char* tail = "") {
  return std::string(head) + "\n\nArgs:" + kKeysNote + tail;
}

/// `obj` as CPU block ids (slots), for `op`; ValueError naming the first that is not one.
std::vector<std::uint32_t> slot_ids(py::handle obj, const char* op, const char* fix) {
  const std::vector<std::int64_t> given = to_ints(obj.ptr(), Where{"block_ids"});
  std::vector<std::uint32_t> ids(given.size());
  for (std::size_t i = 0; i < given.size(); ++i) {
    if (given[i] < 0 || given[i] > 0xFFFFFFFFLL) {
      throw std::invalid_argument(std::string(op) + ": block_ids[" + std::to_string(i) +
                                  "] = " + std::to_string(given[i]) +
                                  " is not a CPU block id; " + fix + ". Nothing was changed.");
    }
    ids[i] = static_cast<std::uint32_t>(given[i]);
  }
  return ids;
}

}  // namespace

py::list events_to_py(std::vector<kvoff::OffloadingEvent> events) {
  py::list out(events.size());
  for (std::size_t i = 0; i < events.size(); ++i) {
    out[i] = py::cast(OffloadingEvent{to_bytes_list(events[i].keys), std::move(events[i].medium),
                                      events[i].removed});
  }
  return out;
}

void bind_manager(py::module_& m) {
  using kvoff::CPUOffloadingManager;

  m.def(
      "eviction_policies",
      [] {
        py::list out;
        for (const auto& name : kvoff::eviction_policy_names()) {
          out.append(py::str(name));
        }
        return out;
      },
        py::doc("eviction_policies() -> list[str]\n\n"
                "Names accepted by CPUOffloadingManager(eviction_policy=...), from the C++ "
                "policy registry, in registration order: ['lru', 'arc', 'probation']."));

  // ---- PrepareStoreOutput
  py::class_<PrepareStoreOutput>(
      m, "PrepareStoreOutput",
      ("PrepareStoreOutput(keys_to_store: Sequence[bytes | int], block_ids: "
              "Sequence[int], evicted_keys: Sequence[bytes | int] = (), skipped_keys: "
              "Sequence[bytes | int] = ())\n\n"
              "What CPUOffloadingManager.prepare_store decided.\n\n"
              "Attributes:\n"
              "    keys_to_store (list[bytes]): keys of the call that were not held and are "
              "stored now, deduplicated, in call order: copy these blocks GPU->CPU.\n"
              "    block_ids (list[int]): the CPU block id (slot) given to each of "
              "keys_to_store, same order.\n"
              "    evicted_keys (list[bytes]): keys evicted to make room, in eviction order.\n"
              "    skipped_keys (list[bytes]): keys of the call that were not held and that "
              "the store_threshold filter skipped (offered too few times), deduplicated, in "
              "call order: not stored, no slot (always empty without the filter). Every key "
              "of the call is held already, in keys_to_store or in skipped_keys.\n\n"
              "Raises:\n"
              "    TypeError: a key that is neither bytes nor int, or a block id that is not "
              "an int.\n"
              "    ValueError: an empty key, or len(keys_to_store) != len(block_ids) (naming "
              "both lengths)."))
      .def(py::init([](py::handle keys_to_store, py::handle block_ids, py::handle evicted_keys,
                       py::handle skipped_keys) {
             PrepareStoreOutput out{normalized_keys(keys_to_store), normalized_ids(block_ids),
                                    normalized_keys(evicted_keys), normalized_keys(skipped_keys)};
             if (out.keys_to_store.size() != out.block_ids.size()) {
               throw py::value_error(
                   "PrepareStoreOutput: len(keys_to_store) = " +
                   std::to_string(out.keys_to_store.size()) + " but len(block_ids) = " +
                   std::to_string(out.block_ids.size()) +
                   "; pass one CPU block id (slot) per key to store, in the same order");
             }
             return out;
           }),
           py::arg("keys_to_store"), py::arg("block_ids"), py::arg("evicted_keys") = py::tuple(),
           py::arg("skipped_keys") = py::tuple(),
           py::doc("__init__(self, keys_to_store: Sequence[bytes | int], block_ids: "
                   "Sequence[int], evicted_keys: Sequence[bytes | int] = (), skipped_keys: "
                   "Sequence[bytes | int] = ()) -> None\n\n"
                   "Raises:\n"
                   "    TypeError: a key that is neither bytes nor int, or a block id that is "
                   "not an int.\n"
                   "    ValueError: an empty key, or len(keys_to_store) != len(block_ids) "
                   "(naming both lengths)."))
      .def_readonly("keys_to_store", &PrepareStoreOutput::keys_to_store,
                    py::doc("list[bytes]: keys to copy, in call order."))
      .def_readonly("block_ids", &PrepareStoreOutput::block_ids,
                    py::doc("list[int]: CPU block id of each of keys_to_store."))
      .def_readonly("evicted_keys", &PrepareStoreOutput::evicted_keys,
                    py::doc("list[bytes]: keys evicted to make room, in eviction order."))
      .def_readonly("skipped_keys", &PrepareStoreOutput::skipped_keys,
                    py::doc("list[bytes]: keys not held that the store_threshold filter "
                            "skipped (not stored), in call order."))
      .def("__eq__",
           [](const PrepareStoreOutput& a, py::object other) -> py::object {
             if (!py::isinstance<PrepareStoreOutput>(other)) {
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             }
             const auto& b = other.cast<const PrepareStoreOutput&>();
             return py::bool_(a.keys_to_store.equal(b.keys_to_store) &&
                              a.block_ids.equal(b.block_ids) &&
                              a.evicted_keys.equal(b.evicted_keys) &&
                              a.skipped_keys.equal(b.skipped_keys));
           })
      .def("__repr__", [](const PrepareStoreOutput& o) {
        return "PrepareStoreOutput(keys_to_store=" + list_repr(o.keys_to_store) +
               ", block_ids=" + list_repr(o.block_ids) +
               ", evicted_keys=" + list_repr(o.evicted_keys) +
               (o.skipped_keys.empty() ? "" : ", skipped_keys=" + list_repr(o.skipped_keys)) +
               ")";
      });
  m.attr("PrepareStoreOutput").attr("__hash__") = py::none();

  // ---- OffloadingEvent
  py::class_<OffloadingEvent>(
      m, "OffloadingEvent",
      ("OffloadingEvent(keys: Sequence[bytes | int], medium: str = \"CPU\", removed: "
              "bool = False)\n\n"
              "A change of the pool for routers (KV events), from "
              "CPUOffloadingManager.take_events().\n\n"
              "Attributes:\n"
              "    keys (list[bytes]): the keys concerned, in operation order.\n"
              "    medium (str): where the blocks live (\"CPU\").\n"
              "    removed (bool): False for BlockStored (keys became lookup hits), True for "
              "BlockRemoved (keys were evicted).\n"
              "    kind (str): \"BlockStored\" or \"BlockRemoved\"."))
      .def(py::init([](py::handle keys, std::string medium, py::handle removed) {
             return OffloadingEvent{normalized_keys(keys), std::move(medium),
                                    to_bool(removed, "removed")};
           }),
           py::arg("keys"), py::arg("medium") = "CPU", py::arg("removed") = false,
           py::doc("__init__(self, keys: Sequence[bytes | int], medium: str = \"CPU\", "
                   "removed: bool = False) -> None"))
      .def_readonly("keys", &OffloadingEvent::keys,
                    py::doc("list[bytes]: the keys concerned, in operation order."))
      .def_readonly("medium", &OffloadingEvent::medium,
                    py::doc("str: where the blocks live (\"CPU\")."))
      .def_readonly("removed", &OffloadingEvent::removed,
                    py::doc("bool: True for BlockRemoved, False for BlockStored."))
      .def_property_readonly("kind", &OffloadingEvent::kind,
                             py::doc("str: \"BlockStored\" or \"BlockRemoved\"."))
      .def("__eq__",
           [](const OffloadingEvent& a, py::object other) -> py::object {
             if (!py::isinstance<OffloadingEvent>(other)) {
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             }
             const auto& b = other.cast<const OffloadingEvent&>();
             return py::bool_(a.keys.equal(b.keys) && a.medium == b.medium &&
                              a.removed == b.removed);
           })
      .def("__repr__", [](const OffloadingEvent& e) {
        return std::string("OffloadingEvent(keys=") + list_repr(e.keys) + ", medium=" +
               py::repr(py::str(e.medium)).cast<std::string>() +
               ", removed=" + (e.removed ? "True" : "False") + ")";
      });
  m.attr("OffloadingEvent").attr("__hash__") = py::none();

  // ---- CPUOffloadingManager
  py::class_<CPUOffloadingManager>(m, "CPUOffloadingManager", kManagerDoc)
      .def(py::init([](py::handle num_blocks, const std::string& eviction_policy,
                       py::handle enable_events, py::handle store_threshold,
                       py::handle max_tracker_size) {
             const std::int64_t n = to_num_blocks(num_blocks);
             const std::int64_t threshold =
                 to_int_arg(store_threshold, "store_threshold", "0 (off) or 2..2**20");
             const std::int64_t tracker =
                 to_int_arg(max_tracker_size, "max_tracker_size", "1..2**31-1 keys");
             const bool events = to_bool(enable_events, "enable_events");
             return std::make_unique<CPUOffloadingManager>(n, eviction_policy, events, threshold,
                                                           tracker);
           }),
           py::arg("num_blocks"), py::arg("eviction_policy") = "lru",
           py::arg("enable_events") = false, py::arg("store_threshold") = 0,
           py::arg("max_tracker_size") = CPUOffloadingManager::kDefaultMaxTrackerSize,
           py::doc("__init__(self, num_blocks: int, eviction_policy: str = \"lru\", "
                   "enable_events: bool = False, store_threshold: int = 0, "
                   "max_tracker_size: int = 64000) -> None\n\nSee the class docstring."))
      .def(
          "lookup",
          [](const CPUOffloadingManager& self, py::handle keys) -> py::object {
            KeyBatch batch(keys);
            const auto hits = self.lookup(batch.span());
            if (!hits) {
              return py::none();
            }
            return py::int_(*hits);
          },
          py::arg("keys"),
          py::doc(doc("lookup(self, keys: Sequence[bytes | int]) -> int | None\n\n"
                      "How many leading keys are ready (lookup hits): counts from keys[0] and "
                      "stops at the first missing key. Returns None (\"retry later\") when a key "
                      "before the first missing one is still pending (being stored). Changes "
                      "nothing (no recency update: call touch).")
                      .c_str()))
      .def(
          "prepare_load",
          [](CPUOffloadingManager& self, py::handle keys) {
            KeyBatch batch(keys);
            return to_int_list(self.prepare_load(batch.span()));
          },
          py::arg("keys"),
          py::doc(doc("prepare_load(self, keys: Sequence[bytes | int]) -> list[int]\n\n"
                      "Pins the keys (reference count +1 per occurrence) so they are not "
                      "evicted until complete_load, and returns their CPU block ids in call "
                      "order.",
                      "\n    ValueError: a key is not ready (missing or pending), naming it in "
                      "hex and its state; nothing is pinned.")
                      .c_str()))
      .def(
          "complete_load",
          [](CPUOffloadingManager& self, py::handle keys) {
            KeyBatch batch(keys);
            self.complete_load(batch.span());
          },
          py::arg("keys"),
          py::doc(doc("complete_load(self, keys: Sequence[bytes | int]) -> None\n\n"
                      "Unpins the keys of a finished load (once per occurrence).",
                      "\n    ValueError: a key is not being loaded (as often as it occurs), "
                      "naming it in hex; nothing is unpinned.")
                      .c_str()))
      .def(
          "touch",
          [](CPUOffloadingManager& self, py::handle keys, py::handle reused) {
            KeyBatch batch(keys);
            if (reused.is_none()) {
              self.touch(batch.span());
              return;
            }
            std::vector<std::uint8_t> flags;
            flags.reserve(batch.span().size());
            for (py::handle f : reused) {
              if (!PyBool_Check(f.ptr())) {
                throw py::type_error("touch: reused must hold bools, got " +
                                     std::string(py::str(py::type::of(f).attr("__name__"))));
              }
              flags.push_back(f.ptr() == Py_True ? 1 : 0);
            }
            self.touch(batch.span(), flags);
          },
          py::arg("keys"), py::arg("reused") = py::none(),
          py::doc(doc("touch(self, keys: Sequence[bytes | int], reused: Sequence[bool] | None "
                      "= None) -> None\n\n"
                      "Marks held keys (ready or pending) most recently used, last to first, so "
                      "keys[0] ends the most recent: a prefix's tail is evicted before its head. "
                      "A ready key's use is a reuse (ARC promotes it, the probation policy "
                      "protects it); a pending key is being stored by the caller, so its use only "
                      "orders it. With reused (one bool per key), a ready key whose flag is False "
                      "is ordered only, not a reuse (a block the request stored itself, applied "
                      "when it finishes). Keys not held are ignored. Raises ValueError when "
                      "reused has another length than keys, TypeError for a flag that is not a "
                      "bool; nothing changes then.")
                      .c_str()))
      .def(
          "prepare_store",
          [](CPUOffloadingManager& self, py::handle keys,
             py::handle apply_threshold) -> py::object {
            const bool threshold = to_bool(apply_threshold, "apply_threshold");
            KeyBatch batch(keys);
            auto result = self.prepare_store(batch.span(), threshold);
            if (!result) {
              return py::none();
            }
            return py::cast(PrepareStoreOutput{batch.items_as_bytes(result->store_indices),
                                               to_int_list(result->block_ids),
                                               to_bytes_list(result->evicted_keys),
                                               batch.items_as_bytes(result->skipped_indices)});
          },
          py::arg("keys"), py::arg("apply_threshold") = true,
          py::doc(doc("prepare_store(self, keys: Sequence[bytes | int], apply_threshold: bool = "
                      "True) -> PrepareStoreOutput | None\n\n"
                      "Gives each key not yet held (deduplicated, in call order) a CPU slot; the "
                      "new blocks are pending (not lookup hits) until complete_store. If the "
                      "free slots are too few, evicts ready, unpinned blocks that are not keys "
                      "of this call, in policy order (a BlockRemoved event lists them). New "
                      "blocks become the most recent, keys[0] the most recent of them; keys "
                      "already held are left as they are.\n\n"
                      "With store_threshold >= 2, keys not held that were offered fewer than "
                      "store_threshold times (this call included) are skipped first "
                      "(skipped_keys) and need no slot; the call's offers are counted only when "
                      "it succeeds. apply_threshold=False: the filter neither counts nor skips "
                      "these keys (promotions from a secondary tier).\n\n"
                      "Returns None, changing nothing (no eviction, no event, no offer counted), "
                      "when the free slots plus evictable blocks are fewer than the keys to "
                      "store: retry later.")
                      .c_str()))
      .def(
          "complete_store",
          [](CPUOffloadingManager& self, py::handle keys, py::handle success,
             py::handle write_through) {
            const bool ok = to_bool(success, "success");
            const bool through = to_bool(write_through, "write_through");
            KeyBatch batch(keys);
            self.complete_store(batch.span(), ok, through);
          },
          py::arg("keys"), py::arg("success") = true, py::arg("write_through") = true,
          py::doc(doc("complete_store(self, keys: Sequence[bytes | int], success: bool = True, "
                      "write_through: bool = True) -> None\n\n"
                      "Finishes the stores of pending keys. success=True: they become ready "
                      "(lookup hits) and a BlockStored event lists them; with write_through "
                      "(and set_write_through on) they are also pinned and queued for the "
                      "secondary tiers (take_write_through), or counted as dropped when the "
                      "queue is full. success=False: they are dropped and their slots freed "
                      "(never a hit). A repeated key is finished once.",
                      "\n    ValueError: a key is not pending (missing or already ready), naming "
                      "it in hex and its state; nothing is changed.")
                      .c_str()))
      .def(
          "reserve_blocks",
          [](CPUOffloadingManager& self, std::int64_t count) -> py::object {
            if (count < 0 || count > static_cast<std::int64_t>(self.num_blocks())) {
              throw std::invalid_argument(
                  "reserve_blocks: count=" + std::to_string(count) + " is outside [0, " +
                  std::to_string(self.num_blocks()) + "] (the pool's blocks); nothing changed");
            }
            PrepareStoreResult result;
            if (!self.reserve_blocks(static_cast<std::uint32_t>(count), result)) {
              return py::none();
            }
            return py::make_tuple(to_int_list(result.block_ids),
                                  to_bytes_list(result.evicted_keys));
          },
          py::arg("count"),
          py::doc("reserve_blocks(self, count: int) -> tuple[list[int], list[bytes]] | None\n\n"
                  "Reserves count slots for later stores (store_reserved): free slots first, "
                  "then slots of ready, unpinned blocks evicted in policy order (a BlockRemoved "
                  "event lists them). A reserved slot is held by no key: not a hit, not "
                  "evictable, not free (num_reserved_blocks). Returns (the slots, the evicted "
                  "keys), or None, changing nothing, when free plus evictable blocks are fewer "
                  "than count.\n\nRaises:\n    ValueError: count is negative or above "
                  "num_blocks; nothing is changed."))
      .def(
          "store_reserved",
          [](CPUOffloadingManager& self, py::handle keys, py::handle block_ids) {
            KeyBatch batch(keys);
            const std::vector<std::uint32_t> ids =
                slot_ids(block_ids, "store_reserved", "pass slots reserve_blocks gave");
            return to_int_list(self.store_reserved(batch.span(), ids));
          },
          py::arg("keys"), py::arg("block_ids"),
          py::doc(doc("store_reserved(self, keys: Sequence[bytes | int], block_ids: "
                      "Sequence[int]) -> list[int]\n\n"
                      "Gives keys[i] the reserved slot block_ids[i], pending (not a hit) until "
                      "complete_store, as prepare_store gives a new key a slot, keys[0] the most "
                      "recent of them; no admission filter, no eviction. A key held already, or "
                      "repeating an earlier key of the call, is not stored and its slot stays "
                      "reserved. Returns the positions of the keys stored, ascending.",
                      "\n    ValueError: the lengths differ, a key is empty, or a slot is not "
                      "reserved or repeats (naming it); nothing is changed.")
                      .c_str()))
      .def(
          "release_reserved",
          [](CPUOffloadingManager& self, py::handle block_ids) {
            self.release_reserved(
                slot_ids(block_ids, "release_reserved", "pass slots reserve_blocks gave"));
          },
          py::arg("block_ids"),
          py::doc("release_reserved(self, block_ids: Sequence[int]) -> None\n\n"
                  "Frees reserved slots that will not be stored into.\n\nRaises:\n"
                  "    ValueError: a slot is not reserved or repeats (naming it); nothing is "
                  "changed."))
      .def("is_reserved", &CPUOffloadingManager::is_reserved, py::arg("block_id"),
           py::doc("is_reserved(self, block_id: int) -> bool\n\nWhether the slot is reserved "
                   "(reserve_blocks) and not yet stored into or released; False outside "
                   "[0, num_blocks)."))
      .def_property_readonly("num_reserved_blocks", &CPUOffloadingManager::num_reserved_blocks,
                             py::doc("int: slots reserve_blocks reserved that are not stored "
                                     "into or released yet."))
      .def("set_write_through", &CPUOffloadingManager::set_write_through,
           py::arg("capacity_blocks"),
           py::doc("set_write_through(self, capacity_blocks: int) -> None\n\n"
                   "Write-through to secondary tiers (kvoff.tiers): with capacity_blocks > 0, "
                   "each block that complete_store(write_through=True) makes ready is pinned "
                   "(never evicted while tiers read its slot) and queued for "
                   "take_write_through, while at most capacity_blocks blocks are queued or "
                   "being written; the rest are dropped and counted (write_through_dropped), "
                   "never waited for. 0 turns it off for later stores. The engine thread pays "
                   "one pin per block and nothing else. Engine thread."))
      .def_property_readonly("write_through_capacity",
                             &CPUOffloadingManager::write_through_capacity,
                             py::doc("int: set_write_through's capacity in blocks (0: off)."))
      .def(
          "take_write_through",
          [](CPUOffloadingManager& self, double timeout) {
            std::vector<kvoff::WriteThroughBatch> batches =
                without_gil([&] { return self.take_write_through(timeout); });
            py::list out(batches.size());
            for (std::size_t i = 0; i < batches.size(); ++i) {
              py::list ids(batches[i].block_ids.size());
              for (std::size_t j = 0; j < batches[i].block_ids.size(); ++j) {
                ids[j] = py::int_(batches[i].block_ids[j]);
              }
              out[i] = py::make_tuple(to_bytes_list(batches[i].keys), ids);
            }
            return out;
          },
          py::arg("timeout") = 0.0,
          py::doc("take_write_through(self, timeout: float = 0.0) -> list[tuple[list[bytes], "
                  "list[int]]]\n\n"
                  "Any thread (a tier writer; the GIL is released while waiting): the batches "
                  "queued since the last call, oldest first, as (keys, block_ids) with keys[i] "
                  "in CPU block block_ids[i]; waits up to timeout seconds for one (0: not at "
                  "all; 1e6 or more, inf included: until a batch comes or close_write_through "
                  "runs). [] on timeout or after close_write_through. Hand each block back once "
                  "with write_through_done.\n\nRaises:\n    ValueError: timeout is NaN."))
      .def(
          "write_through_done",
          [](CPUOffloadingManager& self, py::handle ids_obj) {
            const std::vector<std::uint32_t> ids =
                slot_ids(ids_obj, "write_through_done",
                         "pass the block_ids of a take_write_through batch");
            self.write_through_done(ids);
          },
          py::arg("block_ids"),
          py::doc(doc("write_through_done(self, block_ids: Sequence[int]) -> None\n\n"
                      "Any thread: every tier is done with these blocks (written or failed); the "
                      "engine thread unpins them at its next prepare_store, complete_store, "
                      "prepare_load, complete_load or poll_write_through.",
                      "\n    ValueError: a block is not being written through (never queued, "
                      "handed back already, or repeated); nothing is changed.")
                      .c_str()))
      .def("poll_write_through", &CPUOffloadingManager::poll_write_through,
           py::doc("poll_write_through(self) -> int\n\n"
                   "Engine thread: unpins the blocks handed back by write_through_done; returns "
                   "how many."))
      .def(
          "wait_write_through",
          [](CPUOffloadingManager& self, double timeout) {
            // writers need the GIL to hand blocks back
            return without_gil([&] { return self.wait_write_through(timeout); });
          },
          py::arg("timeout"),
          py::doc("wait_write_through(self, timeout: float) -> int\n\n"
                  "Engine thread: waits up to timeout seconds for blocks to be handed back "
                  "(1e6 or more, inf included: until some are), then unpins them; returns how "
                  "many (for replays, which must not drop).\n\nRaises:\n    ValueError: "
                  "timeout is NaN."))
      .def("close_write_through", &CPUOffloadingManager::close_write_through,
           py::doc("close_write_through(self) -> None\n\n"
                   "Wakes every take_write_through; later ones return at once. Idempotent."))
      .def_property_readonly("write_through_in_flight",
                             &CPUOffloadingManager::write_through_in_flight,
                             py::doc("int: blocks queued or being written through (pinned)."))
      .def_property_readonly("write_through_queued", &CPUOffloadingManager::write_through_queued,
                             py::doc("int: blocks queued for write-through since construction."))
      .def_property_readonly("write_through_dropped",
                             &CPUOffloadingManager::write_through_dropped,
                             py::doc("int: blocks not queued because the queue was full, since "
                                     "construction."))
      .def(
          "take_events",
          [](CPUOffloadingManager& self) { return events_to_py(self.take_events()); },
          py::doc("take_events(self) -> list[OffloadingEvent]\n\n"
                  "Returns the events recorded since the last call, oldest first, and clears "
                  "them: BlockRemoved for evictions (from prepare_store) and BlockStored for "
                  "complete_store(success=True). Always [] when enable_events is False."))
      .def(
          "discard",
          [](CPUOffloadingManager& self, py::handle keys) {
            KeyBatch batch(keys);
            return self.discard(batch.span());
          },
          py::arg("keys"),
          py::doc("discard(self, keys) -> int\n\n"
                  "Drops the ready, unpinned blocks among keys (their data cannot be trusted, "
                  "e.g. a load of them failed); returns how many. Missing, pending and "
                  "load-pinned keys are left as they are; a block pinned only by its "
                  "write-through stops being a hit (its slot is freed when the tier writer hands "
                  "it back). Raises ValueError for an empty key."))
      .def(
          "clear",
          [](CPUOffloadingManager& self, py::handle include_in_flight) {
            return self.clear(to_bool(include_in_flight, "include_in_flight"));
          },
          py::arg("include_in_flight") = false,
           py::doc("clear(self, include_in_flight=False) -> int\n\n"
                   "Drops every ready block that no load pins (one BlockRemoved event lists "
                   "them) and returns how many blocks. Pending blocks (stores in flight) and "
                   "pinned blocks stay. With include_in_flight (an engine that forgets its jobs "
                   "in flight at a reset and never completes them, as vLLM's "
                   "OffloadingConnector does), pending blocks and blocks pinned by loads are "
                   "dropped too and their slots freed at once; later completions of them are "
                   "errors. A block being written through to the tiers stops being a hit too "
                   "(unless a load pins it and include_in_flight is False); its slot is freed "
                   "when the tier writer hands it back. O(num_blocks)."))
      .def("cancel_write_through", &CPUOffloadingManager::cancel_write_through,
           py::doc("cancel_write_through(self) -> int\n\n"
                   "Engine thread, for a cache reset with secondary tiers: hands back, "
                   "unwritten, every write-through batch that no take_write_through took yet "
                   "(the next poll unpins them) and returns how many blocks. Call it while the "
                   "tiers' dispatcher cannot call take_write_through, so that every block "
                   "queued before is cancelled or already with its writers."))
      .def_property_readonly("write_through_cancelled",
                             &CPUOffloadingManager::write_through_cancelled,
                             py::doc("int: blocks handed back unwritten by "
                                     "cancel_write_through, since construction."))
      .def_property_readonly("num_blocks", &CPUOffloadingManager::num_blocks,
                             py::doc("int: pool size in CPU blocks (slots)."))
      .def_property_readonly("num_free_blocks", &CPUOffloadingManager::num_free_blocks,
                             py::doc("int: free slots (blocks)."))
      .def_property_readonly("num_stored_blocks", &CPUOffloadingManager::num_stored_blocks,
                             py::doc("int: ready blocks (lookup hits)."))
      .def_property_readonly("num_pending_blocks", &CPUOffloadingManager::num_pending_blocks,
                             py::doc("int: pending blocks (prepare_store'd, store not "
                                     "complete)."))
      .def_property_readonly("num_evictable_blocks", &CPUOffloadingManager::num_evictable_blocks,
                             py::doc("int: ready blocks that no load pins (could be evicted "
                                     "now)."))
      .def_property_readonly("num_pinned_blocks", &CPUOffloadingManager::num_pinned_blocks,
                             py::doc("int: slots a transfer uses now (pending stores, ready "
                                     "blocks pinned by loads or write-through, retired slots "
                                     "a writer still reads): num_blocks less the free, "
                                     "evictable and reserved ones."))
      .def_property_readonly("num_retired_blocks", &CPUOffloadingManager::num_retired_blocks,
                             py::doc("int: slots of blocks clear() or discard() dropped while "
                                     "a tier writer still reads them; freed when it hands them "
                                     "back. free + stored + pending + retired + reserved = "
                                     "num_blocks."))
      .def_property_readonly(
          "eviction_policy",
          [](const CPUOffloadingManager& self) { return std::string(self.eviction_policy_name()); },
          py::doc("str: the eviction policy's name (\"lru\", \"arc\" or \"probation\")."))
      .def_property_readonly("enable_events", &CPUOffloadingManager::events_enabled,
                             py::doc("bool: whether events are recorded."))
      .def_property_readonly("store_threshold", &CPUOffloadingManager::store_threshold,
                             py::doc("int: offers before a key is stored (< 2: no admission "
                                     "filter)."))
      .def_property_readonly("max_tracker_size", &CPUOffloadingManager::max_tracker_size,
                             py::doc("int: keys the store_threshold tracker holds at most."))
      .def_property_readonly("stores_skipped", &CPUOffloadingManager::stores_skipped,
                             py::doc("int: keys prepare_store skipped because of "
                                     "store_threshold, since construction (vLLM's "
                                     "kv_offload_stores_skipped)."))
      .def_property_readonly("tracker_size", &CPUOffloadingManager::tracker_size,
                             py::doc("int: keys the store_threshold tracker holds now (0 "
                                     "without the filter)."))
      .def(
          "offer_count",
          [](const CPUOffloadingManager& self, py::handle key) {
            std::array<char, 8> buf{};
            return self.offer_count(to_key(key.ptr(), "key", -1, buf));
          },
          py::arg("key"),
          py::doc("offer_count(self, key: bytes | int) -> int\n\n"
                  "Offers the store_threshold tracker counted for key (0 when it does not "
                  "track it, or without the filter).\n\nRaises:\n    TypeError / ValueError: "
                  "for a bad key, as lookup."))
      .def(
          "__len__",
          [](const CPUOffloadingManager& self) {
            return self.num_stored_blocks() + self.num_pending_blocks();
          },
          py::doc("__len__(self) -> int\n\nKeys held (ready + pending) = num_blocks - "
                  "num_free_blocks - num_retired_blocks."))
      .def(
          "__contains__",
          [](const CPUOffloadingManager& self, py::handle key) {
            std::array<char, 8> buf{};
            return self.state(to_key(key.ptr(), "key", -1, buf)) != kvoff::BlockState::kMissing;
          },
          py::arg("key"),
          py::doc("__contains__(self, key: bytes | int) -> bool\n\n"
                  "Whether the key is held (ready or pending). Use lookup([key]) == 1 for "
                  "\"is a hit\".\n\nRaises:\n    TypeError / ValueError: for a bad key, as "
                  "lookup."))
      .def("__repr__", [](const CPUOffloadingManager& self) {
        return "<kvoff._scheduler.CPUOffloadingManager num_blocks=" +
               std::to_string(self.num_blocks()) + " eviction_policy='" +
               std::string(self.eviction_policy_name()) +
               "' enable_events=" + (self.events_enabled() ? "True" : "False") +
               (self.store_threshold() >= 2
                    ? " store_threshold=" + std::to_string(self.store_threshold())
                    : std::string()) +
               " stored=" + std::to_string(self.num_stored_blocks()) +
               " pending=" + std::to_string(self.num_pending_blocks()) +
               " free=" + std::to_string(self.num_free_blocks()) + ">";
      });

  // ===================================================================== test hooks
  m.def(
      "_probation_ghost_set",
      [](py::handle key, std::int64_t capacity) {
        std::array<char, 8> buf{};
        const std::string_view k = to_key(key.ptr(), "key", -1, buf);
        if (capacity < 1 || capacity > kvoff::kMaxNumBlocks) {
          throw py::value_error("capacity must be in [1, 2**31-1], got " +
                                std::to_string(capacity));
        }
        const auto c = static_cast<std::uint32_t>(capacity);
        return py::make_tuple(kvoff::ProbationEvictionPolicy::ghost_set_of(k, c),
                              kvoff::ProbationEvictionPolicy::ghost_tag_of(k),
                              kvoff::ProbationEvictionPolicy::ghost_sets_for(c));
      },
      py::arg("key"), py::arg("capacity"),
      py::doc("_probation_ghost_set(key: bytes | int, capacity: int) -> tuple[int, int, int]"
              "\n\n"
              "Where `key`'s ghosts live in a probation policy of `capacity` slots: (set, 16-bit "
              "tag, number of sets) (kvoff/eviction_policy.h). For the tests' model of the "
              "policy; private (underscore): not a stable API.\n\n"
              "Raises:\n"
              "    ValueError: an empty key, or capacity 0 or above 2**31-1.\n"
              "    TypeError: a key that is not bytes or int."));

}

}  // namespace kvoff::bindings
