# One C++ runtime per process.
#
# kvoff's extension modules run inside a Python process in which torch has already loaded the
# shared libstdc++ (libstdc++.so.6). A module that carries a static copy of libstdc++ code next
# to it has a second set of locale and iostream state: the first number that code formats into
# a stream (every TORCH_CHECK message does) can crash the process. That is how bad input
# crashed a CUDA build of kvoff._C on an H100 machine (issue 12: SIGSEGV in
# std::ostream::_M_insert<unsigned long> *inside* _C.so; the module did not list
# libstdc++.so.6 among its NEEDED libraries).
#
# kvoff_link_shared_cxx_runtime(target): links the shared libstdc++ explicitly, by its file
# name and before every other library: -Wl,--no-as-needed,-l:libstdc++.so.6. The compiler
# driver's -static-libstdc++ rewrites -lstdc++ but not this, and --no-as-needed keeps the
# library where the toolchain links with --as-needed by default (Debian, Ubuntu). Every C++
# runtime symbol then resolves to libstdc++.so.6 before any static archive later on the link
# line (CUDA's implicit libraries, a -static-libstdc++ in LDFLAGS) could supply a copy. It also
# writes a link map (<target>.map) that names the archives linked in.
#
# kvoff_check_cxx_runtime(target): after every link, fails the build when the module defines
# libstdc++'s own symbols or does not need libstdc++.so. The message names the archive that
# brought the copy in (from the link map) and what to do about it.
set(_KVOFF_CXX_RUNTIME_SCRIPT "${CMAKE_CURRENT_LIST_DIR}/check_cxx_runtime.cmake")

function(kvoff_link_shared_cxx_runtime target)
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    # --no-as-needed: toolchains that link with --as-needed by default (Debian, Ubuntu) would
    # otherwise drop the library when no object before it refers to the runtime yet.
    target_link_libraries(${target} PRIVATE
      "-Wl,--push-state,--no-as-needed,-l:libstdc++.so.6,--pop-state")
    target_link_options(${target} PRIVATE
      "LINKER:-Map=${CMAKE_CURRENT_BINARY_DIR}/${target}.map")
  endif()
endfunction()

function(kvoff_check_cxx_runtime target)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  if(NOT CMAKE_NM OR NOT CMAKE_READELF)
    message(STATUS "kvoff: nm/readelf not found; the C++ runtime check of ${target} is skipped")
    return()
  endif()
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND "${CMAKE_COMMAND}"
            "-DMODULE=$<TARGET_FILE:${target}>"
            "-DLINK_MAP=${CMAKE_CURRENT_BINARY_DIR}/${target}.map"
            "-DNM=${CMAKE_NM}" "-DREADELF=${CMAKE_READELF}"
            -P "${_KVOFF_CXX_RUNTIME_SCRIPT}"
    COMMENT "kvoff: checking that ${target} uses the shared C++ runtime"
    VERBATIM)
endfunction()
