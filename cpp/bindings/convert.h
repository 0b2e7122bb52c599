// Conversions between Python objects and the C++ core's types, for the kvoff._scheduler
// binding (an internal header of cpp/bindings/; it includes no torch header). Keys cross the
// boundary as bytes (ints are accepted and converted to 8 little-endian bytes); ints, request
// ids and nested block id lists are read with errors that name the bad value (TypeError for a
// wrong type, ValueError for a wrong value), which the tests check word for word.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/offloading_manager.h"  // kvoff::KeySpan

namespace kvoff::bindings {

namespace py = pybind11;

// ------------------------------------------------------------------------- keys

/// repr(obj), cut to 80 characters, for error messages.
std::string short_repr(PyObject* obj);

/// Converts one key object into a byte view. bytes are viewed in place; an int is written as
/// 8 little-endian bytes into `buf`. `index` < 0 names a single key (not a batch element).
std::string_view to_key(PyObject* item, const char* what, Py_ssize_t index,
                        std::array<char, 8>& buf);

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
  /// Raises TypeError for a single key or an unordered container in place of a sequence, or a
  /// key that is neither bytes nor int; ValueError for b'' or an int beyond 64 bits.
  explicit KeyBatch(py::handle obj, Py_ssize_t start = 0,
                    std::vector<std::string_view>* storage = nullptr);

  // views_ may refer to own_views_: a copy or move would point into the source
  KeyBatch(const KeyBatch&) = delete;
  KeyBatch& operator=(const KeyBatch&) = delete;

  kvoff::KeySpan span() const noexcept { return views_; }

  /// The keys at `positions` (ascending positions into this batch) as Python bytes: bytes items
  /// of the batch are returned as the same objects (no copy).
  py::list items_as_bytes(const std::vector<std::uint32_t>& positions) const;

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

/// CPU block ids as a list of Python ints.
py::list to_int_list(const std::vector<std::uint32_t>& ids);

/// A list of bytes keys from any sequence of bytes / int (for the record constructors).
py::list normalized_keys(py::handle keys);

/// A list of ints from any iterable of ints (for the record constructors); TypeError naming
/// the type of an item that is not an int (a bool included).
py::list normalized_ids(py::handle ids);

/// CPUOffloadingManager's num_blocks: TypeError for anything but an int (a bool included),
/// ValueError (kvoff::bad_num_blocks_message) for one beyond 64 bits.
std::int64_t to_num_blocks(py::handle obj);

/// An int argument of CPUOffloadingManager(): TypeError for anything else (a bool included),
/// ValueError naming `range` for one beyond 64 bits (the core checks the range itself).
std::int64_t to_int_arg(py::handle obj, const char* name, const char* range);

// ------------------------------------------------------------------------- ints, ids, lists

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

/// An int (not a bool) as int64: TypeError naming `where` for another type, ValueError for one
/// beyond 64 bits.
std::int64_t to_int64(PyObject* item, const Where& where);
std::int64_t to_int64(PyObject* item, const char* what);

/// A flag argument: True or False (numpy's bool scalar too). TypeError naming `what` for
/// anything else, None and ints included: pybind11's own bool conversion takes None as False,
/// which would turn a bad call (say, complete_store(keys, success=None)) into dropped stores.
bool to_bool(PyObject* obj, const char* what);
inline bool to_bool(py::handle obj, const char* what) { return to_bool(obj.ptr(), what); }

/// A sequence as a fast sequence (a new reference), or a TypeError naming `where`.
py::object fast_sequence(PyObject* obj, const Where& where, const char* of);

/// Block ids come as nested sequences read while the step's columns are held as borrowed
/// pointers: a sequence type written in Python (its __iter__ / __len__ is user code) is refused;
/// built-in and C types (list, tuple, range, numpy arrays) are read as usual.
void reject_python_sequence(PyObject* obj, const Where& where);

/// A sequence of ints into `out`, reusing its storage (a step's scratch, see StepScratch).
void to_ints_into(PyObject* obj, const Where& where, std::vector<std::int64_t>& out);
std::vector<std::int64_t> to_ints(PyObject* obj, const Where& where);

/// Per KV cache group, a list of ints into `out` (reusing its vectors' storage): `obj` is a
/// sequence (one entry per group) of sequences.
void to_int_lists_into(PyObject* obj, const Where& where,
                       std::vector<std::vector<std::int64_t>>& out);
std::vector<std::vector<std::int64_t>> to_int_lists(PyObject* obj, const Where& where);
std::vector<std::vector<std::int64_t>> to_int_lists(py::handle obj, const char* what);

/// A request id (str) as a view of its UTF-8 (valid while the object lives).
std::string_view id_view(PyObject* item, const Where& where);

/// A str where a collection of request ids belongs would be read one character per id.
void reject_str(py::handle obj, const char* what);

/// A collection of request ids (str) as strings; TypeError for a single str.
std::vector<std::string> to_strs(py::handle obj, const char* what);

/// int64s / strings as a list of Python ints / str.
py::list int64_list(const std::vector<std::int64_t>& v);
py::list str_list(const std::vector<std::string>& v);

}  // namespace kvoff::bindings
