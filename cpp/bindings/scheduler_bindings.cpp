// kvoff._scheduler: the Python face of the C++ scheduler core (the one pybind11 file; it
// includes no torch header). Keys cross the boundary as bytes (ints are accepted and converted
// to 8 little-endian bytes); C++ exceptions become ValueError (std::invalid_argument) and
// IndexError (std::out_of_range).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "kvoff/eviction_policy.h"
#include "kvoff/manager_bench.h"  // _bench_manager (section at the end of the module)
#include "kvoff/offloading_manager.h"
#include "kvoff/offloading_scheduler.h"

namespace py = pybind11;

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

/// A `T` kept between calls on the calling thread, so that its memory serves every engine step:
/// the first holder on a thread borrows the thread's one (cleared by the caller as it needs);
/// a nested holder (Python code run inside a call, e.g. a property of an engine object, that
/// calls into a scheduler again) gets a fresh local one instead. `Tag` keeps the uses apart.
template <typename T, typename Tag>
class Borrowed {
 public:
  Borrowed() : mine_(!slot().busy) {
    if (mine_) slot().busy = true;
  }
  ~Borrowed() {
    if (mine_) slot().busy = false;
  }
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  T& get() noexcept { return mine_ ? slot().value : local_; }

 private:
  struct Slot {
    T value;
    bool busy = false;
  };
  static Slot& slot() {
    thread_local Slot s;
    return s;
  }
  bool mine_;
  T local_;
};

/// A batch of keys converted from any Python sequence of bytes / int, without copying bytes
/// keys. Keeps the sequence alive while the views are used. With `start`, the batch is the
/// sequence's items from that index on (no slice is made).
class KeyBatch {
 public:
  /// `storage`: a vector to hold the views (its memory reused, see Borrowed), or the batch's own.
  explicit KeyBatch(py::handle obj, Py_ssize_t start = 0,
                    std::vector<std::string_view>* storage = nullptr)
      : start_(start), views_(storage != nullptr ? *storage : own_views_) {
    views_.clear();
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
    start_ = std::min(std::max<Py_ssize_t>(start_, 0), PySequence_Fast_GET_SIZE(seq));
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) - start_;
    PyObject** items = PySequence_Fast_ITEMS(seq) + start_;
    views_.reserve(static_cast<std::size_t>(n));
    std::array<char, 8> scratch{};
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = items[i];
      if (PyBytes_Check(item) && PyBytes_GET_SIZE(item) > 0) {  // fast path
        views_.emplace_back(PyBytes_AS_STRING(item),
                            static_cast<std::size_t>(PyBytes_GET_SIZE(item)));
        continue;
      }
      if (!PyLong_Check(item) && PyList_Check(seq_.ptr())) {
        // item.__index__ is user code that could change the list and free the bytes that
        // earlier views point into: work on a tuple of the same items from here on
        PyObject* copy = PySequence_Tuple(seq_.ptr());
        if (copy == nullptr) throw py::error_already_set();
        seq_ = py::reinterpret_steal<py::object>(copy);
        items = PySequence_Fast_ITEMS(copy) + start_;
        item = items[i];
      }
      const std::string_view v = to_key(item, "keys", i + start_, scratch);
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

  // views_ may refer to own_views_: a copy or move would point into the source
  KeyBatch(const KeyBatch&) = delete;
  KeyBatch& operator=(const KeyBatch&) = delete;

  kvoff::KeySpan span() const noexcept { return views_; }

