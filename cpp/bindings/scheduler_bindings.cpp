// kvoff._scheduler: the Python face of the C++ scheduler core (the one pybind11 file; it
// includes no torch header). Keys cross the boundary as bytes (ints are accepted and converted
// to 8 little-endian bytes); C++ exceptions become ValueError (std::invalid_argument) and
// IndexError (std::out_of_range).
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/eviction_policy.h"
#include "kvoff/offloading_manager.h"

namespace py = pybind11;

namespace {

using kvoff::CPUOffloadingManager;

// ------------------------------------------------------------------------- key conversion

std::string short_repr(PyObject* obj) {
  std::string r = py::repr(py::handle(obj)).cast<std::string>();
  if (r.size() > 80) {
    r = r.substr(0, 77) + "...";
  }
  return r;
}

std::string item_name(const char* what, Py_ssize_t index) {
  return index < 0 ? std::string(what) : std::string(what) + "[" + std::to_string(index) + "]";
}

/// Converts one key object into a byte view. bytes are viewed in place; an int is written as
/// 8 little-endian bytes into `buf`. `index` < 0 names a single key (not a batch element).
std::string_view to_key(PyObject* item, const char* what, Py_ssize_t index,
                        std::array<char, 8>& buf) {
  if (PyBytes_Check(item)) {
    const Py_ssize_t n = PyBytes_GET_SIZE(item);
    if (n == 0) {
      throw py::value_error(item_name(what, index) +
                            " is b'' (empty); keys must be non-empty bytes or ints");
    }
    return {PyBytes_AS_STRING(item), static_cast<std::size_t>(n)};
  }
  if (PyBool_Check(item) || !(PyLong_Check(item) || PyIndex_Check(item))) {
    throw py::type_error(item_name(what, index) + " has type " + Py_TYPE(item)->tp_name + " (" +
                         short_repr(item) +
                         "); keys must be bytes (a block hash) or int (64-bit)");
  }
  py::object number = py::reinterpret_steal<py::object>(PyNumber_Index(item));
  if (!number) {
    throw py::error_already_set();
  }
  int overflow = 0;
  std::uint64_t value = 0;
  const long long signed_value = PyLong_AsLongLongAndOverflow(number.ptr(), &overflow);
  if (signed_value == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (overflow == 0) {
    value = static_cast<std::uint64_t>(signed_value);  // two's complement
  } else {
    unsigned long long unsigned_value = 0;
    if (overflow > 0) {
      unsigned_value = PyLong_AsUnsignedLongLong(number.ptr());
      if (unsigned_value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        overflow = 2;
      }
    }
    if (overflow != 1) {
      throw py::value_error(item_name(what, index) + " = " + short_repr(item) +
                            " does not fit in 64 bits; int keys must be in [-2**63, 2**64)");
    }
    value = unsigned_value;
  }
  for (std::size_t b = 0; b < 8; ++b) {
    buf[b] = static_cast<char>((value >> (8 * b)) & 0xff);
  }
  return {buf.data(), buf.size()};
}

/// A batch of keys converted from any Python sequence of bytes / int, without copying bytes
/// keys. Keeps the sequence alive while the views are used.
class KeyBatch {
 public:
  explicit KeyBatch(py::handle obj) {
    PyObject* o = obj.ptr();
    if (PyBytes_Check(o) || PyByteArray_Check(o) || PyUnicode_Check(o) || PyLong_Check(o) ||
        PyAnySet_Check(o) || PyDict_Check(o)) {
      throw py::type_error(
          std::string("keys must be an ordered sequence (list or tuple) of bytes or int keys, "
                      "got a single ") +
          Py_TYPE(o)->tp_name + " object" +
          (PyAnySet_Check(o) || PyDict_Check(o) ? " (unordered: order matters, use a list)"
                                                : "; wrap a single key in a list: [key]"));
    }
    PyObject* seq = PySequence_Fast(o, "");
    if (seq == nullptr) {
      PyErr_Clear();
      throw py::type_error(std::string("keys must be a sequence (list or tuple) of bytes or int "
                                       "keys, got ") +
                           Py_TYPE(o)->tp_name);
    }
    seq_ = py::reinterpret_steal<py::object>(seq);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    views_.reserve(static_cast<std::size_t>(n));
    std::array<char, 8> scratch{};
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      if (PyBytes_Check(item) && PyBytes_GET_SIZE(item) > 0) {  // fast path
        views_.emplace_back(PyBytes_AS_STRING(item),
                            static_cast<std::size_t>(PyBytes_GET_SIZE(item)));
        continue;
      }
      const std::string_view v = to_key(item, "keys", i, scratch);
      if (PyBytes_Check(item)) {
        views_.push_back(v);
        continue;
      }
      if (!ints_) {  // sized once, so earlier views stay valid
        ints_ = std::make_unique<std::array<char, 8>[]>(static_cast<std::size_t>(n));
      }
      ints_[num_ints_] = scratch;
      views_.emplace_back(ints_[num_ints_].data(), 8);
      ++num_ints_;
    }
  }

  kvoff::KeySpan span() const noexcept { return views_; }

  /// `keys` as Python bytes, given that they are a subsequence of this batch in order (as
  /// keys_to_store is): bytes items of the batch are returned as the same objects (no copy).
  py::list subsequence_as_bytes(const std::vector<std::string>& keys) const {
    py::list out(keys.size());
    PyObject** items = PySequence_Fast_ITEMS(seq_.ptr());
    std::size_t i = 0;
    for (std::size_t j = 0; j < keys.size(); ++j) {
      while (i < views_.size() && views_[i] != keys[j]) {
        ++i;
      }
      PyObject* b = nullptr;
      if (i < views_.size() && PyBytes_Check(items[i])) {
        b = Py_NewRef(items[i]);
      } else {
        b = PyBytes_FromStringAndSize(keys[j].data(), static_cast<Py_ssize_t>(keys[j].size()));
        if (b == nullptr) {
          throw py::error_already_set();
        }
      }
      PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(j), b);
    }
    return out;
  }

