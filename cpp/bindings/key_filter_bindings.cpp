// KeyFilter (kvoff/key_filter.h) over a Python buffer: a node pool's shared-memory mapping.
// The buffer is held (a Py_buffer export) until release(), so the mapping cannot be closed
// under the filter.
#include <pybind11/pybind11.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "kvoff/key_filter.h"

namespace kvoff::bindings {

namespace {

constexpr const char* kFilterDoc = R"doc(A counting Bloom filter of block keys in shared memory.

The node pool (the one writer) adds a key when its index takes it and removes it when the
index drops it; engines (readers, in other processes) ask ``may_contain`` before they ask the
pool, and take False as a miss with no round trip. A key added and not removed is always True;
False for a present key is impossible once its add is visible (the pool makes it visible before
it replies to the store). True for an absent key (0.24 % at capacity: 16 one-byte cells per key,
4 probes; the C++ header gives the formula's source) only costs a round trip.

Memory: ``KeyFilter.bytes_for(capacity)`` bytes (a 64-byte header, then the cells).
Make one with ``KeyFilter.create(buffer, epoch)`` (writable, formats it) or
``KeyFilter.attach(buffer)`` (read-only; checks the header). ``release()`` lets the buffer go.
)doc";

class PyKeyFilter {
 public:
  PyKeyFilter(py::buffer buffer, bool writable, std::uint64_t epoch)
      : view_(std::make_unique<py::buffer_info>(buffer.request(writable))), writable_(writable) {
    if (view_->ndim != 1 || view_->itemsize != 1) {
      throw std::invalid_argument("a key filter needs a flat byte buffer (a mmap or bytearray)");
    }
    const auto bytes = static_cast<std::size_t>(view_->size * view_->itemsize);
    auto* data = static_cast<std::byte*>(view_->ptr);
    filter_ = writable ? KeyFilter::create({data, bytes}, epoch)
                       : KeyFilter::attach(std::span<const std::byte>(data, bytes));
  }

  const KeyFilter& get() const {
    if (!filter_) throw std::invalid_argument("this key filter was released; attach it again");
    return *filter_;
  }

  KeyFilter& writer() {
    if (!writable_) {
      throw std::invalid_argument("this key filter was attached read-only; only its creator "
                                  "(the node pool) adds and removes keys");
    }
    get();
    return *filter_;
  }

  void release() {
    filter_.reset();
    view_.reset();  // the buffer export ends here
  }

