// NodePoolStores (kvoff/node_pool_stores.h): an engine's side of its node pool stores, shared
// by the Python client (kvoff.node_pool.NodePoolClient) and the C++ scheduler's node pool
// manager (node_pool_manager.cpp), which reach the same object.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "kvoff/node_pool_loads.h"
#include "kvoff/node_pool_stores.h"

namespace kvoff::bindings {

namespace {

constexpr const char* kStoresDoc = R"doc(An engine's stores into a node pool, on the engine's side.

It holds the slots the pool reserved for this connection, the stores in flight (slot and key),
builds the payloads that tell the pool of them (``kvoff.node_pool.protocol``'s key lists,
every key with ``prefix``), and keeps the connection's outbox (the frames queued without a
reply) and request ids, so that the C++ scheduler queues its completions and touches with no
Python call. The reservation, and the right to complete a store, go with the
connection (``lose``); a store's slot stays in flight until the engine completes the store
(its copy may still write it), so a pool restarted on the same region cannot hand it to this
engine for another key (``begin`` returns False).

Keys are ``bytes`` (this engine's, without the prefix); slots are CPU block ids of the pool's
region (ints in [0, 2**32)).
)doc";

constexpr const char* kLoadsDoc = R"doc(An engine's loads from a node pool, on the engine's side.

It keeps which key each slot this engine loads from holds, this engine's loads of each key in
flight, and how many of them the current connection pinned: the pool releases a connection's
pins when it goes (``lose``), so only those are completed on the wire, and a load made from
leases after the pool went away counts here and sends nothing. The C++ scheduler's node pool
manager completes a step's loads by slot through it with no Python call.

Keys are ``bytes`` (this engine's, without the prefix); slots are CPU block ids of the pool's
region.
)doc";

std::vector<std::uint32_t> slots_from(py::handle obj) {
  std::vector<std::uint32_t> out;
  for (const std::int64_t v : to_ints(obj.ptr(), Where{"slots"})) {
    if (v < 0 || v > 0xFFFFFFFFLL) {
      throw std::invalid_argument("slots: " + std::to_string(v) + " is not a slot (0..2**32-1)");
    }
    out.push_back(static_cast<std::uint32_t>(v));
  }
  return out;
}

py::bytes as_bytes(const std::string& s) { return py::bytes(s.data(), s.size()); }

}  // namespace

