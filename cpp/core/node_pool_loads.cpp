#include "kvoff/node_pool_loads.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kvoff/node_pool_stores.h"  // append_prefixed_keys, kNodePoolMaxKeyBytes

namespace kvoff {

NodePoolLoads::NodePoolLoads(std::string prefix) : prefix_(std::move(prefix)) {
  if (prefix_.size() >= kNodePoolMaxKeyBytes) {
    throw std::invalid_argument("a key prefix of " + std::to_string(prefix_.size()) +
                                " bytes leaves no room for a key");
  }
}

void NodePoolLoads::pin(KeySpan keys, std::span<const std::uint32_t> slots, bool connection) {
  if (keys.size() != slots.size()) {
    throw std::invalid_argument("node pool loads: " + std::to_string(keys.size()) +
                                " keys but " + std::to_string(slots.size()) + " slots");
  }
  std::uint32_t top = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    num_slots_.check(slots[i]);
    if (keys[i].empty() || prefix_.size() + keys[i].size() > kNodePoolMaxKeyBytes) {
      throw std::invalid_argument("a node pool key of " + std::to_string(keys[i].size()) +
                                  " bytes; keys are 1.." +
                                  std::to_string(kNodePoolMaxKeyBytes - prefix_.size()) +
                                  " bytes");
    }
    top = std::max(top, slots[i]);
  }
  if (!keys.empty() && top >= of_slot_.size()) {
    of_slot_.resize(std::max<std::size_t>(top + std::size_t{1}, 2 * of_slot_.size()));
  }
  entries_.reserve(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::string_view k = keys[i];
    const std::uint64_t h = Entries::hash(k);
    std::uint32_t e = entries_.find(k, h);
    if (e == kNone) {
      e = entries_.add(k, h);
      Loading& f = entries_[e];
      f.pins = f.connection_pins = 0;
      f.connection = connection_;
    }
    const std::uint32_t held = entry_of_slot(slots[i]);
    SlotLoads& s = of_slot_[slots[i]];
    if (held != e) {
      if (held != kNone) {  // the slot held another key (a pool before gave it): let go
        Loading& old = entries_[held];
        const std::uint32_t gone = std::min(old.pins, s.count);
        old.pins -= gone;
        old.connection_pins = std::min(old.connection_pins, old.pins);
        num_loads_ -= gone;
        if (old.pins == 0) free_entry(held);
      }
      s = SlotLoads{e, entries_[e].generation, 0};
    }
    ++s.count;
    Loading& f = entries_[e];
    f.slot = slots[i];
    ++f.pins;
    ++num_loads_;
    if (f.connection != connection_) f.connection_pins = 0;  // a lost connection's pins
    f.connection = connection_;
    if (connection) ++f.connection_pins;
  }
}

std::uint32_t NodePoolLoads::entry_of_slot(std::uint32_t slot) const noexcept {
  if (slot >= of_slot_.size()) return kNone;
  const SlotLoads& s = of_slot_[slot];
  if (s.entry == kNone || s.count == 0 || entries_[s.entry].generation != s.generation ||
      entries_[s.entry].pins == 0) {
    return kNone;
  }
  return s.entry;
}

void NodePoolLoads::free_entry(std::uint32_t e) {
  entries_.unindex(e);
  ++entries_[e].generation;  // slots that still name it see a stale entry
  entries_.release(e);       // its key's bytes stay until the next pin: ended_ may read them
}

void NodePoolLoads::end(std::uint32_t e, std::uint32_t slot) {
  Loading& f = entries_[e];
  if (entry_of_slot(slot) == e && --of_slot_[slot].count == 0) of_slot_[slot].entry = kNone;
  --f.pins;
  --num_loads_;
  if (f.connection == connection_ && f.connection_pins > 0) {
    --f.connection_pins;
    ended_.emplace_back(f.key);
  }
  if (f.pins == 0) free_entry(e);
}

std::size_t NodePoolLoads::completion(std::string& payload) {
  payload.clear();
  const std::size_t n = ended_.size();
  if (n > 0) append_prefixed_keys(payload, prefix_, ended_);  // keys pin() checked
  ended_.clear();
  return n;
}

std::size_t NodePoolLoads::complete_slots(std::span<const std::uint32_t> slots,
                                          std::string& payload) {
  ended_.clear();
  for (const std::uint32_t s : slots) {
    const std::uint32_t e = entry_of_slot(s);
    if (e != kNone) end(e, s);
  }
  return completion(payload);
}

std::size_t NodePoolLoads::complete_keys(KeySpan keys, std::string& payload) {
  ended_.clear();
  for (const std::string_view k : keys) {
    const std::uint32_t e = entries_.find(k);
    if (e != kNone) end(e, entries_[e].slot);
  }
  return completion(payload);
}

std::uint32_t NodePoolLoads::pins(std::string_view key) const {
  const std::uint32_t e = entries_.find(key);
  return e == kNone ? 0 : entries_[e].pins;
}

std::uint32_t NodePoolLoads::connection_pins(std::string_view key) const {
  const std::uint32_t e = entries_.find(key);
  if (e == kNone || entries_[e].connection != connection_) return 0;
  return entries_[e].connection_pins;
}

std::optional<std::uint32_t> NodePoolLoads::slot_of(std::string_view key) const {
  const std::uint32_t e = entries_.find(key);
  if (e == kNone) return std::nullopt;
  return entries_[e].slot;
}

std::string NodePoolLoads::loading_mask(KeySpan keys) const {
  std::string out(keys.size(), '\0');
  if (entries_.size() == 0) return out;
  for (std::size_t i = 0; i < keys.size(); ++i) out[i] = entries_.find(keys[i]) != kNone ? 1 : 0;
  return out;
}

}  // namespace kvoff