  /// The keys at `positions` (ascending positions into this batch) as Python bytes: bytes items
  /// of the batch are returned as the same objects (no copy).
  py::list items_as_bytes(const std::vector<std::uint32_t>& positions) const {
    py::list out(positions.size());
    PyObject** items = PySequence_Fast_ITEMS(seq_.ptr()) + start_;
    for (std::size_t j = 0; j < positions.size(); ++j) {
      const std::uint32_t i = positions[j];
      PyObject* b = nullptr;
      if (PyBytes_Check(items[i])) {
        b = Py_NewRef(items[i]);
      } else {
        b = PyBytes_FromStringAndSize(views_[i].data(), static_cast<Py_ssize_t>(views_[i].size()));
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
  Py_ssize_t start_ = 0;  // index in seq_ of the batch's first key
  std::vector<std::string_view> own_views_;
  std::vector<std::string_view>& views_;  // own_views_ or the caller's storage
  std::unique_ptr<std::array<char, 8>[]> ints_;
  std::size_t num_ints_ = 0;
};

/// Keys (a std::vector<std::string> or a kvoff::KeyList) as a list of Python bytes.
template <typename Keys>
py::list to_bytes_list(const Keys& keys) {
  py::list out(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::string_view key(keys[i]);
    PyObject* b = PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
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
    throw py::value_error(kvoff::bad_num_blocks_message(short_repr(obj.ptr())));
  }
  return v;
}

/// An int argument of CPUOffloadingManager(): TypeError for anything else (a bool included),
/// ValueError naming `range` for one beyond 64 bits (the core checks the range itself).
std::int64_t to_int_arg(py::handle obj, const char* name, const char* range) {
  if (PyBool_Check(obj.ptr()) || !PyLong_Check(obj.ptr())) {
    throw py::type_error(std::string(name) + " must be an int, got " + Py_TYPE(obj.ptr())->tp_name +
                         " (" + short_repr(obj.ptr()) + ")");
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (overflow != 0) {
    throw py::value_error(std::string(name) + "=" + short_repr(obj.ptr()) +
                          " is out of range; pass " + range);
  }
  return v;
}

// ------------------------------------------------------------------------- Python records

struct PrepareStoreOutput {
  py::list keys_to_store;
  py::list block_ids;
  py::list evicted_keys;
  py::list skipped_keys;
};

struct OffloadingEvent {
  py::list keys;
  std::string medium;
  bool removed = false;
  const char* kind() const { return removed ? "BlockRemoved" : "BlockStored"; }
};

/// The core's events as Python OffloadingEvent records (keys as bytes).
py::list events_to_py(std::vector<kvoff::OffloadingEvent> events) {
  py::list out(events.size());
  for (std::size_t i = 0; i < events.size(); ++i) {
    out[i] = py::cast(OffloadingEvent{to_bytes_list(events[i].keys), std::move(events[i].medium),
                                      events[i].removed});
  }
  return out;
}

std::string list_repr(const py::list& l) { return py::repr(l).cast<std::string>(); }

// ------------------------------------------------------------------------- docstrings

constexpr const char* kModuleDoc = R"doc(kvoff's scheduler core (C++): the CPU block pool and its offloading manager.

Keys name offloaded blocks: ``bytes`` of any non-empty length, or ``int`` (converted to 8
little-endian bytes: [-2**63, 2**63) as two's complement, [2**63, 2**64) unsigned). Keys come
back as ``bytes``. CPU block ids are ints in [0, num_blocks).
)doc";

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
        "probation" (README "Eviction policies against Belady's MIN").
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

// ------------------------------------------------------------------------- scheduler
// kvoff._scheduler._OffloadingScheduler: the C++ OffloadingScheduler behind the Python facade
// kvoff.scheduler.OffloadingScheduler (which owns the argument types and their docstrings).
namespace fast {
py::object make(py::object owner);
}  // namespace fast

namespace sched {

/// Names a value for an error message, built only when one is raised: `what`, `what[i]`,
/// `what[i][j]`, ... (up to three indices).
struct Where {
  const char* what;
  std::array<Py_ssize_t, 3> index{-1, -1, -1};
  /// This place indexed once more by `k`.
  Where at(Py_ssize_t k) const {
    Where w = *this;
    for (auto& i : w.index) {
      if (i < 0) {
        i = k;
        break;
      }
    }
    return w;
  }
  std::string str() const {
    std::string out(what);
    for (const Py_ssize_t i : index) {
      if (i >= 0) out += "[" + std::to_string(i) + "]";
    }
    return out;
  }
};

/// The value of a plain int that CPython stores as one digit (magnitude below 2^30: every
/// token count and block id an engine has), read inline: the per-request
/// columns of a step are read for every running request, and the call into
/// PyLong_AsLongLongAndOverflow costs about as much as the read. False for anything else
/// (the caller then takes the checked path).
inline bool compact_int(PyObject* item, std::int64_t& out) noexcept {
  if (!PyLong_CheckExact(item)) return false;
#if PY_VERSION_HEX >= 0x030C0000
  auto* l = reinterpret_cast<PyLongObject*>(item);
  if (!PyUnstable_Long_IsCompact(l)) return false;
  out = static_cast<std::int64_t>(PyUnstable_Long_CompactValue(l));
  return true;
#else
  const Py_ssize_t size = Py_SIZE(item);
  if (size < -1 || size > 1) return false;
  const auto digit = static_cast<std::int64_t>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
  out = size == 0 ? 0 : (size > 0 ? digit : -digit);
  return true;
#endif
}

std::int64_t to_int64(PyObject* item, const Where& where) {
  if (std::int64_t v = 0; compact_int(item, v)) return v;
  if (PyLong_CheckExact(item)) {  // a plain int of more than one digit
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow == 0 && !(v == -1 && PyErr_Occurred())) return v;
  }
  if (PyBool_Check(item) || !PyLong_Check(item)) {
    throw py::type_error(where.str() + " must be an int, got " + Py_TYPE(item)->tp_name + " (" +
                         short_repr(item) + ")");
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (overflow != 0) {
    throw py::value_error(where.str() + " = " + short_repr(item) + " does not fit in 64 bits");
  }
  return v;
}

std::int64_t to_int64(PyObject* item, const char* what) { return to_int64(item, Where{what}); }

/// A sequence as a fast sequence (a new reference), or a TypeError naming `where`.
py::object fast_sequence(PyObject* obj, const Where& where, const char* of) {
  PyObject* seq = PySequence_Fast(obj, "");
  if (seq == nullptr) {
    PyErr_Clear();
    throw py::type_error(where.str() + " must be a sequence of " + of + ", got " +
                         Py_TYPE(obj)->tp_name);
  }
  return py::reinterpret_steal<py::object>(seq);
}

/// Block ids come as nested sequences read while the step's columns are held as borrowed
/// pointers: a sequence type written in Python (its __iter__ / __len__ is user code) is refused;
/// built-in and C types (list, tuple, range, numpy arrays) are read as usual.
void reject_python_sequence(PyObject* obj, const Where& where) {
  if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj) &&
      (Py_TYPE(obj)->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0) {
    throw py::type_error(where.str() + " must be a list or tuple, got the Python class " +
                         Py_TYPE(obj)->tp_name + "; pass list(...)");
  }
}

/// A sequence of ints into `out`, reusing its storage (a step's scratch, see StepScratch).
void to_ints_into(PyObject* obj, const Where& where, std::vector<std::int64_t>& out) {
  reject_python_sequence(obj, where);
  py::object seq = fast_sequence(obj, where, "ints");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  out.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t k = 0; k < n; ++k) {
    std::int64_t& v = out[static_cast<std::size_t>(k)];
    if (!compact_int(items[k], v)) v = to_int64(items[k], where.at(k));
  }
}

std::vector<std::int64_t> to_ints(PyObject* obj, const Where& where) {
  std::vector<std::int64_t> out;
  to_ints_into(obj, where, out);
  return out;
}

/// Per KV cache group, a list of ints into `out` (reusing its vectors' storage): `obj` is a
/// sequence (one entry per group) of sequences.
void to_int_lists_into(PyObject* obj, const Where& where,
                       std::vector<std::vector<std::int64_t>>& out) {
  reject_python_sequence(obj, where);
  py::object seq = fast_sequence(obj, where, "sequences of ints (one per KV cache group)");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  out.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t g = 0; g < n; ++g) {
    to_ints_into(items[g], where.at(g), out[static_cast<std::size_t>(g)]);
  }
}

std::vector<std::vector<std::int64_t>> to_int_lists(PyObject* obj, const Where& where) {
  std::vector<std::vector<std::int64_t>> out;
  to_int_lists_into(obj, where, out);
  return out;
}

std::vector<std::vector<std::int64_t>> to_int_lists(py::handle obj, const char* what) {
  return to_int_lists(obj.ptr(), Where{what});
}

/// A request id (str) as a view of its UTF-8 (valid while the object lives).
std::string_view id_view(PyObject* item, const Where& where) {
  if (PyUnicode_CheckExact(item) && PyUnicode_IS_COMPACT_ASCII(item)) {
    // every id an engine makes: its bytes follow the object header (what
    // PyUnicode_AsUTF8AndSize returns for it too), read without the call
    return {static_cast<const char*>(PyUnicode_DATA(item)),
            static_cast<std::size_t>(PyUnicode_GET_LENGTH(item))};
  }
  if (!PyUnicode_Check(item)) {
    throw py::type_error(where.str() + " must be a str request id, got " +
                         Py_TYPE(item)->tp_name + " (" + short_repr(item) + ")");
  }
  if (!PyUnicode_CheckExact(item) && (Py_TYPE(item)->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0) {
    // a str subclass written in Python may run its own __hash__ / __eq__ while the binding
    // holds borrowed pointers into the caller's lists
    throw py::type_error(where.str() + " must be a str request id, got the str subclass " +
                         Py_TYPE(item)->tp_name + "; pass str(request_id)");
  }
  Py_ssize_t n = 0;
  const char* data = PyUnicode_AsUTF8AndSize(item, &n);
  if (data == nullptr) {
    throw py::error_already_set();
  }
  return {data, static_cast<std::size_t>(n)};
}

/// A str where a collection of request ids belongs would be read one character per id.
void reject_str(py::handle obj, const char* what) {
  if (PyUnicode_Check(obj.ptr())) {
    throw py::type_error(std::string(what) + " must be a collection of request ids, got the "
                         "single str " + short_repr(obj.ptr()) + "; wrap one id in a list");
  }
}

std::vector<std::string> to_strs(py::handle obj, const char* what) {
  reject_str(obj, what);
  std::vector<std::string> out;
  Py_ssize_t i = 0;
  for (py::handle item : obj) {
    out.emplace_back(id_view(item.ptr(), Where{what}.at(i++)));
  }
  return out;
}

py::list int64_list(const std::vector<std::int64_t>& v) {
  py::list out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    PyObject* x = PyLong_FromLongLong(v[i]);
    if (x == nullptr) {
      throw py::error_already_set();
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), x);
  }
  return out;
}

/// A job as a tuple; `with_keys` false leaves its keys out (an empty list): workers that
/// only copy blocks do not need them.
py::tuple job_tuple(const kvoff::TransferJob& j, bool with_keys = true) {
  return py::make_tuple(j.job_id, j.request_id, j.is_store, int64_list(j.gpu_block_ids),
                        int64_list(j.group_sizes), int64_list(j.block_indices),
                        to_int_list(j.cpu_block_ids),
                        with_keys ? to_bytes_list(j.keys) : py::list());
}

py::list job_list(const std::vector<kvoff::TransferJob>& jobs, bool with_keys = true) {
  py::list out(jobs.size());
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    out[i] = job_tuple(jobs[i], with_keys);
  }
  return out;
}

/// The scheduler's monotonic counters, in the order of COUNTER_NAMES.
/// New counters go at the end: consumers keep their positions.
constexpr std::array<const char*, 14> kCounterNames = {
    "lookups",       "lookup_retries", "hit_tokens",     "load_jobs",
    "store_jobs",    "blocks_loaded",  "blocks_stored",  "store_refusals",
    "blocks_evicted", "blocks_discarded", "stale_blocks_skipped", "jobs_flushed",
    "failed_jobs",   "stores_skipped"};

std::array<std::uint64_t, kCounterNames.size()> counter_values(const kvoff::SchedulerStats& s) {
  return {s.lookups,       s.lookup_retries, s.hit_tokens,     s.load_jobs,
          s.store_jobs,    s.blocks_loaded,  s.blocks_stored,  s.store_refusals,
          s.blocks_evicted, s.blocks_discarded, s.stale_blocks_skipped, s.jobs_flushed,
          s.failed_jobs,   s.stores_skipped};
}

