#include "kvoff/node_pool_stores.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>

namespace kvoff {

namespace {

void append_u16(std::string& out, std::size_t v) {
  out.push_back(static_cast<char>(v & 0xFF));
  out.push_back(static_cast<char>((v >> 8) & 0xFF));
}

void append_u32(std::string& out, std::size_t v) {
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<char>((v >> shift) & 0xFF));
}

}  // namespace

void append_prefixed_keys(std::string& out, std::string_view prefix, KeySpan keys) {
  bool one_width = true;
  for (const std::string_view k : keys) {
    if (k.empty() || prefix.size() + k.size() > kNodePoolMaxKeyBytes) {
      throw std::invalid_argument("a node pool key of " + std::to_string(k.size()) +
                                  " bytes (with a prefix of " + std::to_string(prefix.size()) +
                                  "); keys are 1.." + std::to_string(kNodePoolMaxKeyBytes) +
                                  " bytes with the prefix");
    }
    one_width = one_width && k.size() == keys[0].size();
  }
  if (keys.size() > 0xFFFFFFFFu) throw std::invalid_argument("over 2**32 keys in one list");
  const std::size_t width = keys.empty() ? prefix.size() : prefix.size() + keys[0].size();
  out.reserve(out.size() + 6 + keys.size() * (width + (one_width ? 0 : 2)));
  append_u32(out, keys.size());
  append_u16(out, one_width ? width : 0);
  for (const std::string_view k : keys) {
    if (!one_width) append_u16(out, prefix.size() + k.size());
    out.append(prefix);
    out.append(k);
  }
}

NodePoolStores::NodePoolStores(std::string prefix, std::uint16_t version)
    : prefix_(std::move(prefix)), version_(version) {
  if (prefix_.size() >= kNodePoolMaxKeyBytes) {
    throw std::invalid_argument("a key prefix of " + std::to_string(prefix_.size()) +
                                " bytes leaves no room for a key");
  }
}

std::uint32_t NodePoolStores::next_request_id() noexcept {
  request_id_ = request_id_ == 0xFFFFFFFFu ? 1 : request_id_ + 1;  // 0: no call
  return request_id_;
}

std::uint32_t NodePoolStores::queue(std::uint16_t op, std::string_view payload, bool changes) {
  if (payload.size() > 0xFFFFFFFFu) {
    throw std::invalid_argument("a node pool payload of " + std::to_string(payload.size()) +
                                " bytes (at most 2**32 - 1)");
  }
  if (!attached_) return 0;
  const std::uint32_t id = next_request_id();
  outbox_.reserve(outbox_.size() + kHeaderBytes + payload.size());
  outbox_.append("KVNP", 4);
  append_u16(outbox_, version_);
  append_u16(outbox_, op);
  append_u32(outbox_, id);
  append_u32(outbox_, payload.size());
  outbox_.append(payload);
  changed_ = changed_ || changes;
  return id;
}

std::string NodePoolStores::take_outbox() { return std::exchange(outbox_, {}); }

void NodePoolStores::set_attached(bool attached) {
  attached_ = attached;
  if (!attached) outbox_.clear();
}

void NodePoolStores::add_reserved(std::span<const std::uint32_t> slots) {
  check_slots(slots);
  reserved_.insert(reserved_.end(), slots.begin(), slots.end());
}

void NodePoolStores::add_evicted(std::vector<std::string> keys) {
  if (evicted_.empty()) {
    evicted_ = std::move(keys);
  } else {
    std::move(keys.begin(), keys.end(), std::back_inserter(evicted_));
  }
}

std::vector<std::string> NodePoolStores::take_evicted() { return std::exchange(evicted_, {}); }

void NodePoolStores::check_slots(std::span<const std::uint32_t> slots) const {
  for (const std::uint32_t s : slots) {
    num_slots_.check(s);
  }
}

std::uint32_t NodePoolStores::find_slot(std::uint32_t slot) const noexcept {
  return slot < entry_of_slot_.size() ? entry_of_slot_[slot] : kNone;
}

void NodePoolStores::add(std::string_view key, std::uint64_t hash, std::uint32_t slot) {
  if (slot >= entry_of_slot_.size()) {
    entry_of_slot_.resize(std::max<std::size_t>(slot + std::size_t{1}, 2 * entry_of_slot_.size()),
                          kNone);
  }
  const std::uint32_t e = entries_.add(key, hash);
  InFlight& f = entries_[e];
  f.connection = connection_;
  f.slot = slot;
  entry_of_slot_[slot] = e;
  ++num_storing_;
}

