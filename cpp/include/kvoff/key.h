// Block keys: the byte strings that name offloaded blocks (DESIGN.md "offload key").
//
// A key is an arbitrary non-empty byte string (typically an 8-byte integer hash or a 32-byte
// digest plus a group index). The core never interprets key bytes; it hashes them for its index
// and prints them as hex in error messages.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kvoff {

namespace detail {

/// Reads 8 bytes as a little-endian 64-bit word (byte 0 is the least significant).
inline std::uint64_t load_le64(const char* p) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::uint64_t w;
    std::memcpy(&w, p, sizeof(w));
    return w;
  } else {
    std::uint64_t w = 0;
    for (int i = 7; i >= 0; --i) {
      w = (w << 8) | static_cast<unsigned char>(p[i]);
    }
    return w;
  }
}

/// Reads n < 8 bytes as a little-endian word, zero-padded.
inline std::uint64_t load_le_partial(const char* p, std::size_t n) noexcept {
  std::uint64_t w = 0;
  for (std::size_t i = n; i > 0; --i) {
    w = (w << 8) | static_cast<unsigned char>(p[i - 1]);
  }
  return w;
}

/// Final avalanche of a 64-bit state (xor-shift / multiply rounds).
inline std::uint64_t avalanche64(std::uint64_t x) noexcept {
  x ^= x >> 31;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  return x;
}

}  // namespace detail

/// 64-bit hash of a key's bytes, used by the key index. Not cryptographic and not stable across
/// kvoff versions (never persist it). Every input bit affects every output bit, so small integer
/// keys (0, 1, 2, ...) spread as well as digests do. Cost: one multiply round per 8 bytes.
inline std::uint64_t hash_key(std::string_view key) noexcept {
  constexpr std::uint64_t kMul = 0x9e3779b97f4a7c15ULL;
  std::uint64_t h = 0x243f6a8885a308d3ULL ^ (static_cast<std::uint64_t>(key.size()) * kMul);
  const char* p = key.data();
  std::size_t n = key.size();
  while (n >= 8) {
    h = (h ^ detail::load_le64(p)) * kMul;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    h = (h ^ detail::load_le_partial(p, n) ^ (static_cast<std::uint64_t>(n) << 59)) * kMul;
    h ^= h >> 29;
  }
  return detail::avalanche64(h);
}

/// Lower-case hex of a key's bytes, for error messages: at most `max_bytes` bytes are printed,
/// longer keys end in "...(N bytes)".
std::string key_to_hex(std::string_view key, std::size_t max_bytes = 48);

}  // namespace kvoff
