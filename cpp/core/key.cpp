#include "kvoff/key.h"

namespace kvoff {

std::string key_to_hex(std::string_view key, std::size_t max_bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const std::size_t shown = key.size() < max_bytes ? key.size() : max_bytes;
  std::string out;
  out.reserve(2 * shown + 24);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto byte = static_cast<unsigned char>(key[i]);
    out.push_back(kDigits[byte >> 4]);
    out.push_back(kDigits[byte & 0xf]);
  }
  if (shown < key.size()) {
    out += "...(" + std::to_string(key.size()) + " bytes)";
  }
  return out;
}

}  // namespace kvoff
