// A node pool as the C++ scheduler's manager: kvoff::BlockManager over a Python
// kvoff.node_pool.block_manager.NodePoolBlockManager (the pool's client, which speaks the
// pool's protocol). The scheduler's hooks run with the GIL held, so calls go straight to
// Python, except stores, their completions, load completions and touches: those go through
// the client's NodePoolStores and NodePoolLoads (C++), which also queue their frames, so a
// step's completions and touches make no Python call and a store one (an engine stores about
// 200 keys a step; per key in Python, that was most of a node pool's step). State queries
// never throw: a failure there is a miss (the pool gone is a miss).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bindings.h"
#include "kvoff/block_manager.h"
#include "kvoff/node_pool_loads.h"
#include "kvoff/node_pool_stores.h"

namespace kvoff::bindings {

namespace {

py::list keys_to_py(KeySpan keys) {
  py::list out(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    out[i] = py::bytes(keys[i].data(), keys[i].size());
  }
  return out;
}

std::vector<std::uint32_t> ids_from_py(py::handle list) {
  std::vector<std::uint32_t> out;
  for (py::handle v : list) out.push_back(v.cast<std::uint32_t>());
  return out;
}

class NodePoolManager final : public BlockManager {
 public:
  explicit NodePoolManager(py::object manager)
      : py_(std::move(manager)),
        client_(py_.attr("client")),
        stores_(client_.attr("_stores").cast<std::shared_ptr<NodePoolStores>>()),
        loads_(client_.attr("_loads").cast<std::shared_ptr<NodePoolLoads>>()) {
    py::module_ protocol = py::module_::import("kvoff.node_pool.protocol");
    const auto no_reply = protocol.attr("NO_REPLY").cast<std::uint16_t>();
    complete_store_op_ = protocol.attr("COMPLETE_STORE").cast<std::uint16_t>() | no_reply;
    complete_load_op_ = protocol.attr("COMPLETE_LOAD").cast<std::uint16_t>() | no_reply;
    touch_op_ = protocol.attr("TOUCH").cast<std::uint16_t>() | no_reply;
    store_reserved_op_ = protocol.attr("STORE_RESERVED").cast<std::uint16_t>() | no_reply;
    outbox_limit_ = py::module_::import("kvoff.node_pool.client")
                        .attr("_OUTBOX_BYTES")
                        .cast<std::size_t>();
  }
  ~NodePoolManager() override {
    py::gil_scoped_acquire gil;  // the last reference may go from a thread without it
    py_ = client_ = py::object();
  }

  std::pair<BlockState, std::uint32_t> state_and_load_pins(std::string_view key) const override {
    std::pair<BlockState, std::uint32_t> out;
    const std::string_view keys[1] = {key};
    states_until_missing(keys, &out);
    return out;
  }

  std::size_t states_until_missing(KeySpan keys,
                                   std::pair<BlockState, std::uint32_t>* out) const override {
    std::string codes;
    try {
      codes = py_.attr("states")(keys_to_py(keys)).cast<std::string>();
    } catch (const py::error_already_set& e) {
      // a failing pool is a miss, never an engine error (it says why once, in Python's log)
      py::module_::import("logging")
          .attr("getLogger")("kvoff.node_pool")
          .attr("warning")("kvoff: node pool look-up failed (%s); counted as a miss",
                           py::str(e.value()));
      codes.clear();
    }
    std::size_t held = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const char c = i < codes.size() ? codes[i] : 0;
      if (c == 0) {
        out[i] = {BlockState::kMissing, 0};
        return held;
      }
      out[i] = {c == 1 ? BlockState::kPending : BlockState::kReady, c == 3 ? 1u : 0u};
      ++held;
    }
    return held;
  }

  std::vector<std::uint32_t> prepare_load(KeySpan keys) override {
    return ids_from_py(py_.attr("prepare_load")(keys_to_py(keys)));
  }

  void complete_load_blocks(std::span<const std::uint32_t> block_ids) override {
    std::string payload;
    if (loads_->complete_slots(block_ids, payload) > 0) queue(complete_load_op_, payload);
  }