 private:
  py::object seq_;
  std::vector<std::string_view> views_;
  std::unique_ptr<std::array<char, 8>[]> ints_;
  std::size_t num_ints_ = 0;
};

py::list to_bytes_list(const std::vector<std::string>& keys) {
  py::list out(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    PyObject* b = PyBytes_FromStringAndSize(keys[i].data(), static_cast<Py_ssize_t>(keys[i].size()));
    if (b == nullptr) {
      throw py::error_already_set();
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), b);
  }
  return out;
}

py::list to_int_list(const std::vector<std::uint32_t>& ids) {
  py::list out(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    PyObject* v = PyLong_FromUnsignedLong(ids[i]);
    if (v == nullptr) {
      throw py::error_already_set();
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

/// A list of bytes keys from any sequence of bytes / int (for the record constructors).
py::list normalized_keys(py::handle keys) {
  KeyBatch batch(keys);
  const auto span = batch.span();
  py::list out(span.size());
  for (std::size_t i = 0; i < span.size(); ++i) {
    PyObject* b = PyBytes_FromStringAndSize(span[i].data(), static_cast<Py_ssize_t>(span[i].size()));
    if (b == nullptr) {
      throw py::error_already_set();
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), b);
  }
  return out;
}

py::list normalized_ids(py::handle ids) {
  py::list out;
  for (py::handle id : ids) {
    if (PyBool_Check(id.ptr()) || !PyIndex_Check(id.ptr())) {
      throw py::type_error(std::string("block_ids must be ints, got ") + Py_TYPE(id.ptr())->tp_name);
    }
    out.append(py::reinterpret_steal<py::object>(PyNumber_Index(id.ptr())));
  }
  return out;
}

std::int64_t to_num_blocks(py::handle obj) {
  if (PyBool_Check(obj.ptr()) || !PyLong_Check(obj.ptr())) {
    throw py::type_error(std::string("num_blocks must be an int (CPU blocks), got ") +
                         Py_TYPE(obj.ptr())->tp_name + " (" + short_repr(obj.ptr()) + ")");
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (overflow != 0) {
    throw py::value_error("num_blocks must be in [1, 2^31-1] (CPU block ids are 32-bit), got " +
                          short_repr(obj.ptr()) + "; size the CPU pool with at least one block");
  }
  return v;
}

// ------------------------------------------------------------------------- Python records

struct PrepareStoreOutput {
  py::list keys_to_store;
  py::list block_ids;
  py::list evicted_keys;
};

struct OffloadingEvent {
  py::list keys;
  std::string medium;
  bool removed = false;
  const char* kind() const { return removed ? "BlockRemoved" : "BlockStored"; }
};

std::string list_repr(const py::list& l) { return py::repr(l).cast<std::string>(); }

// ------------------------------------------------------------------------- docstrings

constexpr const char* kModuleDoc = R"doc(kvoff's scheduler core (C++): the CPU block pool and its offloading manager.

Keys name offloaded blocks: ``bytes`` of any non-empty length, or ``int`` (converted to 8
little-endian bytes: [-2**63, 2**63) as two's complement, [2**63, 2**64) unsigned). Keys come
back as ``bytes``. CPU block ids are ints in [0, num_blocks).
)doc";

constexpr const char* kManagerDoc = R"doc(CPUOffloadingManager(num_blocks: int, eviction_policy: str = "lru", enable_events: bool = False)

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

Args:
    num_blocks (int): pool size in CPU blocks (slots), 1 .. 2**31-1.
    eviction_policy (str): a name from ``eviction_policies()`` (currently "lru").
    enable_events (bool): record ``OffloadingEvent``s for ``take_events()``.

Raises:
    ValueError: num_blocks out of range (naming it) or an unknown eviction_policy (listing the
        choices).
    TypeError: num_blocks is not an int.
)doc";

constexpr const char* kKeysNote = R"doc(
    keys (Sequence[bytes | int]): a list or tuple (any ordered sequence) of keys.

Raises:
    TypeError: keys is not an ordered sequence, or a key is neither bytes nor int (naming it).
    ValueError: a key is b'' or an int outside [-2**63, 2**64) (naming it).)doc";

std::string doc(const char* head, const char* tail = "") {
  return std::string(head) + "\n\nArgs:" + kKeysNote + tail;
}

}  // namespace