 private:
  std::unique_ptr<py::buffer_info> view_;
  std::optional<KeyFilter> filter_;
  bool writable_;
};

}  // namespace

const KeyFilter& key_filter_of(py::handle filter) {
  if (!py::isinstance<PyKeyFilter>(filter)) {
    throw py::type_error("expected a kvoff._scheduler.KeyFilter, got " + short_repr(filter.ptr()));
  }
  return filter.cast<const PyKeyFilter&>().get();
}

void bind_key_filter(py::module_& m) {
  py::class_<PyKeyFilter>(m, "KeyFilter", kFilterDoc)
      .def_static("bytes_for", &KeyFilter::bytes_for, py::arg("capacity"),
                  py::doc("bytes_for(capacity: int) -> int\n\nBytes of memory for a filter of "
                          "``capacity`` keys (its index's slots): 64 + 16 * capacity."))
      .def_static(
          "create",
          [](py::buffer buffer, std::uint64_t epoch) {
            return std::make_unique<PyKeyFilter>(std::move(buffer), true, epoch);
          },
          py::arg("buffer"), py::arg("epoch"),
          py::doc("create(buffer, epoch: int) -> KeyFilter\n\nFormats the writable ``buffer`` "
                  "(every cell 0) and returns the writer. ``epoch`` (0..2**64-1) names this "
                  "filter to its readers. Raises ValueError when the buffer is smaller than "
                  "bytes_for(1) or not 8-byte aligned; BufferError when it is read-only."))
      .def_static(
          "attach",
          [](py::buffer buffer) {
            return std::make_unique<PyKeyFilter>(std::move(buffer), false, 0);
          },
          py::arg("buffer"),
          py::doc("attach(buffer) -> KeyFilter\n\nA reader of a filter ``create`` formatted "
                  "(possibly in another process). Raises ValueError when the header is not a "
                  "filter of this kvoff's format, or names more cells than the buffer holds."))
      .def(
          "add",
          [](PyKeyFilter& self, py::handle keys) {
            KeyBatch batch(keys);  // converted (and checked) before any cell changes
            KeyFilter& f = self.writer();
            for (std::string_view k : batch.span()) f.add(k);
          },
          py::arg("keys"),
          py::doc("add(self, keys: Sequence[bytes]) -> None\n\nCounts the keys in. Raises "
                  "ValueError on a read-only or released filter; TypeError or ValueError for a "
                  "bad key (nothing is added)."))
      .def(
          "remove",
          [](PyKeyFilter& self, py::handle keys) {
            KeyBatch batch(keys);
            KeyFilter& f = self.writer();
            std::size_t unknown = 0;
            for (std::string_view k : batch.span()) unknown += !f.remove(k);
            return unknown;
          },
          py::arg("keys"),
          py::doc("remove(self, keys: Sequence[bytes]) -> int\n\nCounts the keys out; returns "
                  "how many were not counted in (left alone, so that no other key becomes "
                  "False). Raises as add."))
      .def(
          "may_contain",
          [](const PyKeyFilter& self, py::handle key) {
            std::array<char, 8> buf{};
            const std::string_view k = to_key(key.ptr(), "key", -1, buf);
            return self.get().may_contain(k);
          },
          py::arg("key"),
          py::doc("may_contain(self, key: bytes) -> bool\n\nFalse: the key is not in the "
                  "writer's index. True: it may be (ask the pool). Raises ValueError on a "
                  "released filter."))
      .def(
          "may_contain_any",
          [](const PyKeyFilter& self, py::handle keys, py::bytes prefix) {
            KeyBatch batch(keys);
            const KeyFilter& f = self.get();
            const std::string_view head(prefix);
            // every prefix + key in one buffer, viewed key by key
            std::size_t total = 0;
            for (std::string_view k : batch.span()) total += head.size() + k.size();
            std::string joined;
            joined.reserve(total);
            std::vector<std::string_view> views;
            views.reserve(batch.span().size());
            for (std::string_view k : batch.span()) {
              joined.append(head);
              joined.append(k);
            }
            std::size_t at = 0;
            for (std::string_view k : batch.span()) {
              views.emplace_back(joined.data() + at, head.size() + k.size());
              at += head.size() + k.size();
            }
            return f.first_maybe(views) < views.size();
          },
          py::arg("keys"), py::arg("prefix") = py::bytes(),
          py::doc("may_contain_any(self, keys: Sequence[bytes], prefix: bytes = b'') -> bool\n\n"
                  "False: no ``prefix + key`` is in the writer's index (each a miss, no round "
                  "trip). True: one may be. One call for a batch (an engine's store of a "
                  "step). Raises ValueError on a released filter; TypeError or ValueError for a "
                  "bad key."))
      .def_property_readonly("epoch", [](const PyKeyFilter& self) { return self.get().epoch(); },
                             "The creator's epoch (int).")
      .def_property_readonly("num_cells",
                             [](const PyKeyFilter& self) { return self.get().num_cells(); },
                             "Cells (one byte each).")
      .def("nonzero_cells", [](const PyKeyFilter& self) { return self.get().nonzero_cells(); },
           py::doc("nonzero_cells(self) -> int\n\nCells not 0 (a scan of every cell: for "
                   "status, not per call)."))
      .def("release", &PyKeyFilter::release,
           py::doc("release(self) -> None\n\nLets the buffer go (a mmap can then be closed); "
                   "later calls raise ValueError. Idempotent."));
}

}  // namespace kvoff::bindings
