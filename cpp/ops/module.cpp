// The Python module kvoff._C. It defines no Python functions: importing it loads this shared
// library, whose static initializers register the torch.ops.kvoff schemas (ops.cpp) and
// kernels. Plain Python C API, no pybind11 (torch bundles its own pybind11).
#include <Python.h>

namespace {

PyModuleDef kvoff_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",  // m_name
    "kvoff._C: loads the torch.ops.kvoff operators (copy_blocks).",  // m_doc
    -1,       // m_size: no per-module state
    nullptr,  // m_methods
    nullptr,  // m_slots
    nullptr,  // m_traverse
    nullptr,  // m_clear
    nullptr,  // m_free
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&kvoff_c_module);
}
