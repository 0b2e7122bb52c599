// host_memory_limit_bytes: physical memory (sysconf) and, on Linux, the cgroup v1/v2 memory
// limits of this process.
#include "kvoff/host_memory.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace kvoff {

namespace {

#if defined(__linux__)
/// The first number in file `path`, or UINT64_MAX (no such file, "max", unreadable).
std::uint64_t read_limit_file(const std::string& path) {
  std::ifstream in(path);
  std::uint64_t value = 0;
  if (in >> value) {
    return value;
  }
  return std::numeric_limits<std::uint64_t>::max();
}

/// The lowest memory limit of this process's cgroup (v2 memory.max or v1
/// memory.limit_in_bytes, at the cgroup's path and at the mount's root, which is the cgroup
/// itself inside a container), or UINT64_MAX.
std::uint64_t cgroup_memory_limit() {
  std::uint64_t limit = read_limit_file("/sys/fs/cgroup/memory.max");
  limit = std::min(limit, read_limit_file("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {  // "0::/path" (v2) or "4:memory:/path" (v1)
    if (line.rfind("0::", 0) == 0) {
      limit = std::min(limit, read_limit_file("/sys/fs/cgroup" + line.substr(3) + "/memory.max"));
      continue;
    }
    const auto first = line.find(':');
    const auto second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) {
      continue;
    }
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    if (controllers.find(",memory,") != std::string::npos) {
      limit = std::min(limit, read_limit_file("/sys/fs/cgroup/memory" + line.substr(second + 1) +
                                              "/memory.limit_in_bytes"));
    }
  }
  return limit;
}
#endif

}  // namespace

std::uint64_t host_memory_limit_bytes() noexcept {
  std::uint64_t limit = std::numeric_limits<std::uint64_t>::max();
#if defined(__unix__) || defined(__APPLE__)
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) {
    limit = static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_size);
  }
#endif
#if defined(__linux__)
  try {
    limit = std::min(limit, cgroup_memory_limit());
  } catch (...) {  // std::bad_alloc reading a file: physical memory is the answer
  }
#endif
  return limit;
}

}  // namespace kvoff