  bool prepare_store(KeySpan keys, PrepareStoreResult& result, bool) override {
    // NodePoolClient.prepare_store's steps, with the keys kept in C++
    py::object filter = client_.attr("_reservation_filter")(keys.size());
    if (!filter.is_none()) {
      std::vector<std::uint32_t> slots;
      std::string payload;
      if (stores_->store_reserved(keys, key_filter_of(filter), slots, payload)) {
        // A pool lost before this frame reaches it never hears of the store; the copy and
        // its completion go on (the completion then sends nothing), as for any store in
        // flight when a pool goes (the client tops the reservation up at the step's end).
        queue(store_reserved_op_, payload);
        result.keys_to_store.assign(keys.begin(), keys.end());
        result.store_indices.resize(keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
          result.store_indices[i] = static_cast<std::uint32_t>(i);
        }
        result.block_ids = std::move(slots);
        result.key_block_ids.clear();
        result.skipped_indices.clear();
        result.evicted_keys.clear();
        for (const std::string& k : stores_->take_evicted()) result.evicted_keys.push_back(k);
        return true;
      }
      client_.attr("_reservation_missed")(keys.size());
    }
    py::object got = py_.attr("ask_store")(keys_to_py(keys));
    if (got.is_none()) return false;
    auto t = got.cast<py::tuple>();
    std::vector<std::uint32_t> index = ids_from_py(t[0]);
    std::vector<std::uint32_t> slots = ids_from_py(t[1]);
    if (index.size() != slots.size()) {
      throw std::runtime_error("node pool prepare_store: " + std::to_string(index.size()) +
                               " keys but " + std::to_string(slots.size()) + " slots");
    }
    result.keys_to_store.clear();
    for (const std::uint32_t i : index) {
      if (i >= keys.size()) throw std::runtime_error("node pool prepare_store: bad key index");
      result.keys_to_store.push_back(keys[i]);
    }
    result.store_indices = std::move(index);
    result.block_ids = std::move(slots);
    result.key_block_ids.clear();
    result.skipped_indices.clear();
    result.evicted_keys.clear();
    for (py::handle k : t[2]) result.evicted_keys.push_back(k.cast<std::string>());
    return true;
  }

  void complete_store_blocks(std::span<const std::uint32_t> block_ids, bool success, bool,
                             std::span<const std::size_t>) override {
    std::string payload;
    if (stores_->complete_slots(block_ids, success, payload) > 0) {
      queue(complete_store_op_, payload);
    }
  }

  void touch(KeySpan keys, std::span<const std::uint8_t> reused) override {
    // NodePoolClient.touch's payload: the prefixed keys, then a flag byte per key
    std::string payload;
    append_prefixed_keys(payload, stores_->prefix(), keys);
    payload.append(reinterpret_cast<const char*>(reused.data()), reused.size());
    queue(touch_op_, payload);
  }

  std::size_t discard(KeySpan) override { return 0; }  // other engines may read the blocks

  std::size_t clear(bool) override { return py_.attr("clear")().cast<std::size_t>(); }

  std::vector<kvoff::OffloadingEvent> take_events() override {
    std::vector<kvoff::OffloadingEvent> out;
    for (py::handle e : py_.attr("take_events")()) {
      auto t = py::reinterpret_borrow<py::tuple>(e);
      kvoff::OffloadingEvent ev;
      ev.removed = t[0].cast<bool>();
      ev.medium = "CPU";
      for (py::handle k : t[1]) ev.keys.push_back(k.cast<std::string>());
      out.push_back(std::move(ev));
    }
    return out;
  }

 private:
  // Queues a frame that changes the pool (dropped while detached: the client's stores are
  // lost then too); a full outbox goes at once, as NodePoolClient._send sends it.
  void queue(std::uint16_t op, const std::string& payload) {
    stores_->queue(op, payload, true);
    if (stores_->outbox_bytes() >= outbox_limit_) client_.attr("flush")();
  }

  py::object py_;
  py::object client_;                       // py_.client, a NodePoolClient
  std::shared_ptr<NodePoolStores> stores_;  // client_._stores
  std::shared_ptr<NodePoolLoads> loads_;    // client_._loads
  std::uint16_t complete_store_op_ = 0;
  std::uint16_t complete_load_op_ = 0;
  std::uint16_t touch_op_ = 0;
  std::uint16_t store_reserved_op_ = 0;
  std::size_t outbox_limit_ = 0;
};

}  // namespace

std::shared_ptr<BlockManager> node_pool_manager(py::object manager) {
  return std::make_shared<NodePoolManager>(std::move(manager));
}

}  // namespace kvoff::bindings
