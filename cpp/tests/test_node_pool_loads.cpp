// NodePoolLoads (an engine's side of its node pool loads): a completion names only the loads
// the current connection pinned, every load ends once whether by slot or by key, a slot the
// pool gave out again belongs to its new key, and bad input changes nothing. A random run is
// checked against a plain model of the same bookkeeping (docs/design.md invariant 10, the
// engine's side).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvoff/node_pool_loads.h"
#include "kvoff/node_pool_stores.h"  // kNodePoolMaxKeyBytes
#include "node_pool_test_util.h"

namespace {

using kvoff::NodePoolLoads;

const std::string kPrefix = "PREFIX08";

using kvoff::testing::views;

// The keys of a key list payload, the prefix checked and dropped (none when empty).
std::vector<std::string> decode_keys(std::string_view p) {
  std::vector<std::string> out;
  if (p.empty()) return out;
  for (const std::string& k : kvoff::testing::decode_keys(p)) {
    EXPECT_EQ(k.substr(0, kPrefix.size()), kPrefix);
    out.push_back(k.substr(kPrefix.size()));
  }
  return out;
}

using Slots = std::vector<std::uint32_t>;
using Keys = std::vector<std::string>;

TEST(NodePoolLoads, ACompletionNamesOnlyTheLoadsThisConnectionPinnedInSlotOrder) {
  NodePoolLoads l(kPrefix);
  const Keys pinned = {"a", "bb"};
  l.pin(views(pinned), Slots{3, 5}, true);
  const Keys after_loss = {"c"};
  l.pin(views(after_loss), Slots{7}, false);  // from a lease, after the pool went away
  EXPECT_EQ(l.num_loads(), 3u);
  EXPECT_EQ(l.pins("c"), 1u);
  EXPECT_EQ(l.connection_pins("c"), 0u);
  EXPECT_EQ(l.connection_pins("bb"), 1u);
  EXPECT_EQ(l.slot_of("bb"), 5u);
  const Keys asked = {"a", "x", "c"};
  EXPECT_EQ(l.loading_mask(views(asked)), std::string("\x01\x00\x01", 3));

  std::string payload;
  EXPECT_EQ(l.complete_slots(Slots{5, 7, 3, 9}, payload), 2u);  // 9: not loading, skipped
  EXPECT_EQ(decode_keys(payload), (Keys{"bb", "a"}));
  EXPECT_EQ(l.num_loads(), 0u);
  EXPECT_EQ(l.num_keys(), 0u);
  EXPECT_EQ(l.pins("a"), 0u);
  EXPECT_FALSE(l.slot_of("a").has_value());
  EXPECT_EQ(l.complete_slots(Slots{5, 7, 3}, payload), 0u);  // each load ends once
  EXPECT_TRUE(payload.empty());
}

TEST(NodePoolLoads, ALostConnectionsLoadsEndWithoutAWord) {
  NodePoolLoads l(kPrefix);
  const Keys k = {"k"};
  l.pin(views(k), Slots{1}, true);
  l.lose();  // the pool released the pin
  EXPECT_EQ(l.pins("k"), 1u);  // the copy still reads the slot
  EXPECT_EQ(l.connection_pins("k"), 0u);
  l.pin(views(k), Slots{1}, true);  // a load on the new connection
  EXPECT_EQ(l.pins("k"), 2u);
  EXPECT_EQ(l.connection_pins("k"), 1u);
  std::string payload;
  EXPECT_EQ(l.complete_slots(Slots{1}, payload), 1u);  // the new connection's pin
  EXPECT_EQ(decode_keys(payload), Keys{"k"});
  EXPECT_EQ(l.complete_keys(views(k), payload), 0u);  // the lost one's: nothing to send
  EXPECT_TRUE(payload.empty());
  EXPECT_EQ(l.num_loads(), 0u);
}

TEST(NodePoolLoads, AKeyLoadedTwiceEndsTwiceBySlotOrByKey) {
  NodePoolLoads l(kPrefix);
  const Keys k = {"k", "k"};
  l.pin(views(k), Slots{2, 2}, true);
  EXPECT_EQ(l.pins("k"), 2u);
  std::string payload;
  EXPECT_EQ(l.complete_slots(Slots{2}, payload), 1u);
  EXPECT_EQ(l.pins("k"), 1u);
  const Keys one = {"k"};
  EXPECT_EQ(l.complete_keys(views(one), payload), 1u);
  EXPECT_EQ(decode_keys(payload), Keys{"k"});
  EXPECT_EQ(l.pins("k"), 0u);
  EXPECT_EQ(l.complete_slots(Slots{2}, payload), 0u);
}

TEST(NodePoolLoads, BadInputIsRefusedBeforeAnythingChanges) {
  NodePoolLoads l(kPrefix);
  l.set_num_slots(16);
  const Keys ok = {"a"};
  l.pin(views(ok), Slots{15}, true);
  const Keys two = {"b", "c"};
  EXPECT_THROW(l.pin(views(two), Slots{1, 16}, true), std::invalid_argument);  // no slot 16
  EXPECT_THROW(l.pin(views(two), Slots{1}, true), std::invalid_argument);      // sizes
  const Keys empty = {"b", ""};
  EXPECT_THROW(l.pin(views(empty), Slots{1, 2}, true), std::invalid_argument);
  const Keys too_long = {std::string(kvoff::kNodePoolMaxKeyBytes, 'x')};
  EXPECT_THROW(l.pin(views(too_long), Slots{1}, true), std::invalid_argument);
  EXPECT_EQ(l.num_loads(), 1u);
  EXPECT_EQ(l.num_keys(), 1u);
  EXPECT_EQ(l.pins("b"), 0u);
  EXPECT_THROW(l.set_num_slots(NodePoolLoads::kMaxSlots + 1), std::invalid_argument);
  EXPECT_THROW(NodePoolLoads(std::string(kvoff::kNodePoolMaxKeyBytes, 'p')), std::invalid_argument);
  std::string payload;
  EXPECT_EQ(l.complete_slots(Slots{1, 2, 0xFFFFFFFFu}, payload), 0u);  // never loaded: skipped
  EXPECT_EQ(l.complete_slots(Slots{15}, payload), 1u);
}

TEST(NodePoolLoads, ASlotGivenOutAgainBelongsToItsNewKey) {
  NodePoolLoads l(kPrefix);
  const Keys a = {"a"}, b = {"b"};
  l.pin(views(a), Slots{4}, true);
  l.lose();
  l.pin(views(b), Slots{4}, true);  // a pool restarted on the region gave slot 4 to "b"
  EXPECT_EQ(l.pins("a"), 0u);       // no entry left behind for "a"
  EXPECT_EQ(l.num_keys(), 1u);
  EXPECT_EQ(l.num_loads(), 1u);
  std::string payload;
  EXPECT_EQ(l.complete_slots(Slots{4}, payload), 1u);
  EXPECT_EQ(decode_keys(payload), Keys{"b"});
  EXPECT_EQ(l.num_loads(), 0u);
}

TEST(NodePoolLoads, ASlotWhoseKeyEndedElsewhereNamesNoLaterKey) {
  NodePoolLoads l(kPrefix);
  const Keys k = {"k"};
  l.pin(views(k), Slots{1}, true);
  l.pin(views(k), Slots{2}, true);  // the same key from another slot (a pool restarted)
  std::string payload;
  EXPECT_EQ(l.complete_keys(views(k), payload), 1u);
  EXPECT_EQ(l.complete_keys(views(k), payload), 1u);  // both loads of "k" ended by key
  EXPECT_EQ(l.num_keys(), 0u);
  const Keys other = {"other"};
  l.pin(views(other), Slots{9}, true);  // reuses the entry "k" had
  EXPECT_EQ(l.complete_slots(Slots{1}, payload), 0u);  // slot 1 named "k": stale, skipped
  EXPECT_EQ(l.pins("other"), 1u);
  EXPECT_EQ(l.complete_slots(Slots{9}, payload), 1u);
  EXPECT_EQ(decode_keys(payload), Keys{"other"});
}

// A random run against a model: per key its loads, per connection pin the connection that made
// it, per slot the loads from it of its key. Slots are never given to two keys at once here (a
// pool gives a held slot to one key), so the model is exact.
TEST(NodePoolLoads, ARandomRunMatchesAModel) {
  std::mt19937_64 rng(7);
  NodePoolLoads l(kPrefix);
  l.set_num_slots(64);
  struct Load {
    std::string key;
    std::uint32_t slot;
    std::uint64_t connection;  // 0: not pinned by a connection
  };
  std::vector<Load> model;
  std::map<std::string, std::uint32_t> slot_of_key;  // a key keeps its slot while it loads
  std::uint64_t connection = 1;
  std::uint32_t next_slot = 0;
  for (int step = 0; step < 3000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 5) {  // pin 1..4 keys
      Keys keys;
      Slots slots;
      const bool by_connection = rng() % 8 != 0;
      for (int i = 0, n = 1 + static_cast<int>(rng() % 4); i < n; ++i) {
        std::string k = "key" + std::to_string(rng() % 24);
        auto it = slot_of_key.find(k);
        std::uint32_t slot;
        if (it != slot_of_key.end()) {
          slot = it->second;
        } else {
          slot = next_slot++ % 64;  // no other key holds it: the model frees slots as keys end
          bool taken = true;
          while (taken) {
            taken = false;
            for (const auto& [key, s] : slot_of_key) taken = taken || s == slot;
            if (taken) slot = next_slot++ % 64;
          }
          slot_of_key[k] = slot;
        }
        keys.push_back(k);
        slots.push_back(slot);
        model.push_back({k, slot, by_connection ? connection : 0});
      }
      l.pin(views(keys), slots, by_connection);
    } else if (op < 9 && !model.empty()) {  // end a few loads, by slot or by key
      const bool by_slot = rng() % 2 == 0;
      Slots slots;
      Keys keys;
      Keys expect;
      for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n && !model.empty(); ++i) {
        // the first load of a chosen key (the bookkeeping does not tell loads of a key apart)
        const std::string k = model[rng() % model.size()].key;
        std::size_t j = 0;
        // a connection's pin ends first (as the implementation counts: connection pins are the
        // key's, whichever load ends)
        while (model[j].key != k) ++j;
        std::size_t pick = j;
        for (std::size_t m = j; m < model.size(); ++m) {
          if (model[m].key == k && model[m].connection == connection) {
            pick = m;
            break;
          }
        }
        if (model[pick].connection == connection) expect.push_back(k);
        (by_slot ? void(slots.push_back(model[pick].slot)) : void(keys.push_back(k)));
        model.erase(model.begin() + static_cast<std::ptrdiff_t>(pick));
        bool left = false;
        for (const Load& x : model) left = left || x.key == k;
        if (!left) slot_of_key.erase(k);
      }
      std::string payload;
      const std::size_t n = by_slot ? l.complete_slots(slots, payload)
                                    : l.complete_keys(views(keys), payload);
      ASSERT_EQ(n, expect.size()) << "step " << step;
      ASSERT_EQ(decode_keys(payload), expect) << "step " << step;
    } else if (op == 9 && rng() % 4 == 0) {
      l.lose();
      ++connection;
    }
    ASSERT_EQ(l.num_loads(), model.size()) << "step " << step;
    std::map<std::string, std::uint32_t> pins, conn;
    for (const Load& x : model) {
      ++pins[x.key];
      conn[x.key] += x.connection == connection;
    }
    ASSERT_EQ(l.num_keys(), pins.size()) << "step " << step;
    for (const auto& [k, n] : pins) {
      ASSERT_EQ(l.pins(k), n) << k << " at step " << step;
      ASSERT_EQ(l.connection_pins(k), conn[k]) << k << " at step " << step;
      ASSERT_EQ(l.slot_of(k), slot_of_key[k]) << k << " at step " << step;
    }
  }
}

}  // namespace