PYBIND11_MODULE(_scheduler, m) {
  py::options options;
  options.disable_function_signatures();  // signatures are written in the docstrings
  m.doc() = kModuleDoc;

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
                "policy registry (currently ['lru'])."));

  // ---- PrepareStoreOutput
  py::class_<PrepareStoreOutput>(
      m, "PrepareStoreOutput",
      ("PrepareStoreOutput(keys_to_store: Sequence[bytes | int], block_ids: "
              "Sequence[int], evicted_keys: Sequence[bytes | int] = ())\n\n"
              "What CPUOffloadingManager.prepare_store decided.\n\n"
              "Attributes:\n"
              "    keys_to_store (list[bytes]): keys of the call that were not held, "
              "deduplicated, in call order: copy these blocks GPU->CPU.\n"
              "    block_ids (list[int]): the CPU block id (slot) given to each of "
              "keys_to_store, same order.\n"
              "    evicted_keys (list[bytes]): keys evicted to make room, in eviction order."))
      .def(py::init([](py::handle keys_to_store, py::handle block_ids, py::handle evicted_keys) {
             return PrepareStoreOutput{normalized_keys(keys_to_store), normalized_ids(block_ids),
                                       normalized_keys(evicted_keys)};
           }),
           py::arg("keys_to_store"), py::arg("block_ids"), py::arg("evicted_keys") = py::tuple(),
           py::doc("__init__(self, keys_to_store: Sequence[bytes | int], block_ids: "
                   "Sequence[int], evicted_keys: Sequence[bytes | int] = ()) -> None"))
      .def_readonly("keys_to_store", &PrepareStoreOutput::keys_to_store,
                    py::doc("list[bytes]: keys to copy, in call order."))
      .def_readonly("block_ids", &PrepareStoreOutput::block_ids,
                    py::doc("list[int]: CPU block id of each of keys_to_store."))
      .def_readonly("evicted_keys", &PrepareStoreOutput::evicted_keys,
                    py::doc("list[bytes]: keys evicted to make room, in eviction order."))
      .def("__eq__",
           [](const PrepareStoreOutput& a, py::object other) -> py::object {
             if (!py::isinstance<PrepareStoreOutput>(other)) {
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             }
             const auto& b = other.cast<const PrepareStoreOutput&>();
             return py::bool_(a.keys_to_store.equal(b.keys_to_store) &&
                              a.block_ids.equal(b.block_ids) &&
                              a.evicted_keys.equal(b.evicted_keys));
           })
      .def("__repr__", [](const PrepareStoreOutput& o) {
        return "PrepareStoreOutput(keys_to_store=" + list_repr(o.keys_to_store) +
               ", block_ids=" + list_repr(o.block_ids) +
               ", evicted_keys=" + list_repr(o.evicted_keys) + ")";
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
      .def(py::init([](py::handle keys, std::string medium, bool removed) {
             return OffloadingEvent{normalized_keys(keys), std::move(medium), removed};
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
                       bool enable_events) {
             return std::make_unique<CPUOffloadingManager>(to_num_blocks(num_blocks),
                                                           eviction_policy, enable_events);
           }),
           py::arg("num_blocks"), py::arg("eviction_policy") = "lru",
           py::arg("enable_events") = false,
           py::doc("__init__(self, num_blocks: int, eviction_policy: str = \"lru\", "
                   "enable_events: bool = False) -> None\n\nSee the class docstring."))
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
          [](CPUOffloadingManager& self, py::handle keys) {
            KeyBatch batch(keys);
            self.touch(batch.span());
          },
          py::arg("keys"),
          py::doc(doc("touch(self, keys: Sequence[bytes | int]) -> None\n\n"
                      "Marks held keys (ready or pending) most recently used, last to first, so "
                      "keys[0] ends the most recent: a prefix's tail is evicted before its head. "
                      "Keys not held are ignored.")
                      .c_str()))
      .def(
          "prepare_store",
          [](CPUOffloadingManager& self, py::handle keys) -> py::object {
            KeyBatch batch(keys);
            auto result = self.prepare_store(batch.span());
            if (!result) {
              return py::none();
            }
            return py::cast(PrepareStoreOutput{batch.subsequence_as_bytes(result->keys_to_store),
                                               to_int_list(result->block_ids),
                                               to_bytes_list(result->evicted_keys)});
          },
          py::arg("keys"),
          py::doc(doc("prepare_store(self, keys: Sequence[bytes | int]) -> PrepareStoreOutput "
                      "| None\n\n"
                      "Gives each key not yet held (deduplicated, in call order) a CPU slot; the "
                      "new blocks are pending (not lookup hits) until complete_store. If the "
                      "free slots are too few, evicts ready, unpinned blocks that are not keys "
                      "of this call, in policy order (a BlockRemoved event lists them). New "
                      "blocks become the most recent, keys[0] the most recent of them; keys "
                      "already held are left as they are.\n\n"
                      "Returns None, changing nothing (no eviction, no event), when the free "
                      "slots plus evictable blocks are fewer than the new keys: retry later.")
                      .c_str()))
      .def(
          "complete_store",
          [](CPUOffloadingManager& self, py::handle keys, bool success) {
            KeyBatch batch(keys);
            self.complete_store(batch.span(), success);
          },
          py::arg("keys"), py::arg("success") = true,
          py::doc(doc("complete_store(self, keys: Sequence[bytes | int], success: bool = True) "
                      "-> None\n\n"
                      "Finishes the stores of pending keys. success=True: they become ready "
                      "(lookup hits) and a BlockStored event lists them. success=False: they are "
                      "dropped and their slots freed (never a hit). A repeated key is finished "
                      "once.",
                      "\n    ValueError: a key is not pending (missing or already ready), naming "
                      "it in hex and its state; nothing is changed.")
                      .c_str()))
      .def(
          "take_events",
          [](CPUOffloadingManager& self) {
            auto events = self.take_events();
            py::list out(events.size());
            for (std::size_t i = 0; i < events.size(); ++i) {
              out[i] = py::cast(OffloadingEvent{to_bytes_list(events[i].keys),
                                                std::move(events[i].medium), events[i].removed});
            }
            return out;
          },
          py::doc("take_events(self) -> list[OffloadingEvent]\n\n"
                  "Returns the events recorded since the last call, oldest first, and clears "
                  "them: BlockRemoved for evictions (from prepare_store) and BlockStored for "
                  "complete_store(success=True). Always [] when enable_events is False."))
      .def_property_readonly("num_blocks", &CPUOffloadingManager::num_blocks,
                             py::doc("int: pool size in CPU blocks (slots)."))
      .def_property_readonly("num_free_blocks", &CPUOffloadingManager::num_free_blocks,
                             py::doc("int: free slots (blocks)."))
      .def_property_readonly("num_stored_blocks", &CPUOffloadingManager::num_stored_blocks,
                             py::doc("int: ready blocks (lookup hits)."))
      .def_property_readonly("num_pending_blocks", &CPUOffloadingManager::num_pending_blocks,
                             py::doc("int: pending blocks (prepare_store'd, store not "
                                     "complete)."))
      .def_property_readonly(
          "eviction_policy",
          [](const CPUOffloadingManager& self) { return std::string(self.eviction_policy_name()); },
          py::doc("str: the eviction policy's name (\"lru\")."))
      .def_property_readonly("enable_events", &CPUOffloadingManager::events_enabled,
                             py::doc("bool: whether events are recorded."))
      .def(
          "__len__",
          [](const CPUOffloadingManager& self) {
            return self.num_stored_blocks() + self.num_pending_blocks();
          },
          py::doc("__len__(self) -> int\n\nKeys held (ready + pending) = num_blocks - "
                  "num_free_blocks."))
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
               " stored=" + std::to_string(self.num_stored_blocks()) +
               " pending=" + std::to_string(self.num_pending_blocks()) +
               " free=" + std::to_string(self.num_free_blocks()) + ">";
      });
}