bool NodePoolStores::store_reserved(KeySpan keys, const KeyFilter& filter,
                                    std::vector<std::uint32_t>& slots, std::string& payload) {
  const std::size_t n = keys.size();
  if (n == 0 || n > reserved_.size()) return false;
  std::string body;
  append_prefixed_keys(body, prefix_, keys);  // throws before anything changes
  // the prefixed keys are in `body` already: check them there (no copy per key)
  std::vector<std::string_view> prefixed;
  prefixed.reserve(n);
  const bool one_width = body[4] != 0 || body[5] != 0;
  std::size_t at = 6;
  for (const std::string_view k : keys) {
    if (!one_width) at += 2;
    prefixed.emplace_back(body.data() + at, prefix_.size() + k.size());
    at += prefix_.size() + k.size();
  }
  if (filter.first_maybe(prefixed) < n) return false;  // maybe held: the pool decides
  entries_.reserve(n);  // the adds below then allocate only table growth
  for (std::size_t i = 0; i < n; ++i) {
    // a key in flight already or repeated in the call, or (a pool restarted on the same
    // region) a reserved slot still being written: undo, and let the pool decide
    const std::uint64_t hash = Entries::hash(keys[i]);
    if (find_key(keys[i], hash) != kNone || find_slot(reserved_[i]) != kNone) {
      for (std::size_t j = 0; j < i; ++j) {
        const std::uint32_t e = find_slot(reserved_[j]);
        entries_.unindex(e);
        entry_of_slot_[reserved_[j]] = kNone;
        --num_storing_;
        entries_.release(e);
      }
      return false;
    }
    add(keys[i], hash, reserved_[i]);
  }
  slots.assign(reserved_.begin(), reserved_.begin() + static_cast<std::ptrdiff_t>(n));
  reserved_.erase(reserved_.begin(), reserved_.begin() + static_cast<std::ptrdiff_t>(n));
  payload = std::move(body);
  ++reserved_stores_;
  return true;
}

bool NodePoolStores::begin(KeySpan keys, std::span<const std::uint32_t> slots) {
  if (keys.size() != slots.size()) {
    throw std::invalid_argument("node pool stores: " + std::to_string(keys.size()) +
                                " keys but " + std::to_string(slots.size()) + " slots");
  }
  check_slots(slots);
  std::unordered_set<std::uint32_t> given(slots.begin(), slots.end());
  if (given.size() != slots.size()) {
    throw std::invalid_argument("node pool stores: the pool gave one slot to two keys");
  }
  std::vector<std::uint64_t> hashes(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    hashes[i] = Entries::hash(keys[i]);
    if (find_slot(slots[i]) != kNone || find_key(keys[i], hashes[i]) != kNone) return false;
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    // a key twice: its first slot
    if (find_key(keys[i], hashes[i]) == kNone) add(keys[i], hashes[i], slots[i]);
  }
  return true;
}

void NodePoolStores::end(std::uint32_t e) {
  const InFlight& f = entries_[e];
  entries_.unindex(e);
  entry_of_slot_[f.slot] = kNone;
  --num_storing_;
  if (f.connection == connection_) {
    ended_.push_back(e);  // freed once its key is in the payload
  } else {
    entries_.release(e);
  }
}

std::size_t NodePoolStores::completion(bool success, std::string& payload) {
  payload.clear();
  const std::size_t n = ended_.size();
  if (n > 0) {
    std::vector<std::string_view> views;
    views.reserve(n);
    for (const std::uint32_t e : ended_) views.emplace_back(entries_[e].key);
    payload.push_back(success ? 1 : 0);
    append_prefixed_keys(payload, prefix_, views);  // keys begin() or store_reserved() took
    for (const std::uint32_t e : ended_) entries_.release(e);
  }
  ended_.clear();
  return n;
}

std::size_t NodePoolStores::complete_slots(std::span<const std::uint32_t> slots, bool success,
                                           std::string& payload) {
  ended_.clear();
  for (const std::uint32_t s : slots) {
    const std::uint32_t e = find_slot(s);
    if (e != kNone) end(e);
  }
  return completion(success, payload);
}

std::size_t NodePoolStores::complete_keys(KeySpan keys, bool success, std::string& payload) {
  ended_.clear();
  for (const std::string_view k : keys) {
    const std::uint32_t e = find_key(k);
    if (e != kNone) end(e);
  }
  return completion(success, payload);
}

void NodePoolStores::lose() noexcept {
  ++connection_;
  reserved_.clear();
  evicted_.clear();
  outbox_.clear();
}

bool NodePoolStores::storing(std::string_view key) const { return find_key(key) != kNone; }

std::optional<std::uint32_t> NodePoolStores::slot_of(std::string_view key) const {
  const std::uint32_t e = find_key(key);
  if (e == kNone) return std::nullopt;
  return entries_[e].slot;
}

}  // namespace kvoff
