// Helpers shared by OffloadingScheduler's source files (offloading_scheduler.cpp, its step in
// offloading_scheduler_step.cpp, its completion in offloading_scheduler_completion.cpp); not
// part of kvoff's headers.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "kvoff/offloading_scheduler.h"

namespace kvoff::scheduler_detail {

inline constexpr std::int64_t kAllTokens = std::numeric_limits<std::int64_t>::max();
// Token counts are summed (computed + scheduled) before anything else: bounded so that the sum
// cannot overflow (2^61 tokens is far beyond any context).
inline constexpr std::int64_t kMaxTokenCount = std::int64_t{1} << 61;

// A predicate for the id-hash tables' find(): any entry with the hash.
inline constexpr auto kAnyEntry = [](const auto&) { return true; };

inline bool token_counts_valid(const ScheduledRequest& s) noexcept {
  return s.num_computed_tokens >= 0 && s.num_scheduled_tokens >= 0 &&
         s.num_computed_tokens <= kMaxTokenCount && s.num_scheduled_tokens <= kMaxTokenCount;
}

inline std::string quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

// "hook(request 'id'): what", the message of a hook's bad-input error.
inline std::string hook_error(const char* hook, std::string_view request_id,
                              const std::string& what) {
  return std::string(hook) + "(request " + quoted(request_id) + "): " + what;
}

}  // namespace kvoff::scheduler_detail