/// The step's jobs packed for shipping (see kvoff.scheduler.OffloadingScheduler.
/// build_connector_meta_packed): one bytes object of native int64s, [num_jobs, num_load_jobs,
/// num_groups], then per job [job_id, is_store, len(gpu_block_ids), len(cpu_block_ids),
/// group_sizes..., block_indices..., gpu_block_ids..., cpu_block_ids...]; and the request id
/// of every job, in the same order (loads first). Keys stay with the scheduler.
py::tuple packed_jobs(const kvoff::ConnectorMetaView& meta, std::size_t num_groups) {
  std::size_t words = 3;
  for (const auto* jobs : {&meta.load_jobs, &meta.store_jobs}) {
    for (const kvoff::TransferJob* j : *jobs) {
      words += 4 + 2 * num_groups + j->gpu_block_ids.size() + j->cpu_block_ids.size();
    }
  }
  const std::size_t num_jobs = meta.load_jobs.size() + meta.store_jobs.size();
  py::bytes packed = py::reinterpret_steal<py::bytes>(
      PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(words * sizeof(std::int64_t))));
  if (!packed) throw py::error_already_set();
  py::tuple ids(num_jobs);
  auto* w = reinterpret_cast<std::int64_t*>(PyBytes_AS_STRING(packed.ptr()));
  *w++ = static_cast<std::int64_t>(num_jobs);
  *w++ = static_cast<std::int64_t>(meta.load_jobs.size());
  *w++ = static_cast<std::int64_t>(num_groups);
  std::size_t k = 0;
  for (const auto* jobs : {&meta.load_jobs, &meta.store_jobs}) {
    for (const kvoff::TransferJob* job : *jobs) {
      const kvoff::TransferJob& j = *job;
      *w++ = static_cast<std::int64_t>(j.job_id);
      *w++ = j.is_store ? 1 : 0;
      *w++ = static_cast<std::int64_t>(j.gpu_block_ids.size());
      *w++ = static_cast<std::int64_t>(j.cpu_block_ids.size());
      w = std::copy(j.group_sizes.begin(), j.group_sizes.end(), w);
      w = std::copy(j.block_indices.begin(), j.block_indices.end(), w);
      w = std::copy(j.gpu_block_ids.begin(), j.gpu_block_ids.end(), w);
      w = std::copy(j.cpu_block_ids.begin(), j.cpu_block_ids.end(), w);
      PyObject* id = PyUnicode_FromStringAndSize(j.request_id.data(),
                                                 static_cast<Py_ssize_t>(j.request_id.size()));
      if (id == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(ids.ptr(), static_cast<Py_ssize_t>(k++), id);
    }
  }
  return py::make_tuple(std::move(packed), std::move(ids));
}

py::list str_list(const std::vector<std::string>& v) {
  py::list out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    out[i] = py::str(v[i]);
  }
  return out;
}

/// The request columns of build_step (request ids, new block ids, computed tokens), each one
/// sequence, or a sequence followed by the matching column of `tail` (vLLM keeps its running
/// and its new requests apart): read as one column without building a joined list, whose
/// reference counts would touch every item.
class StepColumns {
 public:
  /// `joined`: storage for the joined columns (its memory reused between steps).
  StepColumns(py::handle request_ids, py::handle new_block_ids, py::handle num_computed_tokens,
              py::handle tail, std::array<std::vector<PyObject*>, 3>& joined)
      : joined_(joined) {
    static constexpr const char* kNames[3] = {"request_ids", "new_block_ids",
                                              "num_computed_tokens"};
    static constexpr const char* kTailNames[3] = {"tail request_ids", "tail new_block_ids",
                                                  "tail num_computed_tokens"};
    read(0, request_ids, new_block_ids, num_computed_tokens, kNames);
    if (tail.is_none()) {
      for (std::size_t c = 0; c < 3; ++c) items_[c] = PySequence_Fast_ITEMS(seqs_[0][c].ptr());
      return;
    }
    if (!PyTuple_Check(tail.ptr()) || PyTuple_GET_SIZE(tail.ptr()) != 3) {
      throw py::type_error(std::string("tail must be None or a tuple (request_ids, new_block_ids, "
                                       "num_computed_tokens) of the requests after the columns, "
                                       "got ") + Py_TYPE(tail.ptr())->tp_name);
    }
    read(1, PyTuple_GET_ITEM(tail.ptr(), 0), PyTuple_GET_ITEM(tail.ptr(), 1),
         PyTuple_GET_ITEM(tail.ptr(), 2), kTailNames);
    for (std::size_t c = 0; c < 3; ++c) {
      PyObject** head = PySequence_Fast_ITEMS(seqs_[0][c].ptr());
      PyObject** more = PySequence_Fast_ITEMS(seqs_[1][c].ptr());
      joined_[c].assign(head, head + sizes_[0]);
      joined_[c].insert(joined_[c].end(), more, more + sizes_[1]);
      items_[c] = joined_[c].data();
    }
  }
  Py_ssize_t size() const noexcept { return sizes_[0] + sizes_[1]; }
  /// Entries before this index come from the first columns, the others from `tail`.
  Py_ssize_t tail_start() const noexcept { return sizes_[0]; }
  PyObject** ids() const noexcept { return items_[0]; }
  PyObject** blocks() const noexcept { return items_[1]; }
  PyObject** computed() const noexcept { return items_[2]; }

 private:
  void read(std::size_t part, py::handle ids, py::handle blocks, py::handle computed,
            const char* const (&names)[3]) {
    seqs_[part][0] = fast_sequence(ids.ptr(), Where{names[0]}, "str");
    seqs_[part][1] = fast_sequence(blocks.ptr(), Where{names[1]}, "block id lists or None");
    seqs_[part][2] = fast_sequence(computed.ptr(), Where{names[2]}, "ints");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs_[part][0].ptr());
    for (std::size_t c = 1; c < 3; ++c) {
      const Py_ssize_t m = PySequence_Fast_GET_SIZE(seqs_[part][c].ptr());
      if (m != n) {
        throw py::value_error(std::string(names[c]) + " has " + std::to_string(m) +
                              " entries but " + names[0] + " has " + std::to_string(n) +
                              "; give one entry per scheduled request");
      }
    }
    sizes_[part] = n;
  }
  py::object seqs_[2][3];
  Py_ssize_t sizes_[2] = {0, 0};
  std::array<std::vector<PyObject*>, 3>& joined_;
  PyObject** items_[3] = {nullptr, nullptr, nullptr};
};

/// build_step's per-request records and joined columns, kept between steps on the calling
/// thread (Borrowed): `reqs` never shrinks, so each record keeps its block id vectors' memory.
struct StepScratch {
  std::vector<kvoff::ScheduledRequest> reqs;
  /// Per record: its new_block_ids' vectors while it has none this step (the core reads an
  /// empty outer vector as "no new blocks"; clearing it would free the inner vectors).
  std::vector<std::vector<std::vector<std::int64_t>>> spare;
  std::array<std::vector<PyObject*>, 3> joined;
};

