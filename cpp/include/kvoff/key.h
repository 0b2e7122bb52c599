// Block keys: the byte strings that name offloaded blocks (docs/design.md "offload key").
//
// A key is an arbitrary non-empty byte string (typically an 8-byte integer hash or a 32-byte
// digest plus a group index). The core never interprets key bytes; it hashes them for its index
// and prints them as hex in error messages.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

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

/// An append-only list of keys stored back to back in one byte buffer: no allocation per key
/// (a std::vector<std::string> constructs one string per key). Element i is a string_view into
/// the buffer, valid until the list is modified or destroyed.
class KeyList {
 public:
  /// Iterates the keys in order, yielding std::string_view.
  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = std::string_view;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = std::string_view;
    const_iterator() noexcept = default;
    const_iterator(const KeyList* list, std::size_t i) noexcept : list_(list), i_(i) {}
    std::string_view operator*() const noexcept { return (*list_)[i_]; }
    const_iterator& operator++() noexcept {
      ++i_;
      return *this;
    }
    const_iterator operator++(int) noexcept {
      const_iterator old = *this;
      ++i_;
      return old;
    }
    bool operator==(const const_iterator& other) const noexcept { return i_ == other.i_; }

   private:
    const KeyList* list_ = nullptr;
    std::size_t i_ = 0;
  };

  /// Number of keys.
  std::size_t size() const noexcept { return ends_.size(); }
  /// Whether the list holds no key.
  bool empty() const noexcept { return ends_.empty(); }
  /// Key `i` (unchecked: i < size()).
  std::string_view operator[](std::size_t i) const noexcept {
    const std::size_t begin = i == 0 ? 0 : ends_[i - 1];
    return {bytes_.data() + begin, ends_[i] - begin};
  }
  const_iterator begin() const noexcept { return {this, 0}; }
  const_iterator end() const noexcept { return {this, size()}; }

  /// Reserves room for `keys` keys of `bytes` bytes in all. Throws std::bad_alloc.
  void reserve(std::size_t keys, std::size_t bytes) {
    ends_.reserve(keys);
    bytes_.reserve(bytes);
  }
  /// Reserves room for `keys` more keys of `bytes` more bytes (for a batch: one allocation
  /// instead of geometric regrowth). Throws std::bad_alloc.
  void reserve_more(std::size_t keys, std::size_t bytes) {
    ends_.reserve(ends_.size() + keys);
    bytes_.reserve(bytes_.size() + bytes);
  }
  /// Appends a copy of `key`. Throws std::bad_alloc.
  void push_back(std::string_view key) {
    bytes_.append(key.data(), key.size());
    ends_.push_back(bytes_.size());
  }
  /// Appends one key made of `head` followed by `tail` (e.g. a block hash and a group byte).
  /// Throws std::bad_alloc.
  void push_back(std::string_view head, std::string_view tail) {
    bytes_.append(head.data(), head.size());
    bytes_.append(tail.data(), tail.size());
    ends_.push_back(bytes_.size());
  }
  /// The same keys in the same order.
  friend bool operator==(const KeyList& a, const KeyList& b) noexcept = default;
  /// Removes every key (keeps the memory).
  void clear() noexcept {
    bytes_.clear();
    ends_.clear();
  }
  /// Bytes its buffers hold (capacity, not size).
  std::size_t capacity_bytes() const noexcept {
    return bytes_.capacity() + ends_.capacity() * sizeof(std::size_t);
  }
  /// The keys as separate strings. Throws std::bad_alloc.
  std::vector<std::string> to_strings() const { return {begin(), end()}; }

 private:
  std::string bytes_;
  std::vector<std::size_t> ends_;  // end offset of each key in bytes_
};

/// Lower-case hex of a key's bytes, for error messages: at most `max_bytes` bytes are printed,
/// longer keys end in "...(N bytes)".
std::string key_to_hex(std::string_view key, std::size_t max_bytes = 48);

}  // namespace kvoff
