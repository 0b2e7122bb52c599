// Conversions between Python objects and the core's types (declared in convert.h).
#include "convert.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/offloading_manager.h"

namespace kvoff::bindings {

namespace {

std::string item_name(const char* what, Py_ssize_t index) {
  return index < 0 ? std::string(what) : std::string(what) + "[" + std::to_string(index) + "]";
}

}  // namespace

// ------------------------------------------------------------------------- keys

std::string short_repr(PyObject* obj) {
  std::string r = py::repr(py::handle(obj)).cast<std::string>();
  if (r.size() > 80) {
    r = r.substr(0, 77) + "...";
  }
  return r;
}

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

KeyBatch::KeyBatch(py::handle obj, Py_ssize_t start, std::vector<std::string_view>* storage)
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

py::list KeyBatch::items_as_bytes(const std::vector<std::uint32_t>& positions) const {
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

py::list normalized_keys(py::handle keys) {
  KeyBatch batch(keys);
  const auto span = batch.span();
  py::list out(span.size());
  for (std::size_t i = 0; i < span.size(); ++i) {
    PyObject* b =
        PyBytes_FromStringAndSize(span[i].data(), static_cast<Py_ssize_t>(span[i].size()));
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
      throw py::type_error(std::string("block_ids must be ints, got ") +
                           Py_TYPE(id.ptr())->tp_name);
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

// ------------------------------------------------------------------------- ints, ids, lists

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

bool to_bool(PyObject* obj, const char* what) {
  if (obj == Py_True) return true;
  if (obj == Py_False) return false;
  const std::string_view type = Py_TYPE(obj)->tp_name;
  if (type == "numpy.bool" || type == "numpy.bool_") {  // numpy 2 / numpy 1 names
    const int v = PyObject_IsTrue(obj);
    if (v < 0) throw py::error_already_set();
    return v != 0;
  }
  throw py::type_error(std::string(what) + " must be a bool (True or False), got " +
                       std::string(type) + " (" + short_repr(obj) + ")");
}

py::object fast_sequence(PyObject* obj, const Where& where, const char* of) {
  PyObject* seq = PySequence_Fast(obj, "");
  if (seq == nullptr) {
    PyErr_Clear();
    throw py::type_error(where.str() + " must be a sequence of " + of + ", got " +
                         Py_TYPE(obj)->tp_name);
  }
  return py::reinterpret_steal<py::object>(seq);
}

void reject_python_sequence(PyObject* obj, const Where& where) {
  if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj) &&
      (Py_TYPE(obj)->tp_flags & Py_TPFLAGS_HEAPTYPE) != 0) {
    throw py::type_error(where.str() + " must be a list or tuple, got the Python class " +
                         Py_TYPE(obj)->tp_name + "; pass list(...)");
  }
}

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

py::list str_list(const std::vector<std::string>& v) {
  py::list out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    out[i] = py::str(v[i]);
  }
  return out;
}

}  // namespace kvoff::bindings