/// build_connector_meta from columns (see kvoff.scheduler.OffloadingScheduler.
/// build_connector_meta_columns): request_ids[i], new_block_ids[i] (None or per group a
/// sequence of ints), num_computed_tokens[i]; num_scheduled_tokens a dict by request id
/// (missing: 0) or a sequence aligned with request_ids; resumed_request_ids any container.
/// When `requests` is a dict (request id -> object with block_hashes), each scheduled
/// request's new block hashes are added first (HashSink::add without a token count). Returns
/// (load job tuples, store job tuples, job ids to flush). `tail`: None, or three more columns
/// read after the first three (StepColumns); a num_scheduled_tokens sequence covers both.
py::tuple build_step(kvoff::OffloadingScheduler& self, py::handle request_ids,
                     py::handle new_block_ids, py::handle num_computed_tokens,
                     py::handle num_scheduled_tokens, py::handle resumed_request_ids,
                     py::handle finished, py::handle preempted, py::handle rewritten,
                     py::handle requests, bool with_keys, bool packed, py::handle tail) {
  reject_str(request_ids, "request_ids");
  reject_str(resumed_request_ids, "resumed_request_ids");
  // Any container of resumed ids but the built-in ones becomes a frozenset first: its own
  // __contains__ / __len__ would run while the columns' items are held as borrowed pointers
  py::object resumed_set;
  if (!resumed_request_ids.is_none() && !PyAnySet_CheckExact(resumed_request_ids.ptr()) &&
      !PyList_CheckExact(resumed_request_ids.ptr()) &&
      !PyTuple_CheckExact(resumed_request_ids.ptr())) {
    resumed_set = py::reinterpret_steal<py::object>(PyFrozenSet_New(resumed_request_ids.ptr()));
    if (!resumed_set) throw py::error_already_set();
    resumed_request_ids = resumed_set;
  }
  // The step's records are kept from the last step (their memory is reused); a nested
  // call (a hash source running Python that steps another scheduler) makes its own.
  Borrowed<StepScratch, StepScratch> scratch;
  const StepColumns columns(request_ids, new_block_ids, num_computed_tokens, tail,
                            scratch.get().joined);
  const Py_ssize_t n = columns.size();
  const Py_ssize_t tail_start = tail.is_none() ? n : columns.tail_start();
  PyObject* scheduled_dict = PyDict_Check(num_scheduled_tokens.ptr()) ? num_scheduled_tokens.ptr()
                                                                       : nullptr;
  py::object scheduled_seq;
  if (scheduled_dict == nullptr) {
    scheduled_seq = fast_sequence(num_scheduled_tokens.ptr(), Where{"num_scheduled_tokens"},
                                  "ints (or a dict by request id)");
    if (PySequence_Fast_GET_SIZE(scheduled_seq.ptr()) != n) {
      throw py::value_error("num_scheduled_tokens has " +
                            std::to_string(PySequence_Fast_GET_SIZE(scheduled_seq.ptr())) +
                            " entries but request_ids has " + std::to_string(n));
    }
  }
  const bool any_resumed = !resumed_request_ids.is_none() && PyObject_IsTrue(resumed_request_ids.ptr());
  PyObject* request_dict = PyDict_Check(requests.ptr()) ? requests.ptr() : nullptr;
  static PyObject* const kHashes = PyUnicode_InternFromString("block_hashes");

  PyObject** id_items = columns.ids();
  PyObject** block_items = columns.blocks();
  PyObject** computed_items = columns.computed();
  std::vector<kvoff::ScheduledRequest>& all_reqs = scratch.get().reqs;
  std::vector<std::vector<std::vector<std::int64_t>>>& spare = scratch.get().spare;
  if (all_reqs.size() < static_cast<std::size_t>(n)) {
    all_reqs.resize(static_cast<std::size_t>(n));
    spare.resize(static_cast<std::size_t>(n));
  }
  const std::span<kvoff::ScheduledRequest> reqs(all_reqs.data(), static_cast<std::size_t>(n));
  // The engine's objects are scattered and mostly out of cache by now: the id and count of the
  // request kPrefetchAhead positions on are fetched while this one is read, so that the misses
  // overlap instead of queueing one after the other.
  constexpr Py_ssize_t kPrefetchAhead = 8;
  for (Py_ssize_t i = 0; i < std::min(n, kPrefetchAhead); ++i) {
    __builtin_prefetch(id_items[i]);
    __builtin_prefetch(computed_items[i]);
  }
  // vLLM fills num_scheduled_tokens in scheduling order (running requests first): the dict's
  // next entry is tried first (its key compared by identity, no hashing or probing), then a
  // lookup.
  Py_ssize_t dict_pos = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) {
      __builtin_prefetch(id_items[i + kPrefetchAhead]);
      __builtin_prefetch(computed_items[i + kPrefetchAhead]);
    }
    PyObject* id_obj = id_items[i];
    kvoff::ScheduledRequest& s = reqs[static_cast<std::size_t>(i)];
    const std::string_view id = id_view(id_obj, Where{"request_ids"}.at(i));
    s.num_computed_tokens = to_int64(computed_items[i], Where{"num_computed_tokens"}.at(i));
    if (scheduled_dict != nullptr) {
      PyObject* key = nullptr;
      PyObject* v = nullptr;
      Py_ssize_t next = dict_pos;
      if (PyDict_Next(scheduled_dict, &next, &key, &v) && key == id_obj) {
        dict_pos = next;
      } else {
        v = PyDict_GetItemWithError(scheduled_dict, id_obj);
        if (v == nullptr && PyErr_Occurred()) throw py::error_already_set();
      }
      s.num_scheduled_tokens = v == nullptr ? 0 : to_int64(v, "num_scheduled_tokens");
    } else {
      s.num_scheduled_tokens = to_int64(PySequence_Fast_GET_ITEM(scheduled_seq.ptr(), i),
                                        Where{"num_scheduled_tokens"}.at(i));
    }
    s.request_id = id;  // a view of the str object, alive through the call
    auto& kept = spare[static_cast<std::size_t>(i)];
    if (block_items[i] != Py_None) {
      if (s.new_block_ids.empty() && !kept.empty()) s.new_block_ids.swap(kept);
      to_int_lists_into(block_items[i], Where{"new_block_ids"}.at(i), s.new_block_ids);
    } else if (!s.new_block_ids.empty()) {
      if (kept.empty()) {
        s.new_block_ids.swap(kept);  // kept for a later step, s.new_block_ids now empty
      } else {
        s.new_block_ids.clear();
      }
    }
    // tail entries are requests scheduled as new (vLLM's scheduled_new_reqs): their block ids
    // are the whole table, also for a request seen before (a resumed streaming-input session)
    s.whole_table = i >= tail_start;
    s.resumed_from_preemption = false;
    if (any_resumed) {
      const int in = PySequence_Contains(resumed_request_ids.ptr(), id_obj);
      if (in < 0) throw py::error_already_set();
      s.resumed_from_preemption = in == 1;
    }
  }
  const auto fin = to_strs(finished, "finished_request_ids");
  const auto pre = to_strs(preempted, "preempted_request_ids");
  std::vector<std::int64_t> rewritten_ids = to_ints(rewritten.ptr(), Where{"rewritten_block_ids"});
  // New block hashes come from the engine's request objects (`requests`), read only when the
  // core needs more than it has (once per offloaded block in decode, not every step).
  kvoff::OffloadingScheduler::HashSource source;
  if (request_dict != nullptr) {
    source = [request_dict, id_items](std::size_t index, std::string_view, std::size_t known,
                                      kvoff::OffloadingScheduler::HashSink& sink) {
      // the scheduled request's own id object (its hash is cached: no new str per lookup)
      PyObject* req = PyDict_GetItemWithError(request_dict, id_items[index]);  // borrowed
      if (req == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return;  // not an engine request object: hashes come through update_request
      }
      py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(req, kHashes));
      if (!hashes) throw py::error_already_set();
      const Py_ssize_t num = PyObject_Size(hashes.ptr());
      if (num < 0) throw py::error_already_set();
      if (static_cast<std::size_t>(num) <= known) return;  // none yet (async scheduling)
      // The hashes only: the request's token count matters to lookups, which read it
      // themselves (sync_and_match); num_tokens is a Python property in vLLM, about 0.1 us.
      struct HashViews;
      Borrowed<std::vector<std::string_view>, HashViews> storage;
      KeyBatch batch(hashes, static_cast<Py_ssize_t>(known), &storage.get());  // the new ones
      sink.add(batch.span());
    };
  }
  py::tuple res;
  if (packed) {
    const auto view = self.build_connector_meta_view(reqs, fin, pre, rewritten_ids, source);
    py::tuple jobs = packed_jobs(view, self.config().groups.size());
    py::list flush(view.jobs_to_flush.size());
    for (std::size_t i = 0; i < view.jobs_to_flush.size(); ++i) {
      flush[i] = py::int_(view.jobs_to_flush[i]);
    }
    res = py::make_tuple(jobs[0], jobs[1], flush);
  } else {
    auto meta = self.build_connector_meta(reqs, fin, pre, rewritten_ids, source);
    py::list flush(meta.jobs_to_flush.size());
    for (std::size_t i = 0; i < meta.jobs_to_flush.size(); ++i) {
      flush[i] = py::int_(meta.jobs_to_flush[i]);
    }
    res = py::make_tuple(job_list(meta.load_jobs, with_keys),
                         job_list(meta.store_jobs, with_keys), flush);
  }
  return res;
}