void bind_node_pool_stores(py::module_& m) {
  py::class_<NodePoolStores, std::shared_ptr<NodePoolStores>>(m, "NodePoolStores", kStoresDoc)
      .def(py::init([](py::bytes prefix, std::uint16_t version) {
             return std::make_shared<NodePoolStores>(prefix, version);
           }),
           py::arg("prefix"), py::arg("version"),
           py::doc("NodePoolStores(prefix: bytes, version: int)\n\n``prefix``: the bytes every "
                   "key of this engine carries in the pool; ``version``: the protocol version "
                   "its frames carry. Detached at first (``set_attached``). Raises ValueError "
                   "for a prefix of 1024 bytes or more."))
      .def(
          "queue",
          [](NodePoolStores& s, std::uint16_t op, py::bytes payload, py::handle changes) {
            return s.queue(op, std::string_view(payload), to_bool(changes, "changes"));
          },
          py::arg("op"), py::arg("payload"), py::arg("changes"),
          py::doc("queue(self, op: int, payload: bytes, changes: bool) -> int\n\nQueues a "
                  "frame (op 0..65535) with the next request id, which it returns; 0, and "
                  "nothing queued, while detached. ``changes``: the call changes the pool "
                  "(``take_changed``)."))
      .def("next_request_id", &NodePoolStores::next_request_id,
           py::doc("next_request_id(self) -> int\n\nThe next request id (1..2**32-1), for a "
                   "frame the caller sends itself."))
      .def("take_outbox",
           [](NodePoolStores& s) {
             const std::string out = s.take_outbox();
             return as_bytes(out);
           },
           py::doc("take_outbox(self) -> bytes\n\nThe queued frames, in order; emptied."))
      .def_property_readonly("outbox_bytes", &NodePoolStores::outbox_bytes,
                             "Bytes queued (int).")
      .def("take_changed", &NodePoolStores::take_changed,
           py::doc("take_changed(self) -> bool\n\nWhether a call that changes the pool was "
                   "queued since the last call (answers kept from the pool are stale)."))
      .def(
          "set_attached",
          [](NodePoolStores& s, py::handle attached) {
            s.set_attached(to_bool(attached, "attached"));
          },
          py::arg("attached"),
           py::doc("set_attached(self, attached: bool) -> None\n\nWhether a pool is there "
                   "to send to; False drops the outbox."))
      .def_property_readonly("attached", &NodePoolStores::attached,
                             "Whether a pool is there to send to (bool).")
      .def_property_readonly("num_reserved_stores", &NodePoolStores::num_reserved_stores,
                             "Stores made into reserved slots (int).")
      .def("set_num_slots", &NodePoolStores::set_num_slots, py::arg("num_slots"),
           py::doc("set_num_slots(self, num_slots: int) -> None\n\nThe pool's slot count (its "
                   "hello): a slot at or past it is refused. Raises ValueError over 2**28."))
      .def("add_reserved",
           [](NodePoolStores& s, py::handle slots) { s.add_reserved(slots_from(slots)); },
           py::arg("slots"),
           py::doc("add_reserved(self, slots: Sequence[int]) -> None\n\nSlots the pool granted "
                   "(a RESERVE reply), in grant order. Raises ValueError, adding none, for a "
                   "slot at or past the pool's slot count."))
      .def("add_evicted",
           [](NodePoolStores& s, py::handle keys) {
             KeyBatch batch(keys);
             s.add_evicted({batch.span().begin(), batch.span().end()});
           },
           py::arg("keys"),
           py::doc("add_evicted(self, keys: Sequence[bytes]) -> None\n\nKeys (prefixed) the "
                   "pool evicted to grant a reservation, handed to the next reserved store."))
      .def("take_evicted",
           [](NodePoolStores& s) { return to_bytes_list(s.take_evicted()); },
           py::doc("take_evicted(self) -> list[bytes]\n\nThe evicted keys not handed out yet "
                   "(emptied)."))
      .def_property_readonly("num_reserved", &NodePoolStores::num_reserved,
                             "Slots reserved for this connection (int).")
      .def_property_readonly("num_storing", &NodePoolStores::num_storing,
                             "Stores in flight, of any connection of this engine (int).")
      .def(
          "store_reserved",
          [](NodePoolStores& s, py::handle keys, py::handle filter) -> py::object {
            KeyBatch batch(keys);
            std::vector<std::uint32_t> slots;
            std::string payload;
            if (!s.store_reserved(batch.span(), key_filter_of(filter), slots, payload)) {
              return py::none();
            }
            return py::make_tuple(to_int_list(slots), as_bytes(payload));
          },
          py::arg("keys"), py::arg("filter"),
          py::doc("store_reserved(self, keys: Sequence[bytes], filter: KeyFilter) -> "
                  "tuple[list[int], bytes] | None\n\nStores the keys into the next reserved "
                  "slots when every key is new (distinct, not in flight here, and ruled out by "
                  "the pool's key filter ``filter``): (their slots, the STORE_RESERVED payload). "
                  "None, and nothing changed, otherwise (ask the pool). Raises ValueError for an "
                  "empty or too long key, or a released filter (nothing changed)."))
      .def(
          "begin",
          [](NodePoolStores& s, py::handle keys, py::handle slots) {
            KeyBatch batch(keys);
            return s.begin(batch.span(), slots_from(slots));
          },
          py::arg("keys"), py::arg("slots"),
          py::doc("begin(self, keys: Sequence[bytes], slots: Sequence[int]) -> bool\n\nStores "
                  "the pool granted: ``keys[i]`` into ``slots[i]``. False, nothing changed, "
                  "when a slot or key is in flight here already (refuse the store). Raises "
                  "ValueError when the lengths differ, a slot repeats, or a slot is at or past "
                  "the pool's slot count (nothing changed)."))
      .def(
          "complete_slots",
          [](NodePoolStores& s, py::handle slots, py::handle success) {
            const bool ok = to_bool(success, "success");
            std::string payload;
            s.complete_slots(slots_from(slots), ok, payload);
            return as_bytes(payload);
          },
          py::arg("slots"), py::arg("success"),
          py::doc("complete_slots(self, slots: Sequence[int], success: bool) -> bytes\n\nEnds "
                  "the stores in ``slots``: the COMPLETE_STORE payload of those this connection "
                  "made, b'' when none (nothing to send). Slots not in flight are skipped."))
      .def(
          "complete_keys",
          [](NodePoolStores& s, py::handle keys, py::handle success) {
            const bool ok = to_bool(success, "success");
            KeyBatch batch(keys);
            std::string payload;
            s.complete_keys(batch.span(), ok, payload);
            return as_bytes(payload);
          },
          py::arg("keys"), py::arg("success"),
          py::doc("complete_keys(self, keys: Sequence[bytes], success: bool) -> bytes\n\n"
                  "complete_slots by key (each key once; keys not in flight are skipped)."))
      .def("lose", &NodePoolStores::lose,
           py::doc("lose(self) -> None\n\nThe connection is gone: its reservation and the "
                   "right to complete its stores went with it (their slots stay in flight "
                   "until completed)."))
      .def("storing",
           [](const NodePoolStores& s, py::bytes key) { return s.storing(std::string_view(key)); },
           py::arg("key"), py::doc("storing(self, key: bytes) -> bool\n\nWhether ``key`` is in "
                                   "flight."))
      .def("slot_of",
           [](const NodePoolStores& s, py::bytes key) { return s.slot_of(std::string_view(key)); },
           py::arg("key"), py::doc("slot_of(self, key: bytes) -> int | None\n\nThe slot ``key`` "
                                   "is being stored into, if it is."));

  py::class_<NodePoolLoads, std::shared_ptr<NodePoolLoads>>(m, "NodePoolLoads", kLoadsDoc)
      .def(py::init([](py::bytes prefix) { return std::make_shared<NodePoolLoads>(prefix); }),
           py::arg("prefix"),
           py::doc("NodePoolLoads(prefix: bytes)\n\n``prefix``: the bytes every key of this "
                   "engine carries in the pool. Raises ValueError for a prefix of 1024 bytes or "
                   "more."))
      .def("set_num_slots", &NodePoolLoads::set_num_slots, py::arg("num_slots"),
           py::doc("set_num_slots(self, num_slots: int) -> None\n\nThe pool's slot count (its "
                   "hello): ``pin`` refuses a slot at or past it. Raises ValueError over 2**28."))
      .def(
          "pin",
          [](NodePoolLoads& l, py::handle keys, py::handle slots, py::handle connection) {
            const bool current = to_bool(connection, "connection");
            KeyBatch batch(keys);
            l.pin(batch.span(), slots_from(slots), current);
          },
          py::arg("keys"), py::arg("slots"), py::arg("connection"),
          py::doc("pin(self, keys: Sequence[bytes], slots: Sequence[int], connection: bool) -> "
                  "None\n\nLoads of ``keys[i]`` from ``slots[i]`` begin; ``connection``: the "
                  "current connection's pool pinned them (False: loads from leases after the "
                  "pool went away). Raises ValueError, changing nothing, when the lengths "
                  "differ, a slot is at or past the pool's slot count, or a key is empty or too "
                  "long."))
      .def(
          "complete_slots",
          [](NodePoolLoads& l, py::handle slots) {
            std::string payload;
            l.complete_slots(slots_from(slots), payload);
            return as_bytes(payload);
          },
          py::arg("slots"),
          py::doc("complete_slots(self, slots: Sequence[int]) -> bytes\n\nEnds one load from "
                  "each slot: the COMPLETE_LOAD payload of those the current connection pinned, "
                  "b'' when none (nothing to send). Slots not loading are skipped."))
      .def(
          "complete_keys",
          [](NodePoolLoads& l, py::handle keys) {
            KeyBatch batch(keys);
            std::string payload;
            l.complete_keys(batch.span(), payload);
            return as_bytes(payload);
          },
          py::arg("keys"),
          py::doc("complete_keys(self, keys: Sequence[bytes]) -> bytes\n\ncomplete_slots by "
                  "key: one load of each key (keys not loading are skipped)."))
      .def("lose", &NodePoolLoads::lose,
           py::doc("lose(self) -> None\n\nThe connection is gone and the pool released its "
                   "pins: the loads go on, their completions send nothing."))
      .def("pins",
           [](const NodePoolLoads& l, py::bytes key) { return l.pins(std::string_view(key)); },
           py::arg("key"),
           py::doc("pins(self, key: bytes) -> int\n\nThis engine's loads of ``key`` in flight."))
      .def(
          "connection_pins",
          [](const NodePoolLoads& l, py::bytes key) {
            return l.connection_pins(std::string_view(key));
          },
          py::arg("key"),
          py::doc("connection_pins(self, key: bytes) -> int\n\nLoads of ``key`` in flight "
                  "that the current connection pinned."))
      .def("slot_of",
           [](const NodePoolLoads& l, py::bytes key) { return l.slot_of(std::string_view(key)); },
           py::arg("key"),
           py::doc("slot_of(self, key: bytes) -> int | None\n\nA slot ``key`` is being loaded "
                   "from, if it is."))
      .def(
          "loading_mask",
          [](const NodePoolLoads& l, py::handle keys) {
            KeyBatch batch(keys);
            return as_bytes(l.loading_mask(batch.span()));
          },
          py::arg("keys"),
          py::doc("loading_mask(self, keys: Sequence[bytes]) -> bytes\n\nPer key, 1 when it "
                  "is being loaded, else 0."))
      .def_property_readonly("num_loads", &NodePoolLoads::num_loads,
                             "Loads in flight; a key loaded twice counts twice (int).")
      .def_property_readonly("num_keys", &NodePoolLoads::num_keys, "Keys being loaded (int).");
}

}  // namespace kvoff::bindings
