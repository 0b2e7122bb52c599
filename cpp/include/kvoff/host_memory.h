// How much host memory this process may use: physical memory, or its cgroup's limit when
// lower. CPUOffloadingManager checks its per-slot arrays against it before allocating them.
#pragma once

#include <cstdint>

namespace kvoff {

/// Bytes of memory this process can use at most: physical memory, or its cgroup's memory
/// limit when lower; UINT64_MAX when neither is known. Reads /proc and /sys on Linux (a few
/// microseconds); allocates nothing that outlives the call.
std::uint64_t host_memory_limit_bytes() noexcept;

}  // namespace kvoff