/// An engine request object (attributes `request_id` (str), `block_hashes` (a list of bytes or
/// int hashes), `num_tokens` (int) and, with offload_prompt_only, `num_prompt_tokens` (int))
/// handed to the core in one call: its block hashes beyond
/// those the core has are read in place (no slice), then update_request; the object is kept in
/// `requests` (a dict by request id, read by build_connector_meta's hash source). Returns the
/// id object (a new reference; the view the hooks take is valid while it lives). Raises as
/// update_request; a missing attribute raises AttributeError. Nothing changes on an error.
py::object sync_request(kvoff::OffloadingScheduler& self, py::handle request,
                        py::handle requests) {
  static PyObject* const kId = PyUnicode_InternFromString("request_id");
  static PyObject* const kHashes = PyUnicode_InternFromString("block_hashes");
  static PyObject* const kTokens = PyUnicode_InternFromString("num_tokens");
  py::object id = py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kId));
  if (!id) throw py::error_already_set();
  const std::string_view rid = id_view(id.ptr(), Where{"request.request_id"});
  py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kHashes));
  if (!hashes) throw py::error_already_set();
  py::object tokens = py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kTokens));
  if (!tokens) throw py::error_already_set();
  // offload_prompt_only: the prompt's length (vLLM's num_prompt_tokens), read and checked
  // before anything changes
  std::int64_t prompt_tokens = -1;
  if (self.config().offload_prompt_only) {
    static PyObject* const kPrompt = PyUnicode_InternFromString("num_prompt_tokens");
    py::object prompt =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(request.ptr(), kPrompt));
    if (!prompt) throw py::error_already_set();
    if (!prompt.is_none()) {  // None: the prompt's length is unknown, nothing is limited
      prompt_tokens = to_int64(prompt.ptr(), "request.num_prompt_tokens");
      if (prompt_tokens < 0) {
        throw py::value_error("request.num_prompt_tokens is " + std::to_string(prompt_tokens) +
                              "; it must be the prompt's length in tokens (>= 0)");
      }
    }
  }
  const std::size_t known = self.num_hashes(rid);
  struct SyncViews;
  Borrowed<std::vector<std::string_view>, SyncViews> storage;  // kept between calls
  KeyBatch batch(hashes, static_cast<Py_ssize_t>(known), &storage.get());  // the new ones only
  self.update_request(rid, known, batch.span(), to_int64(tokens.ptr(), "request.num_tokens"));
  if (prompt_tokens >= 0) self.set_prompt_tokens(rid, prompt_tokens);  // checked: no throw
  if (PyDict_Check(requests.ptr()) && PyDict_SetItem(requests.ptr(), id.ptr(), request.ptr()) < 0) {
    throw py::error_already_set();
  }
  return id;
}

/// After a refused call that sync_request began: a request it registered (the count of
/// requests grew from `before`) is forgotten again, in the core and in `requests`, so that a
/// bad call leaves nothing behind. A request known before keeps its state (hashes it was
/// given stay, as the next call would add them anyway).
void forget_if_new(kvoff::OffloadingScheduler& self, std::size_t before, std::string_view rid,
                   const py::object& id, py::handle requests) {
  if (self.num_requests() <= before) return;
  try {
    self.request_finished(rid);  // a new request has no jobs: erased at once
  } catch (...) {
    return;  // the caller's own error is the one to report
  }
  if (PyDict_Check(requests.ptr()) && PyDict_DelItem(requests.ptr(), id.ptr()) < 0) {
    PyErr_Clear();
  }
}

kvoff::GroupKind to_kind(const std::string& name) {
  if (name == "full_attention") return kvoff::GroupKind::kFullAttention;
  if (name == "sliding_window") return kvoff::GroupKind::kSlidingWindow;
  if (name == "mamba") return kvoff::GroupKind::kMamba;
  throw py::value_error("unknown KV cache group kind '" + name +
                        "'; use 'full_attention', 'sliding_window' or 'mamba'");
}

/// _OffloadingScheduler.sync_and_match: sync_request, then the lookup; `(num_tokens | None,
/// load_async)`. A request the call registered is forgotten again on an error.
py::tuple sync_and_match(kvoff::OffloadingScheduler& self, py::handle request,
                         std::int64_t computed, py::handle requests) {
  self.refuse_reentry("get_num_new_matched_tokens");
  const std::size_t before = self.num_requests();
  const py::object id = sync_request(self, request, requests);
  const std::string_view rid = id_view(id.ptr(), Where{"request_id"});
  kvoff::MatchResult r;
  try {
    r = self.get_num_new_matched_tokens(rid, computed);
  } catch (...) {
    forget_if_new(self, before, rid, id, requests);
    throw;
  }
  py::object n = r.num_tokens ? py::object(py::int_(*r.num_tokens)) : py::none();
  return py::make_tuple(n, r.load_async);
}

/// _OffloadingScheduler.sync_and_alloc: sync_request, then update_state_after_alloc. A
/// request the call registered is forgotten again on an error.
void sync_and_alloc(kvoff::OffloadingScheduler& self, py::handle request, py::handle block_ids,
                    std::int64_t num_external_tokens, py::handle requests) {
  self.refuse_reentry("update_state_after_alloc");
  const auto ids = to_int_lists(block_ids, "block_ids");  // validated before any change
  const std::size_t before = self.num_requests();
  const py::object id = sync_request(self, request, requests);
  const std::string_view rid = id_view(id.ptr(), Where{"request_id"});
  try {
    self.update_state_after_alloc(rid, ids, num_external_tokens);
  } catch (...) {
    forget_if_new(self, before, rid, id, requests);
    throw;
  }
}

/// _OffloadingScheduler.update_connector_output_counts: `counts` is {job_id: (ranks that
/// succeeded, ranks that failed)}; every pair is checked before anything is counted.
void update_connector_output_counts(kvoff::OffloadingScheduler& self, py::handle counts) {
  // {job_id: (ranks that succeeded, ranks that failed)} -> one report per rank
  if (!PyDict_Check(counts.ptr())) {
    throw py::type_error(std::string("counts must be a dict {job_id: (succeeded, "
                                     "failed)}, got ") +
                         Py_TYPE(counts.ptr())->tp_name);
  }
  struct Reports;
  Borrowed<std::vector<kvoff::JobReport>, Reports> storage;  // kept between steps
  std::vector<kvoff::JobReport>& reps = storage.get();
  reps.clear();
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(counts.ptr(), &pos, &key, &value)) {
    const std::int64_t id = to_int64(key, "job_id");
    std::array<std::int64_t, 2> pair{-1, -1};
    if ((PyList_CheckExact(value) && PyList_GET_SIZE(value) == 2) ||
        (PyTuple_CheckExact(value) && PyTuple_GET_SIZE(value) == 2)) {
      PyObject** two = PySequence_Fast_ITEMS(value);  // the fast path: no copy
      pair = {to_int64(two[0], "counts[job][0]"), to_int64(two[1], "counts[job][1]")};
    } else {
      const auto v = to_ints(value, Where{"counts[job]"});
      if (v.size() == 2) pair = {v[0], v[1]};
    }
    if (id < 0 || pair[0] < 0 || pair[1] < 0) {
      throw py::value_error(
          "counts[" + std::to_string(id) +
          "] must be a job id >= 0 mapped to (succeeded, failed) rank counts >= 0");
    }
    // checked before one report per rank is made: a huge count must not allocate
    const std::int64_t world = self.config().world_size;
    if (pair[0] > world || pair[1] > world - pair[0]) {
      throw py::value_error(
          "counts[" + std::to_string(id) + "] = (" + std::to_string(pair[0]) + ", " +
          std::to_string(pair[1]) + ") reports more ranks than world_size = " +
          std::to_string(world) + "; each rank reports a job once. Nothing was "
          "changed.");
    }
    for (std::int64_t k = 0; k < pair[0] + pair[1]; ++k) {
      reps.push_back(kvoff::JobReport{static_cast<kvoff::JobId>(id), k < pair[0]});
    }
  }
  self.update_connector_output(reps);
}

/// _OffloadingScheduler.counters_delta: `({name: increase} | None, counters now)`.
py::tuple counters_delta(const kvoff::OffloadingScheduler& self, py::handle seen) {
  // (changes since `seen` as {name: increase} or None when nothing moved, counters
  // now as a tuple); `seen` is an earlier counters() tuple, or None for all zeros
  constexpr std::size_t n = kCounterNames.size();
  const auto now = counter_values(self.stats());
  std::array<std::uint64_t, n> before{};
  if (!seen.is_none()) {
    if (!PyTuple_Check(seen.ptr()) ||
        PyTuple_GET_SIZE(seen.ptr()) != static_cast<Py_ssize_t>(n)) {
      throw py::type_error("seen must be None or a tuple of " + std::to_string(n) +
                           " ints from counters()");
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::int64_t v = to_int64(
          PyTuple_GET_ITEM(seen.ptr(), static_cast<Py_ssize_t>(i)), "seen");
      if (v < 0 || static_cast<std::uint64_t>(v) > now[i]) {
        throw py::value_error(
            std::string("seen[") + std::to_string(i) + "] (" + kCounterNames[i] +
            ") = " + std::to_string(v) + " is not an earlier value of this "
            "scheduler's counter (now " + std::to_string(now[i]) +
            "); pass None or a tuple that counters() or counters_delta() returned");
      }
      before[i] = static_cast<std::uint64_t>(v);
    }
  }
  if (now == before) {
    return py::make_tuple(py::none(), py::reinterpret_borrow<py::object>(seen));
  }
  // the names as interned str objects, made once (a stats call per engine step)
  static const std::array<PyObject*, n> names = [] {
    std::array<PyObject*, n> out{};
    for (std::size_t i = 0; i < n; ++i) {
      out[i] = PyUnicode_InternFromString(kCounterNames[i]);
      if (out[i] == nullptr) throw py::error_already_set();
    }
    return out;
  }();
  py::dict delta;
  py::tuple now_t(n);
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* v = PyLong_FromUnsignedLongLong(now[i]);
    if (v == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(now_t.ptr(), static_cast<Py_ssize_t>(i), v);
    if (now[i] != before[i]) {
      py::object d = py::reinterpret_steal<py::object>(
          PyLong_FromUnsignedLongLong(now[i] - before[i]));
      if (!d || PyDict_SetItem(delta.ptr(), names[i], d.ptr()) < 0) {
        throw py::error_already_set();
      }
    }
  }
  return py::make_tuple(std::move(delta), std::move(now_t));
}

