// Python view of orbitkv::client::CacheClient. Every call that may block (anything that talks to
// the Manager) releases the GIL; arguments are converted to C++ values before, so no Python object
// is touched without it.
#include <fmt/format.h>
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "client/cache_client.h"
#include "native.h"

namespace orbitkv::python {
namespace {

namespace py = pybind11;
using client::CacheClient;
using GilRelease = py::call_guard<py::gil_scoped_release>;

state::StateNamespace NamespaceFromBytes(const std::string& bytes) {
  if (bytes.size() != 32) throw StatusError(Status::InvalidArgument("a namespace is exactly 32 bytes"));
  state::Digest256 digest;
  std::copy(bytes.begin(), bytes.end(), digest.bytes.begin());
  return state::StateNamespace(digest);
}

}  // namespace

void BindClient(py::module_& m) {
  py::class_<CacheClient>(m, "CacheClient",
                          "A connection to this host's OrbitKV Manager (see orbitkv.CacheManagerClient for the "
                          "friendly wrapper).")
      .def(py::init([](std::optional<std::string> socket_path, int timeout_ms, int spin_iterations) {
             client::ClientOptions options;
             options.socket_path = socket_path.value_or("");
             options.timeout = std::chrono::milliseconds(timeout_ms);
             options.spin_iterations = spin_iterations;
             Result<std::unique_ptr<CacheClient>> connected = [&] {
               py::gil_scoped_release release;
               return CacheClient::Connect(options);
             }();
             return ValueOrThrow(std::move(connected));
           }),
           py::arg("socket_path") = py::none(), py::arg("timeout_ms") = 5000, py::arg("spin_iterations") = 4096)
      .def_property_readonly("socket_path", &CacheClient::socket_path)
      .def_property_readonly("session_id", &CacheClient::session_id)
      .def_property_readonly("manager_incarnation", &CacheClient::manager_incarnation)
      .def(
          "max_query_keys", [](const CacheClient& c, size_t native_bytes) { return c.MaxQueryKeys(native_bytes); },
          py::arg("native_bytes") = 32)
      .def(
          "register_instance",
          [](CacheClient& c, uint64_t instance, const py::bytes& ns, const std::string& label) {
            const state::StateNamespace parsed = NamespaceFromBytes(ns);
            py::gil_scoped_release release;
            ThrowIfError(c.RegisterInstance(instance, parsed, label));
          },
          py::arg("instance_id"), py::arg("namespace"), py::arg("label") = "")
      .def(
          "register_group",
          [](CacheClient& c, uint64_t instance, uint32_t group, uint32_t num_pages,
             const std::vector<std::tuple<int, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>>& buffers,
             const std::optional<std::vector<std::tuple<py::bytes, uint64_t, std::string>>>& cuda_ipc) {
            std::vector<client::BufferSpec> specs;
            for (const auto& [fd, bytes, offset, stride, page, address] : buffers)
              specs.push_back({fd, bytes, offset, stride, page, address, std::nullopt});
            if (cuda_ipc.has_value()) {
              if (cuda_ipc->size() != specs.size()) {
                throw StatusError(
                    Status::InvalidArgument("cuda_ipc needs one (handle, offset, pci_bus_id) per buffer"));
              }
              for (size_t i = 0; i < specs.size(); ++i) {
                const auto& [handle, offset, bus_id] = (*cuda_ipc)[i];
                const std::string raw = handle;
                client::CudaIpcSpec spec;
                if (raw.size() != spec.handle.size()) {
                  throw StatusError(Status::InvalidArgument(
                      fmt::format("a CUDA IPC handle is {} bytes, not {}", spec.handle.size(), raw.size())));
                }
                std::copy(raw.begin(), raw.end(), spec.handle.begin());
                spec.offset = offset;
                spec.pci_bus_id = bus_id;
                specs[i].cuda_ipc = std::move(spec);
              }
            }
            py::gil_scoped_release release;
            return ValueOrThrow(c.RegisterGroup(instance, group, num_pages, specs));
          },
          py::arg("instance_id"), py::arg("group"), py::arg("num_pages"), py::arg("buffers"),
          py::arg("cuda_ipc") = py::none(),
          "buffers: [(fd, buffer_bytes, base_offset, page_stride, page_bytes, address)], one per "
          "KV buffer (fd -1: ordinary memory of this process at address); cuda_ipc: None, or "
          "[(64-byte cudaIpcMemHandle_t, offset in the exported allocation, PCI bus id)], one per "
          "buffer (fd -1, address 0): GPU buffers. Returns the padded bytes of one block")
      .def(
          "unregister_instance",
          [](CacheClient& c, uint64_t instance) { ThrowIfError(c.UnregisterInstance(instance)); }, GilRelease(),
          py::arg("instance_id"))
      .def(
          "query",
          [](CacheClient& c, uint64_t instance, uint32_t group, const std::vector<state::StateKey>& keys,
             uint32_t wait_ms) {
            client::QueryResult result = [&] {
              py::gil_scoped_release release;
              return ValueOrThrow(wait_ms == 0
                                      ? c.Query(instance, group, keys)
                                      : c.QueryWait(instance, group, keys, std::chrono::milliseconds(wait_ms)));
            }();
            return py::make_tuple(result.hits, result.lease, result.loading_op);
          },
          py::arg("instance_id"), py::arg("group"), py::arg("keys"), py::arg("wait_ms") = 0,
          "-> (hits, lease, loading_op): the longest resident prefix, leased when hits > 0; "
          "loading_op != 0 when the prefix continues on SSD and is being loaded (ask again). "
          "wait_ms > 0 waits that long for a Loading answer to complete (no polling)")
      .def(
          "query_restore",
          [](CacheClient& c, uint64_t instance, uint32_t group, const std::vector<state::StateKey>& keys,
             const std::vector<uint32_t>& pages, uint32_t wait_ms) {
            py::gil_scoped_release release;
            return ValueOrThrow(c.QueryRestore(instance, group, keys, pages, std::chrono::milliseconds(wait_ms)));
          },
          py::arg("instance_id"), py::arg("group"), py::arg("keys"), py::arg("pages"), py::arg("wait_ms"),
          "-> blocks restored: the chain's resident prefix restored into pages (pages[i] for "
          "block i), and while a Loading operation brings the rest (up to wait_ms), each part as "
          "it arrives; returns once every copy drained")
      .def(
          "wait_loading",
          [](CacheClient& c, uint64_t instance, uint64_t op, uint32_t timeout_ms) {
            return ValueOrThrow(c.WaitLoading(instance, op, std::chrono::milliseconds(timeout_ms)));
          },
          GilRelease(), py::arg("instance_id"), py::arg("op"), py::arg("timeout_ms"),
          "waits until Loading operation `op` completed; returns the blocks of its chain now in "
          "DRAM. OrbitKVTimeout while it still runs; OrbitKVError (code NOT_FOUND or ABORTED) "
          "when a query took it or it was cancelled")
      .def(
          "query_native",
          [](CacheClient& c, uint64_t instance, uint32_t group, uint64_t first_token, uint32_t page_tokens,
             const py::object& hashes, uint16_t key_version, uint32_t wait_ms, bool fixed_span) {
            // Flatten the native keys while holding the GIL (straight from the bytes objects, no
            // per-item conversion), then talk to the Manager without it. `hashes` is a list of
            // equal-length bytes, or one bytes object of count x native_bytes with native_bytes
            // given by len(first) semantics below.
            std::string flat;
            size_t native_bytes = 0;
            if (PyList_Check(hashes.ptr()) || PyTuple_Check(hashes.ptr())) {
              const py::sequence seq = hashes.cast<py::sequence>();
              const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
              PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
              for (Py_ssize_t i = 0; i < n; ++i) {
                if (!PyBytes_Check(items[i])) throw StatusError(Status::InvalidArgument("block hashes must be bytes"));
                const size_t size = static_cast<size_t>(PyBytes_GET_SIZE(items[i]));
                if (i == 0) {
                  native_bytes = size;
                  flat.reserve(native_bytes * static_cast<size_t>(n));
                }
                if (size != native_bytes || size == 0 || size > 64) {
                  throw StatusError(Status::InvalidArgument("block hashes must all have the same length, 1-64 bytes"));
                }
                flat.append(PyBytes_AS_STRING(items[i]), size);
              }
            } else {
              throw StatusError(Status::InvalidArgument("block_hashes must be a list or tuple of bytes"));
            }
            client::QueryResult result;
            if (!flat.empty()) {
              py::gil_scoped_release release;
              const std::span natives(reinterpret_cast<const uint8_t*>(flat.data()), flat.size());
              const auto bytes = static_cast<uint8_t>(native_bytes);
              const uint8_t flags = fixed_span ? channel::kQueryFixedSpan : 0;
              result = ValueOrThrow(
                  wait_ms == 0
                      ? c.QueryNative(instance, group, first_token, page_tokens, bytes, natives, key_version, flags)
                      : c.QueryNativeWait(instance, group, first_token, page_tokens, bytes, natives,
                                          std::chrono::milliseconds(wait_ms), key_version, flags));
            }
            return py::make_tuple(result.hits, result.lease, result.loading_op);
          },
          py::arg("instance_id"), py::arg("group"), py::arg("first_token"), py::arg("page_tokens"),
          py::arg("block_hashes"), py::arg("key_version") = 1, py::arg("wait_ms") = 0, py::arg("fixed_span") = false,
          "-> (hits, lease, loading_op) for the chain of pages whose native keys (block hashes) "
          "are given; wait_ms > 0 waits that long for a Loading answer to complete; fixed_span: "
          "every page covers [first_token, first_token + page_tokens) (keys that name their prefix)")
      .def(
          "start_restore",
          [](CacheClient& c, uint64_t instance, uint32_t group, uint64_t lease, const std::vector<uint32_t>& pages) {
            return ValueOrThrow(c.StartRestore(instance, group, lease, pages));
          },
          GilRelease(), py::arg("instance_id"), py::arg("group"), py::arg("lease"), py::arg("pages"))
      .def(
          "start_restore_layers",
          [](CacheClient& c, uint64_t instance, uint32_t group, uint64_t lease, const std::vector<uint32_t>& pages,
             uint32_t first_buffer, uint32_t buffer_count, bool last) {
            return ValueOrThrow(c.StartRestoreLayers(instance, group, lease, pages, first_buffer, buffer_count, last));
          },
          GilRelease(), py::arg("instance_id"), py::arg("group"), py::arg("lease"), py::arg("pages"),
          py::arg("first_buffer"), py::arg("buffer_count"), py::arg("last"),
          "copies buffers [first_buffer, +buffer_count) of every leased block; the lease stays "
          "valid until the part with last=True")
      .def(
          "wait_restore",
          [](CacheClient& c, uint64_t handle, std::optional<int> timeout_ms) {
            std::optional<std::chrono::milliseconds> timeout;
            if (timeout_ms.has_value()) timeout = std::chrono::milliseconds(*timeout_ms);
            ThrowIfError(c.WaitRestore(handle, timeout));
          },
          GilRelease(), py::arg("handle"), py::arg("timeout_ms") = py::none())
      .def(
          "poll_restore",
          [](CacheClient& c, uint64_t handle) -> bool {
            std::optional<Status> done = ValueOrThrow(c.PollRestore(handle));
            if (!done.has_value()) return false;
            ThrowIfError(*done);
            return true;
          },
          GilRelease(), py::arg("handle"), "True when the restore completed (raises if it failed); False if pending")
      .def("take_restore_drained_ns", &CacheClient::TakeRestoreDrainedNanos, py::arg("handle"),
           "CLOCK_MONOTONIC ns when a completed restore's copies drained (once per handle), or None")
      .def(
          "abandon_restore", [](CacheClient& c, uint64_t handle) { return ValueOrThrow(c.AbandonRestore(handle)); },
          GilRelease(), py::arg("handle"),
          "True: the Manager had not claimed the restore, its pages were never written and are free "
          "again; False: it claimed it, the pages stay reserved until it completes")
      .def(
          "restore_signal",
          [](CacheClient& c, uint64_t handle) {
            CacheClient::RestoreSignal signal = ValueOrThrow(c.RestoreSignalOf(handle));
            return py::make_tuple(signal.offset, signal.value);
          },
          py::arg("handle"),
          "-> (offset, value): the pending restore's u64 claim word, offset bytes into "
          "claim_region(), reaches at least value once the Manager is through with its pages "
          "(a GPU stream may wait on it: cuStreamWaitValue64, GEQ)")
      .def(
          "guard_restore",
          [](CacheClient& c, uint64_t handle, int64_t after_ms) {
            ThrowIfError(c.GuardRestore(handle, std::chrono::milliseconds(std::max<int64_t>(0, after_ms))));
          },
          py::arg("handle"), py::arg("after_ms"),
          "abandons the restore after_ms from now on the client's own thread if the Manager has not "
          "claimed it by then (a GPU stream waiting on its word goes on while the engine's threads are "
          "blocked on that stream)")
      .def(
          "claim_region",
          [](const CacheClient& c) {
            std::span<uint8_t> region = c.claim_region();
            return py::make_tuple(reinterpret_cast<uintptr_t>(region.data()), region.size());
          },
          "-> (address, bytes): this session's claim words, page-aligned whole pages mapped for "
          "the client's lifetime")
      .def(
          "completion_fd", [](CacheClient& c) { return ValueOrThrow(c.CompletionFd()); },
          "an fd that turns readable when a reply arrives (poll it, then poll_restore)")
      .def(
          "save",
          [](CacheClient& c, uint64_t instance, uint32_t group,
             const std::vector<std::pair<state::StateKey, uint32_t>>& items) {
            std::vector<client::SaveItem> converted;
            converted.reserve(items.size());
            for (const auto& [key, page] : items) converted.push_back(client::SaveItem{key, page});
            client::SaveResult result = [&] {
              py::gil_scoped_release release;
              return ValueOrThrow(c.Save(instance, group, converted));
            }();
            return py::make_tuple(result.written, result.skipped);
          },
          py::arg("instance_id"), py::arg("group"), py::arg("items"),
          "items: [(StateKey, page)] -> (written, skipped); returns once the written blocks are "
          "resident")
      .def(
          "release",
          [](CacheClient& c, uint64_t instance, uint64_t lease) { ThrowIfError(c.Release(instance, lease)); },
          GilRelease(), py::arg("instance_id"), py::arg("lease"))
      .def(
          "cancel", [](CacheClient& c, uint64_t instance, uint64_t op) { return ValueOrThrow(c.Cancel(instance, op)); },
          GilRelease(), py::arg("instance_id"), py::arg("op"),
          "forgets a Loading operation: True, or False when there was none (it completed and was taken, or was "
          "cancelled); NOT_FOUND for an instance this session did not register")
      .def(
          "stats", [](CacheClient& c) { return ValueOrThrow(c.Stats()); }, GilRelease(),
          "the Manager's counters as a JSON string")
      .def("session_alive", &CacheClient::SessionAlive,
           "Whether the session is still open as far as this side can tell (no request): false once the Manager "
           "closed it or its process is gone")
      .def(
          "ping", [](CacheClient& c) { return ValueOrThrow(c.Ping()); }, GilRelease(),
          "a round trip; returns the Manager's incarnation");
}

}  // namespace orbitkv::python
