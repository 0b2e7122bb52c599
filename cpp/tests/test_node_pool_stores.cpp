// NodePoolStores (an engine's side of its node pool stores): the reserved path only takes keys
// that are new everywhere, a completion names only what this connection stored, a lost
// connection's slots stay in flight until completed, and the payloads are the wire format of
// kvoff/node_pool/protocol.py (docs/design.md invariant 10, the engine's side).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/key_filter.h"
#include "kvoff/node_pool_stores.h"
#include "node_pool_test_util.h"

namespace {

using kvoff::KeyFilter;
using kvoff::NodePoolStores;

const std::string kPrefix = "PREFIX08";

std::string key_of(std::uint64_t i, std::size_t width = 32) {
  std::string k(width, 'k');
  for (int b = 0; b < 8 && b < static_cast<int>(width); ++b) k[b] = static_cast<char>(i >> (8 * b));
  return k;
}

struct Filter {
  explicit Filter(std::size_t capacity)
      : words((KeyFilter::bytes_for(capacity) + 7) / 8),
        filter(KeyFilter::create({reinterpret_cast<std::byte*>(words.data()), words.size() * 8},
                                 3)) {}
  std::vector<std::uint64_t> words;
  KeyFilter filter;
};

using kvoff::testing::decode_keys;
using kvoff::testing::views;

TEST(NodePoolStores, KeyListsAreTheWireFormat) {
  const std::vector<std::string> same = {"abc", "def"};
  std::string out;
  kvoff::append_prefixed_keys(out, "P", views(same));
  EXPECT_EQ(out, std::string("\x02\x00\x00\x00\x04\x00PabcPdef", 14));
  const std::vector<std::string> mixed = {"ab", "c"};
  out.clear();
  kvoff::append_prefixed_keys(out, "P", views(mixed));
  EXPECT_EQ(out, std::string("\x02\x00\x00\x00\x00\x00\x03\x00Pab\x02\x00Pc", 15));
  out = "kept";
  const std::vector<std::string> bad = {"ok", ""};
  EXPECT_THROW(kvoff::append_prefixed_keys(out, "P", views(bad)), std::invalid_argument);
  const std::vector<std::string> long_key = {std::string(kvoff::kNodePoolMaxKeyBytes, 'x')};
  EXPECT_THROW(kvoff::append_prefixed_keys(out, "P", views(long_key)), std::invalid_argument);
  EXPECT_EQ(out, "kept");  // nothing appended
}

TEST(NodePoolStores, AReservedStoreTakesSlotsInGrantOrderAndCompletesOnce) {
  Filter f(100);
  NodePoolStores s(kPrefix, 4);
  const std::vector<std::uint32_t> granted = {9, 4, 7};
  s.add_reserved(granted);
  s.add_evicted({"old"});
  const std::vector<std::string> keys = {key_of(1), key_of(2)};
  std::vector<std::uint32_t> slots;
  std::string payload;
  ASSERT_TRUE(s.store_reserved(views(keys), f.filter, slots, payload));
  EXPECT_EQ(slots, (std::vector<std::uint32_t>{9, 4}));
  EXPECT_EQ(decode_keys(payload), (std::vector<std::string>{kPrefix + keys[0], kPrefix + keys[1]}));
  EXPECT_EQ(s.num_reserved(), 1u);
  EXPECT_EQ(s.take_evicted(), std::vector<std::string>{"old"});
  EXPECT_TRUE(s.take_evicted().empty());
  EXPECT_EQ(s.slot_of(keys[1]), 4u);
  EXPECT_EQ(s.num_storing(), 2u);

  const std::vector<std::uint32_t> done = {4, 4, 5};  // a repeat and a slot not in flight
  ASSERT_EQ(s.complete_slots(done, true, payload), 1u);
  EXPECT_EQ(payload[0], 1);
  EXPECT_EQ(decode_keys(std::string_view(payload).substr(1)),
            std::vector<std::string>{kPrefix + keys[1]});
  EXPECT_EQ(s.complete_keys(views(keys), false, payload), 1u);  // key 2 is done already
  EXPECT_EQ(payload[0], 0);
  EXPECT_EQ(decode_keys(std::string_view(payload).substr(1)),
            std::vector<std::string>{kPrefix + keys[0]});
  EXPECT_EQ(s.complete_keys(views(keys), true, payload), 0u);
  EXPECT_TRUE(payload.empty());
  EXPECT_EQ(s.num_storing(), 0u);
}

TEST(NodePoolStores, OnlyKeysNewEverywhereGoIntoReservedSlots) {
  Filter f(100);
  NodePoolStores s(kPrefix, 4);
  const std::vector<std::uint32_t> granted = {1, 2, 3, 4};
  s.add_reserved(granted);
  std::vector<std::uint32_t> slots;
  std::string payload = "untouched";
  const auto refused = [&](const std::vector<std::string>& keys) {
    const bool got = s.store_reserved(views(keys), f.filter, slots, payload);
    return !got && s.num_reserved() == 4 && payload == "untouched";
  };
  f.filter.add(kPrefix + key_of(5));
  EXPECT_TRUE(refused({key_of(1), key_of(5)}));  // maybe in the pool: ask it
  EXPECT_TRUE(refused({key_of(1), key_of(1)}));  // a repeat
  EXPECT_TRUE(refused({key_of(1), key_of(2), key_of(3), key_of(4), key_of(6)}));  // too few
  EXPECT_TRUE(refused({}));
  const std::vector<std::string> empty_key = {""};
  EXPECT_THROW(s.store_reserved(views(empty_key), f.filter, slots, payload), std::invalid_argument);
  EXPECT_TRUE(refused({}));
  // a key this engine stores already (through the pool's reply)
  const std::vector<std::string> asked = {key_of(8)};
  const std::vector<std::uint32_t> asked_slot = {40};
  ASSERT_TRUE(s.begin(views(asked), asked_slot));
  EXPECT_TRUE(refused({key_of(1), key_of(8)}));
  EXPECT_EQ(s.num_storing(), 1u);
}

TEST(NodePoolStores, ALostConnectionsSlotsStayInFlightAndItsCompletionsSendNothing) {
  Filter f(100);
  NodePoolStores s(kPrefix, 4);
  const std::vector<std::uint32_t> granted = {1, 2};
  s.add_reserved(granted);
  s.add_evicted({"x"});
  std::vector<std::uint32_t> slots;
  std::string payload;
  const std::vector<std::string> a = {key_of(1)};
  ASSERT_TRUE(s.store_reserved(views(a), f.filter, slots, payload));
  s.lose();  // the pool went away: it released the reservation and the store
  EXPECT_EQ(s.num_reserved(), 0u);
  EXPECT_TRUE(s.take_evicted().empty());
  EXPECT_TRUE(s.storing(key_of(1)));
  // a pool restarted on the same region grants slot 1 (still being written) for another key
  const std::vector<std::string> b = {key_of(2)};
  const std::vector<std::uint32_t> one = {1};
  EXPECT_FALSE(s.begin(views(b), one));
  EXPECT_FALSE(s.storing(key_of(2)));
  const std::vector<std::uint32_t> other = {6};
  EXPECT_FALSE(s.begin(views(a), other));  // nor the same key into another slot
  EXPECT_EQ(s.complete_slots(one, true, payload), 0u);  // the old store ends: no word to the pool
  EXPECT_TRUE(payload.empty());
  EXPECT_TRUE(s.begin(views(b), one));  // now the slot is free here
  EXPECT_EQ(s.complete_keys(views(b), true, payload), 1u);
}

TEST(NodePoolStores, BadGrantsChangeNothing) {
  NodePoolStores s(kPrefix, 4);
  const std::vector<std::string> keys = {key_of(1), key_of(2)};
  const std::vector<std::uint32_t> short_slots = {1};
  EXPECT_THROW(s.begin(views(keys), short_slots), std::invalid_argument);
  const std::vector<std::uint32_t> twice = {3, 3};
  EXPECT_THROW(s.begin(views(keys), twice), std::invalid_argument);
  EXPECT_EQ(s.num_storing(), 0u);
  const std::vector<std::uint32_t> good = {3, 4};
  ASSERT_TRUE(s.begin(views(keys), good));
  EXPECT_EQ(s.num_storing(), 2u);
  EXPECT_THROW(NodePoolStores(std::string(kvoff::kNodePoolMaxKeyBytes, 'p'), 4),
               std::invalid_argument);
}

TEST(NodePoolStores, ASlotThePoolDoesNotHaveIsRefusedBeforeAnythingChanges) {
  // Slots index the engine's table of stores in flight: one past the pool's slot count (a
  // broken pool) must neither size that table nor leave a store half begun.
  NodePoolStores s(kPrefix, 4);
  EXPECT_THROW(s.set_num_slots(NodePoolStores::kMaxSlots + 1), std::invalid_argument);
  s.set_num_slots(8);
  const std::vector<std::string> keys = {key_of(1), key_of(2)};
  const std::vector<std::uint32_t> past = {7, 8};
  EXPECT_THROW(s.begin(views(keys), past), std::invalid_argument);
  EXPECT_EQ(s.num_storing(), 0u);
  EXPECT_FALSE(s.storing(keys[0]));
  const std::vector<std::uint32_t> huge = {0xFFFFFFFEu};
  EXPECT_THROW(s.add_reserved(huge), std::invalid_argument);
  const std::vector<std::uint32_t> mixed = {1, 9};
  EXPECT_THROW(s.add_reserved(mixed), std::invalid_argument);
  EXPECT_EQ(s.num_reserved(), 0u);
  const std::vector<std::uint32_t> last = {7, 6};
  ASSERT_TRUE(s.begin(views(keys), last));
  EXPECT_EQ(s.slot_of(keys[0]), 7u);
  EXPECT_EQ(s.slot_of(keys[1]), 6u);
  // and the slots end by slot as before
  std::string payload;
  const std::vector<std::uint32_t> ends = {6, 7, 7, 5};
  EXPECT_EQ(s.complete_slots(ends, true, payload), 2u);
  EXPECT_EQ(s.num_storing(), 0u);
}

TEST(NodePoolStores, TheOutboxQueuesFramesInOrderOnlyWhileAttached) {
  NodePoolStores s(kPrefix, 4);
  EXPECT_EQ(s.queue(7, "dropped", true), 0u);  // detached at first: no pool to send to
  EXPECT_EQ(s.outbox_bytes(), 0u);
  EXPECT_FALSE(s.take_changed());
  s.set_attached(true);
  EXPECT_EQ(s.queue(0x4006, "ab", true), 1u);
  EXPECT_EQ(s.next_request_id(), 2u);  // a frame the caller sends itself
  EXPECT_EQ(s.queue(12, "", false), 3u);
  const std::string want =
      std::string("KVNP\x04\x00\x06\x40\x01\x00\x00\x00\x02\x00\x00\x00" "ab", 18) +
      std::string("KVNP\x04\x00\x0c\x00\x03\x00\x00\x00\x00\x00\x00\x00", 16);
  EXPECT_EQ(s.outbox_bytes(), want.size());
  EXPECT_EQ(s.take_outbox(), want);
  EXPECT_EQ(s.outbox_bytes(), 0u);
  EXPECT_TRUE(s.take_changed());
  EXPECT_FALSE(s.take_changed());
  s.queue(6, "x", false);
  s.lose();  // the connection's queued frames go with it
  EXPECT_EQ(s.outbox_bytes(), 0u);
  s.queue(6, "x", false);
  s.set_attached(false);
  EXPECT_EQ(s.outbox_bytes(), 0u);
  EXPECT_EQ(s.num_reserved_stores(), 0u);
}

// Random reserved and granted stores, completions by slot and by key, and lost connections,
// against a model of who holds each slot: the counts agree at every step, a completion names
// exactly the keys the current connection stores, and every key maps back to its slot.
TEST(NodePoolStores, MatchesAModelOfSlotsAndConnections) {
  Filter f(4096);
  NodePoolStores s(kPrefix, 4);
  std::mt19937_64 rng(11);
  struct Held {
    std::string key;
    int connection;
  };
  std::map<std::uint32_t, Held> model;
  int connection = 0;
  std::uint32_t next_slot = 0;
  std::uint64_t next_key = 0;
  std::size_t reserved = 0;
  for (int step = 0; step < 4000; ++step) {
    const int op = static_cast<int>(rng() % 6);
    std::string payload;
    if (op == 0) {
      std::vector<std::uint32_t> grant(rng() % 5);
      for (auto& g : grant) g = next_slot++;
      s.add_reserved(grant);
      reserved += grant.size();
    } else if (op == 1 || op == 2) {
      std::vector<std::string> keys(1 + rng() % 4);
      for (auto& k : keys) k = key_of(next_key++, 8 + rng() % 3);
      std::vector<std::uint32_t> slots;
      if (op == 1) {
        const bool ok = s.store_reserved(views(keys), f.filter, slots, payload);
        ASSERT_EQ(ok, keys.size() <= reserved) << "step " << step;
        if (!ok) continue;
        reserved -= keys.size();
        ASSERT_EQ(decode_keys(payload).size(), keys.size());
      } else {
        for (std::size_t i = 0; i < keys.size(); ++i) slots.push_back(next_slot++);
        ASSERT_TRUE(s.begin(views(keys), slots));
      }
      for (std::size_t i = 0; i < keys.size(); ++i) model[slots[i]] = {keys[i], connection};
    } else if (op == 3 && !model.empty()) {
      auto it = std::next(model.begin(), static_cast<long>(rng() % model.size()));
      std::vector<std::uint32_t> slot = {it->first};
      const std::size_t sent = s.complete_slots(slot, true, payload);
      ASSERT_EQ(sent, it->second.connection == connection ? 1u : 0u);
      if (sent) {
        ASSERT_EQ(decode_keys(std::string_view(payload).substr(1))[0], kPrefix + it->second.key);
      }
      model.erase(it);
    } else if (op == 4 && !model.empty()) {
      auto it = std::next(model.begin(), static_cast<long>(rng() % model.size()));
      std::vector<std::string> key = {it->second.key};
      ASSERT_EQ(s.slot_of(key[0]), it->first);
      ASSERT_EQ(s.complete_keys(views(key), false, payload),
                it->second.connection == connection ? 1u : 0u);
      model.erase(it);
    } else if (op == 5 && rng() % 8 == 0) {
      s.lose();
      ++connection;
      reserved = 0;
    }
    ASSERT_EQ(s.num_storing(), model.size()) << "step " << step;
    ASSERT_EQ(s.num_reserved(), reserved) << "step " << step;
  }
}

}  // namespace