void bind(py::module_& m) {
  using kvoff::OffloadingScheduler;
  {
    py::tuple names(kCounterNames.size());
    for (std::size_t i = 0; i < kCounterNames.size(); ++i) names[i] = py::str(kCounterNames[i]);
    m.attr("COUNTER_NAMES") = names;
  }
  py::class_<OffloadingScheduler>(
      m, "_OffloadingScheduler",
      "_OffloadingScheduler(num_cpu_blocks, eviction_policy, enable_events, gpu_block_size, "
      "block_size_factor, hash_block_size, world_size, num_gpu_blocks, groups, "
      "store_batch_blocks=1, offload_prompt_only=False, store_threshold=0, "
      "max_tracker_size=64000)\n\n"
      "The C++ per-step offloading scheduler. Private: use kvoff.OffloadingScheduler, which "
      "documents every hook (shapes, units, errors).")
      .def(py::init([](std::int64_t num_cpu_blocks, const std::string& eviction_policy,
                       bool enable_events, std::int64_t gpu_block_size,
                       std::int64_t block_size_factor, std::int64_t hash_block_size,
                       std::int64_t world_size, std::int64_t num_gpu_blocks,
                       py::handle groups, std::int64_t store_batch_blocks,
                       bool offload_prompt_only, std::int64_t store_threshold,
                       std::int64_t max_tracker_size) {
             kvoff::SchedulerConfig c;
             c.num_cpu_blocks = num_cpu_blocks;
             c.eviction_policy = eviction_policy;
             c.enable_events = enable_events;
             c.gpu_block_size = gpu_block_size;
             c.block_size_factor = block_size_factor;
             c.hash_block_size = hash_block_size;
             c.world_size = world_size;
             c.num_gpu_blocks = num_gpu_blocks;
             c.store_batch_blocks = store_batch_blocks;
             c.offload_prompt_only = offload_prompt_only;
             c.store_threshold = store_threshold;
             c.max_tracker_size = max_tracker_size;
             for (py::handle g : groups) {
               if (!PyTuple_Check(g.ptr()) || PyTuple_GET_SIZE(g.ptr()) != 2) {
                 throw py::type_error("groups must be (kind, sliding_window) tuples");
               }
               py::tuple t = py::reinterpret_borrow<py::tuple>(g);
               c.groups.push_back(kvoff::SchedulerGroup{to_kind(t[0].cast<std::string>()),
                                                        to_int64(t[1].ptr(), "sliding_window")});
             }
             return std::make_unique<OffloadingScheduler>(std::move(c));
           }),
           py::arg("num_cpu_blocks"), py::arg("eviction_policy"), py::arg("enable_events"),
           py::arg("gpu_block_size"), py::arg("block_size_factor"), py::arg("hash_block_size"),
           py::arg("world_size"), py::arg("num_gpu_blocks"), py::arg("groups"),
           py::arg("store_batch_blocks") = 1, py::arg("offload_prompt_only") = false,
           py::arg("store_threshold") = 0,
           py::arg("max_tracker_size") = CPUOffloadingManager::kDefaultMaxTrackerSize)
      .def("set_prompt_tokens", &OffloadingScheduler::set_prompt_tokens, py::arg("request_id"),
           py::arg("prompt_tokens"))
      .def(
          "update_request",
          [](OffloadingScheduler& self, const std::string& request_id, std::size_t start,
             py::handle hashes, std::int64_t num_tokens) {
            KeyBatch batch(hashes);
            self.update_request(request_id, start, batch.span(), num_tokens);
          },
          py::arg("request_id"), py::arg("start"), py::arg("hashes"), py::arg("num_tokens"))
      .def(
          "get_num_new_matched_tokens",
          [](OffloadingScheduler& self, const std::string& request_id, std::int64_t computed) {
            const auto r = self.get_num_new_matched_tokens(request_id, computed);
            py::object n = r.num_tokens ? py::object(py::int_(*r.num_tokens)) : py::none();
            return py::make_tuple(n, r.load_async);
          },
          py::arg("request_id"), py::arg("num_computed_tokens"))
      .def(
          "sync_and_match",
          sync_and_match,
          py::arg("request"), py::arg("num_computed_tokens"), py::arg("requests"))
      .def(
          "sync_and_alloc",
          sync_and_alloc,
          py::arg("request"), py::arg("block_ids"), py::arg("num_external_tokens"),
          py::arg("requests"))
      .def(
          "update_state_after_alloc",
          [](OffloadingScheduler& self, const std::string& request_id, py::handle block_ids,
             std::int64_t num_external_tokens) {
            const auto ids = to_int_lists(block_ids, "block_ids");
            self.update_state_after_alloc(request_id, ids, num_external_tokens);
          },
          py::arg("request_id"), py::arg("block_ids"), py::arg("num_external_tokens"))
      .def(
          "build_connector_meta",
          [](OffloadingScheduler& self, py::handle request_ids, py::handle new_block_ids,
             py::handle num_computed_tokens, py::handle num_scheduled_tokens,
             py::handle resumed_request_ids, py::handle finished, py::handle preempted,
             py::handle rewritten, py::handle requests, bool with_keys, bool packed,
             py::handle tail) {
            return build_step(self, request_ids, new_block_ids, num_computed_tokens,
                              num_scheduled_tokens, resumed_request_ids, finished, preempted,
                              rewritten, requests, with_keys, packed, tail);
          },
          py::arg("request_ids"), py::arg("new_block_ids"), py::arg("num_computed_tokens"),
          py::arg("num_scheduled_tokens"), py::arg("resumed_request_ids"),
          py::arg("finished_request_ids"), py::arg("preempted_request_ids"),
          py::arg("rewritten_block_ids"), py::arg("requests"), py::arg("with_keys") = true,
          py::arg("packed") = false, py::arg("tail") = py::none())
      .def("num_hashes", &OffloadingScheduler::num_hashes, py::arg("request_id"))
      .def(
          "update_connector_output",
          [](OffloadingScheduler& self, py::handle reports) {
            std::vector<kvoff::JobReport> reps;
            for (py::handle item : reports) {
              py::tuple t = py::reinterpret_borrow<py::tuple>(item);
              if (!PyTuple_Check(item.ptr()) || t.size() != 2) {
                throw py::type_error("reports must be (job_id, success) tuples");
              }
              const std::int64_t id = to_int64(t[0].ptr(), "job_id");
              if (id < 0) {
                throw py::value_error("job_id must be >= 0, got " + std::to_string(id));
              }
              reps.push_back(
                  kvoff::JobReport{static_cast<kvoff::JobId>(id), t[1].cast<bool>()});
            }
            auto out = self.update_connector_output(reps);
            py::list done(out.completed_jobs.size());
            for (std::size_t i = 0; i < out.completed_jobs.size(); ++i) {
              done[i] = py::int_(out.completed_jobs[i]);
            }
            py::list failed(out.failed_jobs.size());
            for (std::size_t i = 0; i < out.failed_jobs.size(); ++i) {
              failed[i] = py::int_(out.failed_jobs[i]);
            }
            return py::make_tuple(str_list(out.finished_loading), str_list(out.failed_loading),
                                  str_list(out.finished_storing), done, failed);
          },
          py::arg("reports"))
      .def(
          "update_connector_output_counts",
          update_connector_output_counts,
          py::arg("counts"))
      .def("request_finished", &OffloadingScheduler::request_finished, py::arg("request_id"))
      .def("fast_hooks", [](py::object self) { return fast::make(std::move(self)); })
      .def("take_events",
           [](OffloadingScheduler& self) { return events_to_py(self.take_events()); })
      .def("reset_cache", &OffloadingScheduler::reset_cache)
      .def_property_readonly(
          "manager",
          [](OffloadingScheduler& self) -> CPUOffloadingManager& { return self.manager(); },
          py::return_value_policy::reference_internal,
          "The scheduler's own CPUOffloadingManager (kept alive by the scheduler object), for "
          "kvoff.tiers.coordinator.TieredPool only: promotions store keys no request stores, "
          "and write-through uses the manager's thread-safe calls. Any other call that changes "
          "it breaks the scheduler's job bookkeeping.")
      .def("stats",
           [](const OffloadingScheduler& self) {
             const auto& s = self.stats();
             py::dict d;
             d["lookups"] = s.lookups;
             d["lookup_retries"] = s.lookup_retries;
             d["hit_tokens"] = s.hit_tokens;
             d["load_jobs"] = s.load_jobs;
             d["store_jobs"] = s.store_jobs;
             d["blocks_loaded"] = s.blocks_loaded;
             d["blocks_stored"] = s.blocks_stored;
             d["store_refusals"] = s.store_refusals;
             d["blocks_evicted"] = s.blocks_evicted;
             d["blocks_discarded"] = s.blocks_discarded;
             d["stale_blocks_skipped"] = s.stale_blocks_skipped;
             d["jobs_flushed"] = s.jobs_flushed;
             d["failed_jobs"] = s.failed_jobs;
             d["stores_skipped"] = s.stores_skipped;
             d["num_requests"] = self.num_requests();
             d["num_jobs_in_flight"] = self.num_jobs_in_flight();
             const auto& mgr = self.manager();
             d["num_cpu_blocks"] = mgr.num_blocks();
             d["num_free_blocks"] = mgr.num_free_blocks();
             d["num_stored_blocks"] = mgr.num_stored_blocks();
             d["num_pending_blocks"] = mgr.num_pending_blocks();
             d["num_retired_blocks"] = mgr.num_retired_blocks();
             d["num_evictable_blocks"] = mgr.num_evictable_blocks();
             return d;
           })
      .def("pool_usage",
           [](const OffloadingScheduler& self) {
             // (blocks, pinned by transfers, pending stores), for usage gauges every step
             const auto& mgr = self.manager();
             const std::uint32_t n = mgr.num_blocks();
             return py::make_tuple(n, n - mgr.num_free_blocks() - mgr.num_evictable_blocks(),
                                   mgr.num_pending_blocks());
           })
      .def("counters",
           [](const OffloadingScheduler& self) {
             const auto now = counter_values(self.stats());  // the order of COUNTER_NAMES
             py::tuple out(now.size());
             for (std::size_t i = 0; i < now.size(); ++i) out[i] = py::int_(now[i]);
             return out;
           })
      .def(
          "counters_delta",
          counters_delta,
          py::arg("seen"))
      .def("block_state",
           [](const OffloadingScheduler& self, py::handle key) {
             std::array<char, 8> buf{};
             return std::string(
                 kvoff::to_string(self.manager().state(to_key(key.ptr(), "key", -1, buf))));
           },
           py::arg("key"))
      .def("block_id",
           [](const OffloadingScheduler& self, py::handle key) -> py::object {
             std::array<char, 8> buf{};
             const auto id = self.manager().block_id(to_key(key.ptr(), "key", -1, buf));
             return id ? py::object(py::int_(*id)) : py::none();
           },
           py::arg("key"))
      .def("pin_count",
           [](const OffloadingScheduler& self, py::handle key) {
             std::array<char, 8> buf{};
             return self.manager().pin_count(to_key(key.ptr(), "key", -1, buf));
           },
           py::arg("key"))
      .def("next_store_block", &OffloadingScheduler::next_store_block, py::arg("request_id"))
      .def_property_readonly("store_batch_blocks", &OffloadingScheduler::store_batch_blocks)
      .def_property_readonly(
          "offload_prompt_only",
          [](const OffloadingScheduler& self) { return self.config().offload_prompt_only; })
      .def("num_flushes_pending", &OffloadingScheduler::num_flushes_pending);
}

}  // namespace sched

