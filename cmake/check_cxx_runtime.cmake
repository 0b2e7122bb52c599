# cmake -DMODULE=<so> -DNM=<nm> -DREADELF=<readelf> [-DLINK_MAP=<map>] -P check_cxx_runtime.cmake
#
# Fails when the shared object MODULE defines symbols that only libstdc++ itself defines (a
# static copy of the C++ runtime was linked in) or does not list libstdc++.so among its NEEDED
# libraries. See KvoffCxxRuntime.cmake for why this matters.
#
# The probe symbols are non-template functions or explicit instantiations that live in
# libstdc++'s own objects; user code never defines them:
#   _ZNSt6locale7classicEv        std::locale::classic()
#   _ZNSt8ios_base4InitC1Ev       std::ios_base::Init::Init()
#   _ZNSo9_M_insertImEERSoT_      std::ostream::_M_insert<unsigned long>(unsigned long)
set(_probes _ZNSt6locale7classicEv _ZNSt8ios_base4InitC1Ev _ZNSo9_M_insertImEERSoT_)

execute_process(COMMAND "${NM}" -D --defined-only "${MODULE}"
                OUTPUT_VARIABLE _syms RESULT_VARIABLE _rc ERROR_QUIET)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "kvoff: `${NM} -D --defined-only ${MODULE}` failed (${_rc})")
endif()
set(_found "")
foreach(_p IN LISTS _probes)
  if(_syms MATCHES " [TtWw] ${_p}\n")
    list(APPEND _found "${_p}")
  endif()
endforeach()

execute_process(COMMAND "${READELF}" -d "${MODULE}"
                OUTPUT_VARIABLE _dyn RESULT_VARIABLE _rc ERROR_QUIET)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "kvoff: `${READELF} -d ${MODULE}` failed (${_rc})")
endif()
set(_needs_shared OFF)
if(_dyn MATCHES "\\(NEEDED\\)[^\n]*\\[libstdc\\+\\+\\.so")
  set(_needs_shared ON)
endif()

if(_found OR NOT _needs_shared)
  set(_from "")
  if(LINK_MAP AND EXISTS "${LINK_MAP}")
    file(STRINGS "${LINK_MAP}" _archives REGEX "lib(stdc\\+\\+|supc\\+\\+)[^ ]*\\.a")
    list(REMOVE_DUPLICATES _archives)
    list(SUBLIST _archives 0 5 _archives)
    if(_archives)
      string(REPLACE ";" "\n    " _archives "${_archives}")
      set(_from "\nThe link map (${LINK_MAP}) shows these static C++ runtime archives:\n    ${_archives}")
    endif()
  endif()
  message(FATAL_ERROR
    "kvoff: ${MODULE} carries its own copy of the C++ runtime (defines: ${_found}; "
    "needs libstdc++.so: ${_needs_shared}). Inside a Python process that already loaded "
    "torch's shared libstdc++, such a module crashes on the first error message it formats. "
    "Look for -static-libstdc++ in LDFLAGS/CXXFLAGS or in the toolchain's specs, and for "
    "static archives of libstdc++ among the libraries linked in.${_from}")
endif()
