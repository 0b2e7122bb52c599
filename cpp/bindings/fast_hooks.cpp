// kvoff._scheduler._FastHooks: the scheduler hooks the engine calls every step, as plain
// CPython methods beside the pybind11 methods of _OffloadingScheduler (why both: below). Each
// method only unpacks its arguments and calls the function in scheduler_hooks.h that the
// pybind11 method of the same name calls too, so the two share their code and their errors.
//
// Why this type exists: each of these hooks runs after the engine's own work has evicted the
// caches, and then pybind11's dispatcher costs more than the hook: with cold caches a no-op
// pybind11 method takes ~20 us where a CPython builtin takes ~4 us (kvoff bench, 2-core EPYC,
// bench/results/scheduler/pybind-dispatch-cold-2026-11-27.json).
// kvoff.scheduler.OffloadingScheduler calls the hooks through this object
// (_OffloadingScheduler.fast_hooks()).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "bindings.h"
#include "convert.h"
#include "kvoff/offloading_scheduler.h"
#include "scheduler_hooks.h"

namespace kvoff::bindings {

namespace {

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
    return to_int64(i.ptr(), what);
  }
  return to_int64(obj, what);
}

PyObject* fast_sync_and_match(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("sync_and_match", nargs, 3)) return nullptr;
  return guarded([&] {
    return sync_and_match(core_of(self), args[0], int_arg(args[1], "num_computed_tokens"),
                          args[2])
        .release()
        .ptr();
  });
}

PyObject* fast_sync_and_alloc(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("sync_and_alloc", nargs, 4)) return nullptr;
  return guarded([&] {
    sync_and_alloc(core_of(self), args[0], args[1], int_arg(args[2], "num_external_tokens"),
                   args[3]);
    return Py_NewRef(Py_None);
  });
}

PyObject* fast_build_connector_meta(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("build_connector_meta", nargs, 12)) return nullptr;
  return guarded([&] {
    return build_step(core_of(self), args[0], args[1], args[2], args[3], args[4], args[5],
                      args[6], args[7], args[8], to_bool(args[9], "with_keys"),
                      to_bool(args[10], "packed"), args[11])
        .release()
        .ptr();
  });
}

PyObject* fast_update_connector_output_counts(PyObject* self, PyObject* counts) {
  return guarded([&] {
    update_connector_output_counts(core_of(self), counts);
    return Py_NewRef(Py_None);
  });
}

PyObject* fast_counters_delta(PyObject* self, PyObject* seen) {
  return guarded([&] { return counters_delta(core_of(self), seen).release().ptr(); });
}

PyObject* fast_take_events(PyObject* self, PyObject* /*unused*/) {
  return guarded([&] { return events_to_py(core_of(self).take_events()).release().ptr(); });
}

/// (request_id, request or None) -> int: bit 0, jobs of the request in flight; bit 1, a store
/// of its waiting blocks is due (store batching: the next build_connector_meta emits it).
/// OffloadingScheduler::finish_request's answer (see finish_request).
PyObject* fast_request_finished(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("request_finished", nargs, 2)) return nullptr;
  return guarded([&] {
    const kvoff::FinishResult f = finish_request(core_of(self), args[0], args[1]);
    return PyLong_FromLong((f.jobs_in_flight ? 1 : 0) | (f.store_due ? 2 : 0));
  });
}

void dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  Py_CLEAR(reinterpret_cast<FastHooks*>(self)->owner);
  tp->tp_free(self);
  Py_DECREF(tp);
}

/// A METH_FASTCALL function as the PyCFunction the method table holds (CPython calls it with
/// its own signature, by the flag).
PyCFunction fastcall(PyObject* (*f)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef methods[] = {
    {"sync_and_match", fastcall(fast_sync_and_match), METH_FASTCALL, nullptr},
    {"sync_and_alloc", fastcall(fast_sync_and_alloc), METH_FASTCALL, nullptr},
    {"build_connector_meta", fastcall(fast_build_connector_meta), METH_FASTCALL, nullptr},
    {"update_connector_output_counts", fast_update_connector_output_counts, METH_O, nullptr},
    {"counters_delta", fast_counters_delta, METH_O, nullptr},
    {"take_events", fast_take_events, METH_NOARGS, nullptr},
    {"request_finished", fastcall(fast_request_finished), METH_FASTCALL, nullptr},
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

// not instantiable from Python: only make_fast_hooks() sets `core`
PyType_Spec spec = {"kvoff._scheduler._FastHooks", sizeof(FastHooks), 0,
                    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, slots};

}  // namespace

void bind_fast_hooks(py::module_& m) {
  fast_hooks_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
  if (fast_hooks_type == nullptr) throw py::error_already_set();
  m.attr("_FastHooks") = py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(fast_hooks_type));  // the module keeps one more
}

py::object make_fast_hooks(py::object owner) {
  auto& core = owner.cast<kvoff::OffloadingScheduler&>();
  auto* o = PyObject_New(FastHooks, fast_hooks_type);
  if (o == nullptr) throw py::error_already_set();
  o->core = &core;
  o->owner = owner.release().ptr();
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(o));
}

}  // namespace kvoff::bindings