// ------------------------------------------------------------------ fast hook entry points
// The engine calls a few scheduler hooks every step, each after its own work has evicted the
// caches. pybind11's dispatcher then costs more than the hook: with cold caches a no-op
// pybind11 method takes ~20 us where a CPython builtin takes ~4 us (kvoff bench, 2-core EPYC,
// bench/results/pybind-dispatch-cold-2026-11-27.json). These hooks are also plain CPython
// methods of a small object that holds the scheduler (FastHooks), with the same code and
// errors as the pybind11 methods of the same names.
namespace fast {

struct FastHooks {
  PyObject_HEAD
  kvoff::OffloadingScheduler* core;  // owned by `owner`
  PyObject* owner;                   // the _OffloadingScheduler (a strong reference)
};

PyTypeObject* fast_hooks_type = nullptr;

kvoff::OffloadingScheduler& core_of(PyObject* self) {
  return *reinterpret_cast<FastHooks*>(self)->core;
}

/// Runs a hook and turns C++ exceptions into Python ones as pybind11's default translators do
/// (no custom translator is registered in this module).
template <typename F>
PyObject* guarded(F&& f) noexcept {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::domain_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::length_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::range_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::overflow_error& e) {
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "kvoff: unknown C++ exception");
  }
  return nullptr;
}

/// `nargs` positional arguments, exactly `n` of them (the hooks take no keywords).
bool check_nargs(const char* name, Py_ssize_t nargs, Py_ssize_t n) {
  if (nargs == n) return true;
  PyErr_Format(PyExc_TypeError, "_FastHooks.%s takes %zd positional arguments, got %zd", name,
               n, nargs);
  return false;
}

/// An int argument as pybind11's std::int64_t caster takes it (an int, or an object with
/// __index__), with kvoff's error naming the argument.
std::int64_t int_arg(PyObject* obj, const char* what) {
  if (!PyLong_Check(obj) && !PyBool_Check(obj) && !PyFloat_Check(obj) && PyIndex_Check(obj)) {
    py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(obj));
    if (!i) throw py::error_already_set();
    return sched::to_int64(i.ptr(), what);
  }
  return sched::to_int64(obj, what);
}

bool bool_arg(PyObject* obj, const char* what) {
  if (obj == Py_True) return true;
  if (obj == Py_False) return false;
  throw py::type_error(std::string(what) + " must be a bool, got " + Py_TYPE(obj)->tp_name);
}

PyObject* sync_and_match(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("sync_and_match", nargs, 3)) return nullptr;
  return guarded([&] {
    return sched::sync_and_match(core_of(self), args[0], int_arg(args[1], "num_computed_tokens"),
                                 args[2])
        .release()
        .ptr();
  });
}

PyObject* sync_and_alloc(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("sync_and_alloc", nargs, 4)) return nullptr;
  return guarded([&] {
    sched::sync_and_alloc(core_of(self), args[0], args[1],
                          int_arg(args[2], "num_external_tokens"), args[3]);
    return Py_NewRef(Py_None);
  });
}

PyObject* build_connector_meta(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("build_connector_meta", nargs, 12)) return nullptr;
  return guarded([&] {
    return sched::build_step(core_of(self), args[0], args[1], args[2], args[3], args[4],
                             args[5], args[6], args[7], args[8],
                             bool_arg(args[9], "with_keys"), bool_arg(args[10], "packed"),
                             args[11])
        .release()
        .ptr();
  });
}

PyObject* update_connector_output_counts(PyObject* self, PyObject* counts) {
  return guarded([&] {
    sched::update_connector_output_counts(core_of(self), counts);
    return Py_NewRef(Py_None);
  });
}

PyObject* counters_delta(PyObject* self, PyObject* seen) {
  return guarded([&] { return sched::counters_delta(core_of(self), seen).release().ptr(); });
}

PyObject* take_events(PyObject* self, PyObject* /*unused*/) {
  return guarded([&] { return events_to_py(core_of(self).take_events()).release().ptr(); });
}

