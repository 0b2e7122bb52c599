// Victim selection over two recency lists, shared by the ARC and probation policies (core-private).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "kvoff/eviction_policy.h"

namespace kvoff::detail {

/// Appends up to `count` evictable slots to `out` from two circular doubly linked lists, each
/// walked from its least recent end (the slot after its sentinel `head_a` / `head_b`; `next(s)`
/// is the slot after `s`). Each list has a cursor that rests on a slot already found evictable
/// until that slot is taken, so every slot is examined by `can_evict` at most once: O(examined).
///
/// `choose(taken_a, peek_a, peek_b)` picks the list of the next victim: 0 for list a, 1 for b,
/// -1 for none left. `taken_a` counts the victims taken from list a so far in this call;
/// `peek_a()` / `peek_b()` return the list's next evictable slot (std::nullopt at its end) and
/// may be called in any order, any number of times. Nothing but the cursors changes: the lists
/// are read only. Returns how many slots were appended.
template <class Next, class Choose>
std::size_t select_from_two_lists(std::size_t count, const SlotPredicate& can_evict,
                                  std::uint32_t head_a, std::uint32_t head_b, Next next,
                                  Choose choose, std::vector<std::uint32_t>& out) {
  struct Cursor {
    std::uint32_t slot;
    std::uint32_t head;
    bool ready;
  };
  Cursor a{next(head_a), head_a, false};
  Cursor b{next(head_b), head_b, false};
  const auto peek = [&](Cursor& c) -> std::optional<std::uint32_t> {
    if (!c.ready) {
      while (c.slot != c.head && !can_evict(c.slot)) {
        c.slot = next(c.slot);
      }
      if (c.slot == c.head) {
        return std::nullopt;
      }
      c.ready = true;
    }
    return c.slot;
  };
  const auto peek_a = [&] { return peek(a); };
  const auto peek_b = [&] { return peek(b); };
  std::size_t taken_a = 0;
  std::size_t found = 0;
  while (found < count) {
    const int pick = choose(taken_a, peek_a, peek_b);
    if (pick < 0) {
      break;  // no evictable slot left in either list
    }
    Cursor& c = pick == 0 ? a : b;
    out.push_back(c.slot);
    c.slot = next(c.slot);
    c.ready = false;
    taken_a += pick == 0 ? 1 : 0;
    ++found;
  }
  return found;
}

}  // namespace kvoff::detail
