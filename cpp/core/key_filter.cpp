#include "kvoff/key_filter.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvoff/key.h"

namespace kvoff {

namespace {

// Header fields (little-endian words at these byte offsets). The magic is written last by
// create(), with release order, so a reader that sees it sees zeroed cells.
constexpr std::size_t kMagicAt = 0;
constexpr std::size_t kFormatAt = 8;
constexpr std::size_t kProbesAt = 12;
constexpr std::size_t kCellsAt = 16;
constexpr std::size_t kEpochAt = 24;

template <typename T>
T read_field(const std::byte* base, std::size_t at) noexcept {
  T v;
  std::memcpy(&v, base + at, sizeof(v));
  return v;
}

template <typename T>
void write_field(std::byte* base, std::size_t at, T v) noexcept {
  std::memcpy(base + at, &v, sizeof(v));
}

__extension__ typedef unsigned __int128 Uint128;  // GCC and Clang: no -Wpedantic warning

// (x * n) >> 64: maps a uniform 64-bit x to [0, n) without a division (Lemire, "Fast random
// integer generation in an interval", 2019).
inline std::size_t reduce(std::uint64_t x, std::size_t n) noexcept {
  return static_cast<std::size_t>((static_cast<Uint128>(x) * n) >> 64);
}

}  // namespace

std::size_t KeyFilter::bytes_for(std::size_t capacity) noexcept {
  return kHeaderBytes + kCellsPerKey * (capacity < 1 ? 1 : capacity);
}

KeyFilter KeyFilter::create(std::span<std::byte> memory, std::uint64_t epoch) {
  if (memory.size() < bytes_for(1)) {
    throw std::invalid_argument("a key filter needs at least " + std::to_string(bytes_for(1)) +
                                " bytes, got " + std::to_string(memory.size()));
  }
  std::byte* base = memory.data();
  if (reinterpret_cast<std::uintptr_t>(base) % alignof(std::uint64_t) != 0) {
    throw std::invalid_argument("a key filter's memory must be 8-byte aligned (a mapping is)");
  }
  const std::size_t cells = memory.size() - kHeaderBytes;
  std::memset(base, 0, memory.size());
  write_field<std::uint32_t>(base, kFormatAt, kFormat);
  write_field<std::uint32_t>(base, kProbesAt, kProbes);
  write_field<std::uint64_t>(base, kCellsAt, cells);
  write_field<std::uint64_t>(base, kEpochAt, epoch);
  std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(base + kMagicAt))
      .store(kMagic, std::memory_order_release);
  return KeyFilter(base, cells);
}

KeyFilter KeyFilter::attach(std::span<const std::byte> memory) {
  if (memory.size() < bytes_for(1)) {
    throw std::invalid_argument("a key filter needs at least " + std::to_string(bytes_for(1)) +
                                " bytes, got " + std::to_string(memory.size()));
  }
  // Readers never write: the const_cast only lets cell() build atomic_refs for loads.
  auto* base = const_cast<std::byte*>(memory.data());
  if (reinterpret_cast<std::uintptr_t>(base) % alignof(std::uint64_t) != 0) {
    throw std::invalid_argument("a key filter's memory must be 8-byte aligned (a mapping is)");
  }
  const auto magic = std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(base))
                         .load(std::memory_order_acquire);
  const auto format = read_field<std::uint32_t>(base, kFormatAt);
  const auto probes = read_field<std::uint32_t>(base, kProbesAt);
  const auto cells = read_field<std::uint64_t>(base, kCellsAt);
  if (magic != kMagic || format != kFormat || probes != kProbes) {
    throw std::invalid_argument(
        "not a kvoff key filter of format " + std::to_string(kFormat) + " (format " +
        std::to_string(format) + ", " + std::to_string(probes) +
        " probes): the pool runs another kvoff version; use the same version on both sides");
  }
  if (cells < 1 || cells > memory.size() - kHeaderBytes) {
    throw std::invalid_argument("the key filter's header says " + std::to_string(cells) +
                                " cells, but its memory holds " +
                                std::to_string(memory.size() - kHeaderBytes));
  }
  return KeyFilter(base, static_cast<std::size_t>(cells));
}

std::atomic_ref<std::uint8_t> KeyFilter::cell(std::size_t i) const noexcept {
  return std::atomic_ref<std::uint8_t>(*reinterpret_cast<std::uint8_t*>(base_ + kHeaderBytes + i));
}

template <typename F>
void KeyFilter::for_each_cell(std::uint64_t h1, F&& f) const noexcept {
  const std::uint64_t h2 = detail::avalanche64(h1 ^ 0x5851f42d4c957f2dULL) | 1;  // odd: distinct
  for (std::uint32_t i = 0; i < kProbes; ++i) {
    if (!f(reduce(h1 + i * h2, cells_))) return;
  }
}

void KeyFilter::add(std::string_view key) noexcept {
  for_each_cell(key, [this](std::size_t i) {
    auto c = cell(i);
    const std::uint8_t v = c.load(std::memory_order_relaxed);
    if (v != kSaturated) c.store(v + 1, std::memory_order_release);
    return true;
  });
}

bool KeyFilter::remove(std::string_view key) noexcept {
  bool known = true;
  for_each_cell(key, [this, &known](std::size_t i) {
    known = cell(i).load(std::memory_order_relaxed) != 0;
    return known;
  });
  if (!known) return false;
  for_each_cell(key, [this](std::size_t i) {
    auto c = cell(i);
    const std::uint8_t v = c.load(std::memory_order_relaxed);
    if (v != kSaturated) c.store(v - 1, std::memory_order_release);
    return true;
  });
  return true;
}

bool KeyFilter::may_contain(std::string_view key) const noexcept {
  return may_contain_hash(hash_key(key));
}

bool KeyFilter::may_contain_hash(std::uint64_t h1) const noexcept {
  bool maybe = true;
  for_each_cell(h1, [this, &maybe](std::size_t i) {
    maybe = cell(i).load(std::memory_order_acquire) != 0;
    return maybe;
  });
  return maybe;
}

std::size_t KeyFilter::first_maybe(std::span<const std::string_view> keys) const noexcept {
  // A ring of the hashes of the keys kAhead positions ahead, whose first cells are fetched
  // while earlier keys are checked (most absent keys need only their first cell).
  constexpr std::size_t kAhead = 8;
  std::array<std::uint64_t, kAhead> ahead{};
  const std::size_t n = keys.size();
  const auto fetch = [&](std::size_t k) {
    const std::uint64_t h = hash_key(keys[k]);
    ahead[k % kAhead] = h;
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(base_ + kHeaderBytes + reduce(h, cells_));
#endif
  };
  for (std::size_t k = 0; k < std::min(n, kAhead); ++k) fetch(k);
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint64_t h1 = ahead[k % kAhead];
    if (k + kAhead < n) fetch(k + kAhead);
    if (may_contain_hash(h1)) return k;
  }
  return n;
}

std::uint64_t KeyFilter::epoch() const noexcept {
  return read_field<std::uint64_t>(base_, kEpochAt);
}

std::size_t KeyFilter::nonzero_cells() const noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < cells_; ++i) n += cell(i).load(std::memory_order_relaxed) != 0;
  return n;
}

}  // namespace kvoff