/// With store batching, a finishing request's block hashes the core lacks are read from the
/// engine's request object (`block_hashes`) first, so that its last blocks can be stored; a
/// request whose hashes cannot be read finishes anyway, storing the blocks whose hashes are
/// known.
void pull_last_hashes(kvoff::OffloadingScheduler& core, std::string_view rid,
                      PyObject* request) {
  if (request == Py_None || core.store_batch_blocks() <= 1 || core.next_store_block(rid) < 0) {
    return;
  }
  static PyObject* const kHashes = PyUnicode_InternFromString("block_hashes");
  py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(request, kHashes));
  if (!hashes) {
    PyErr_Clear();
    return;
  }
  const std::size_t known = core.num_hashes(rid);
  const Py_ssize_t n = PyList_Check(hashes.ptr()) ? PyList_GET_SIZE(hashes.ptr())
                                                  : PyObject_Length(hashes.ptr());
  if (n < 0) {
    PyErr_Clear();
    return;
  }
  if (static_cast<std::size_t>(n) <= known) return;
  try {
    KeyBatch batch(hashes, static_cast<Py_ssize_t>(known));
    core.add_hashes(rid, known, batch.span());
  } catch (const py::error_already_set&) {  // bad hashes: the blocks whose hashes are known
  } catch (const py::builtin_exception&) {   // are stored
  } catch (const std::invalid_argument&) {
  }
}

/// (request_id, request or None) -> int: bit 0, jobs of the request in flight; bit 1, a store
/// of its waiting blocks is due (store batching: the next build_connector_meta emits it).
/// OffloadingScheduler::finish_request's answer.
PyObject* request_finished(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("request_finished", nargs, 2)) return nullptr;
  return guarded([&] {
    const auto rid = sched::id_view(args[0], sched::Where{"request_id"});
    auto& core = core_of(self);
    core.refuse_reentry("request_finished");
    pull_last_hashes(core, rid, args[1]);
    const kvoff::FinishResult f = core.finish_request(rid);
    return PyLong_FromLong((f.jobs_in_flight ? 1 : 0) | (f.store_due ? 2 : 0));
  });
}

void dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  Py_CLEAR(reinterpret_cast<FastHooks*>(self)->owner);
  tp->tp_free(self);
  Py_DECREF(tp);
}

PyMethodDef methods[] = {
    {"sync_and_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sync_and_match)),
     METH_FASTCALL, nullptr},
    {"sync_and_alloc", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sync_and_alloc)),
     METH_FASTCALL, nullptr},
    {"build_connector_meta",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(build_connector_meta)),
     METH_FASTCALL, nullptr},
    {"update_connector_output_counts", update_connector_output_counts, METH_O, nullptr},
    {"counters_delta", counters_delta, METH_O, nullptr},
    {"take_events", take_events, METH_NOARGS, nullptr},
    {"request_finished", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(request_finished)),
     METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(dealloc)},
    {Py_tp_methods, methods},
    {Py_tp_doc, const_cast<char*>(
                    "The scheduler's per-step hooks as plain CPython methods (see "
                    "_OffloadingScheduler.fast_hooks).")},
    {0, nullptr},
};

// not instantiable from Python: only make() sets `core`
PyType_Spec spec = {"kvoff._scheduler._FastHooks", sizeof(FastHooks), 0,
                    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};

py::object make(py::object owner) {
  auto& core = owner.cast<kvoff::OffloadingScheduler&>();
  auto* o = PyObject_New(FastHooks, fast_hooks_type);
  if (o == nullptr) throw py::error_already_set();
  o->core = &core;
  o->owner = owner.release().ptr();
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(o));
}

}  // namespace fast

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
                       bool enable_events, py::handle store_threshold,
                       py::handle max_tracker_size) {
             const std::int64_t n = to_num_blocks(num_blocks);
             const std::int64_t threshold =
                 to_int_arg(store_threshold, "store_threshold", "0 (off) or 2..2**20");
             const std::int64_t tracker =
                 to_int_arg(max_tracker_size, "max_tracker_size", "1..2**31-1 keys");
             return std::make_unique<CPUOffloadingManager>(n, eviction_policy, enable_events,
                                                           threshold, tracker);
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
          [](CPUOffloadingManager& self, py::handle keys, bool apply_threshold) -> py::object {
            KeyBatch batch(keys);
            auto result = self.prepare_store(batch.span(), apply_threshold);
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
          [](CPUOffloadingManager& self, py::handle keys, bool success, bool write_through) {
            KeyBatch batch(keys);
            self.complete_store(batch.span(), success, write_through);
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
            const std::vector<std::int64_t> block_ids =
                sched::to_ints(ids_obj.ptr(), sched::Where{"block_ids"});
            std::vector<std::uint32_t> ids(block_ids.size());
            for (std::size_t i = 0; i < block_ids.size(); ++i) {
              if (block_ids[i] < 0 || block_ids[i] > 0xFFFFFFFFLL) {
                throw std::invalid_argument(
                    "write_through_done: block_ids[" + std::to_string(i) + "] = " +
                    std::to_string(block_ids[i]) +
                    " is not a CPU block id; pass the block_ids of a take_write_through batch. "
                    "Nothing was changed.");
              }
              ids[i] = static_cast<std::uint32_t>(block_ids[i]);
            }
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
      .def("clear", &CPUOffloadingManager::clear, py::arg("include_in_flight") = false,
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
      .def_property_readonly("num_retired_blocks", &CPUOffloadingManager::num_retired_blocks,
                             py::doc("int: slots of blocks clear() or discard() dropped while "
                                     "a tier writer still reads them; freed when it hands them "
                                     "back. free + stored + pending + retired = num_blocks."))
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

  fast::fast_hooks_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&fast::spec));
  if (fast::fast_hooks_type == nullptr) throw py::error_already_set();
  m.attr("_FastHooks") = py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(fast::fast_hooks_type));  // the module keeps one more
  sched::bind(m);  // _OffloadingScheduler

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

  // ===================================================================== benchmark driver
  // `kvoff bench scheduler` (kvoff/bench.py): the manager's in-core path, timed in C++ with
  // keys generated in C++ (kvoff/manager_bench.h). Private (underscore): not a stable API.
  m.def(
      "_bench_manager",
      [](std::int64_t num_blocks, const std::string& eviction_policy, std::size_t key_bytes,
         std::size_t batch, std::size_t batches_per_round, std::size_t repeat,
         std::uint64_t seed) {
        kvoff::ManagerBenchConfig config;
        config.num_blocks = num_blocks;
        config.eviction_policy = eviction_policy;
        config.key_bytes = key_bytes;
        config.batch = batch;
        config.batches_per_round = batches_per_round;
        config.repeat = repeat;
        config.seed = seed;
        kvoff::ManagerBenchResult r;
        {
          py::gil_scoped_release release;
          r = kvoff::run_manager_bench(config);
        }
        const auto timing = [](const kvoff::ManagerBenchTiming& t) {
          py::dict d;
          d["keys"] = t.keys;
          d["calls"] = t.calls;
          d["seconds"] = t.seconds;
          d["best_seconds"] = t.best_seconds;
          d["ns_per_key"] = t.ns_per_key;
          d["keys_per_s"] = t.keys_per_s;
          d["calls_per_s"] = t.calls_per_s;
          return d;
        };
        py::dict out;
        out["lookup"] = timing(r.lookup);
        out["prepare_store"] = timing(r.prepare_store);
        out["complete_store"] = timing(r.complete_store);
        out["lookup_hits"] = r.lookup_hits;
        out["evicted"] = r.evicted;
        out["setup_seconds"] = r.setup_seconds;
        return out;
      },
      py::arg("num_blocks"), py::arg("eviction_policy") = "lru", py::arg("key_bytes") = 9,
      py::arg("batch") = 256, py::arg("batches_per_round") = 1024, py::arg("repeat") = 5,
      py::arg("seed") = 0,
      py::doc("_bench_manager(num_blocks: int, eviction_policy: str = \"lru\", key_bytes: int = "
              "9, batch: int = 256, batches_per_round: int = 1024, repeat: int = 5, seed: int = "
              "0) -> dict\n\n"
              "Benchmarks CPUOffloadingManager in C++ (keys generated and passed in C++, the GIL "
              "released): fills a pool of num_blocks slots, then times lookup, prepare_store "
              "(with eviction) and complete_store calls of `batch` keys; see "
              "kvoff/manager_bench.h for the exact workload. Returns {op: {keys, calls, seconds "
              "(median round), best_seconds, ns_per_key, keys_per_s, calls_per_s}} for op in "
              "lookup, prepare_store, complete_store, plus lookup_hits and evicted (workload "
              "totals of one round) and setup_seconds.\n\n"
              "Raises:\n    ValueError: a parameter out of range or an unknown eviction policy "
              "(naming it)."));
  // =================================================================== end benchmark driver
}
