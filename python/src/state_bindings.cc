// Python view of orbitkv::state: namespaces, StateKey, ShardOf and RecoveryContract, shaped like the original
// OrbitKV Python API (RecoveryContract(namespace, page_tokens, groups=[(group, kind, param)])).
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "native.h"
#include "state/namespace.h"
#include "state/recovery.h"
#include "state/state_key.h"

namespace py = pybind11;

namespace orbitkv::python {
namespace {

using state::StateKey;
using state::StateNamespace;

state::Digest256 DigestFromBytes(const py::bytes& b, const char* what) {
  std::string s = b;
  if (s.empty()) return {};
  if (s.size() != 32) {
    throw StatusError(
        Status::InvalidArgument(std::string(what) + " must be 32 bytes, got " + std::to_string(s.size())));
  }
  state::Digest256 d;
  std::copy(s.begin(), s.end(), d.bytes.begin());
  return d;
}

StateNamespace NamespaceFromBytes(const py::bytes& b) {
  // Unlike the optional format digests, a namespace is never implied: empty is an error, not all zeros.
  if (std::string(b).size() != 32) {
    throw StatusError(Status::InvalidArgument("namespace must be the 32 bytes derive_namespace() returns"));
  }
  return StateNamespace(DigestFromBytes(b, "namespace"));
}

py::bytes ToBytes(const state::Digest256& d) {
  return py::bytes(reinterpret_cast<const char*>(d.bytes.data()), d.bytes.size());
}

state::NamespaceIdentity MakeIdentity(const std::string& model_id, const std::string& weights_revision,
                                      const std::string& tokenizer, const std::string& engine_kind,
                                      const std::string& cache_scope, const py::bytes& model_digest,
                                      const py::bytes& implementation_digest, const std::string& dtype,
                                      const std::string& layout, const std::string& layout_detail,
                                      uint32_t page_size_tokens, uint32_t tp_size, uint32_t tp_rank, uint32_t pp_size,
                                      uint32_t pp_rank) {
  state::NamespaceIdentity id;
  id.model_id = model_id;
  id.weights_revision = weights_revision;
  id.tokenizer = tokenizer;
  id.engine_kind = engine_kind;
  id.cache_scope = cache_scope;
  id.format.model_digest = DigestFromBytes(model_digest, "model_digest");
  id.format.implementation_digest = DigestFromBytes(implementation_digest, "implementation_digest");
  auto parsed_dtype = state::ParseDType(dtype);
  if (!parsed_dtype) throw StatusError(Status::InvalidArgument("unknown dtype '" + dtype + "'"));
  id.format.dtype = *parsed_dtype;
  auto parsed_layout = state::ParseLayout(layout);
  if (!parsed_layout) throw StatusError(Status::InvalidArgument("unknown layout '" + layout + "'"));
  id.format.layout = *parsed_layout;
  id.format.layout_detail = layout_detail;
  id.format.page_size_tokens = page_size_tokens;
  id.format.parallel = {tp_size, tp_rank, pp_size, pp_rank};
  return id;
}

state::RecoveryRuleKind ParseKind(const std::string& kind) {
  if (kind == "prefix") return state::RecoveryRuleKind::kPrefix;
  if (kind == "window") return state::RecoveryRuleKind::kWindow;
  if (kind == "checkpoint") return state::RecoveryRuleKind::kCheckpoint;
  throw StatusError(Status::InvalidArgument("unknown rule kind '" + kind + "' (prefix, window, checkpoint)"));
}

}  // namespace

void BindState(py::module_& m) {
  auto identity_args = [] {
    return std::make_tuple(py::arg("model_id"), py::arg("weights_revision"), py::arg("tokenizer"),
                           py::arg("engine_kind"), py::kw_only(), py::arg("cache_scope") = "",
                           py::arg("model_digest") = py::bytes(), py::arg("implementation_digest") = py::bytes(),
                           py::arg("dtype") = "bf16", py::arg("layout") = "layer_first", py::arg("layout_detail") = "",
                           py::arg("page_size_tokens") = 16, py::arg("tp_size") = 1, py::arg("tp_rank") = 0,
                           py::arg("pp_size") = 1, py::arg("pp_rank") = 0);
  };
  std::apply(
      [&](auto... args) {
        m.def(
            "derive_namespace",
            [](const std::string& model_id, const std::string& weights_revision, const std::string& tokenizer,
               const std::string& engine_kind, const std::string& cache_scope, const py::bytes& model_digest,
               const py::bytes& implementation_digest, const std::string& dtype, const std::string& layout,
               const std::string& layout_detail, uint32_t page_size_tokens, uint32_t tp_size, uint32_t tp_rank,
               uint32_t pp_size, uint32_t pp_rank) {
              auto id = MakeIdentity(model_id, weights_revision, tokenizer, engine_kind, cache_scope, model_digest,
                                     implementation_digest, dtype, layout, layout_detail, page_size_tokens, tp_size,
                                     tp_rank, pp_size, pp_rank);
              return ToBytes(ValueOrThrow(state::DeriveNamespace(id)).digest());
            },
            args...,
            "The 32-byte StateKey namespace of an engine's identity and state format. Any change of model, "
            "weights, tokenizer, engine, scope, dtype, layout, page size or rank changes it.");
      },
      identity_args());

  py::class_<StateKey>(m, "StateKey", "Identity of one stored block (namespace, group, token span, native key).")
      .def(py::init([](const py::bytes& ns, uint32_t group, uint64_t begin, uint64_t end, const py::bytes& native,
                       uint16_t key_version) {
             std::string native_bytes = native;
             return ValueOrThrow(
                 StateKey::Create(NamespaceFromBytes(ns), group, {begin, end}, native_bytes, key_version));
           }),
           py::arg("namespace"), py::arg("group"), py::arg("begin"), py::arg("end"), py::arg("native_key"),
           py::arg("key_version") = 1)
      .def_property_readonly("namespace", [](const StateKey& k) { return ToBytes(k.ns().digest()); })
      .def_property_readonly("group", &StateKey::group)
      .def_property_readonly("span", [](const StateKey& k) { return py::make_tuple(k.span().begin, k.span().end); })
      .def_property_readonly("key_version", &StateKey::key_version)
      .def_property_readonly("native_key",
                             [](const StateKey& k) {
                               auto n = k.native_key();
                               return py::bytes(reinterpret_cast<const char*>(n.data()), n.size());
                             })
      .def("encode",
           [](const StateKey& k) {
             auto e = k.Encode();
             return py::bytes(reinterpret_cast<const char*>(e.data()), e.size());
           })
      .def_static("decode",
                  [](const py::bytes& b) {
                    std::string s = b;
                    return ValueOrThrow(StateKey::Decode(
                        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size())));
                  })
      .def("shard_of",
           [](const StateKey& k, uint32_t n) {
             if (n == 0) throw StatusError(Status::InvalidArgument("shard_of needs at least one shard"));
             return state::ShardOf(k, n);
           })
      .def(
          "__eq__", [](const StateKey& a, const StateKey& b) { return a == b; }, py::is_operator())
      .def("__hash__", [](const StateKey& k) { return static_cast<py::ssize_t>(k.Hash64() >> 1); })
      .def("__repr__", [](const StateKey& k) { return "StateKey(" + k.ToString() + ")"; });

  py::class_<state::RecoveryContract>(m, "RecoveryContract",
                                      "Compiled recovery rules: which group ranges a restore boundary needs.")
      .def(py::init([](const py::bytes& ns, uint32_t page_tokens,
                       const std::vector<std::tuple<uint32_t, std::string, uint64_t>>& groups) {
             std::vector<state::RecoveryRule> rules;
             for (const auto& [group, kind, param] : groups) {
               // The parameter goes through unchanged so that Compile rejects a window on a non-window rule.
               rules.push_back({.group = group, .kind = ParseKind(kind), .window_tokens = param});
             }
             return ValueOrThrow(state::RecoveryContract::Compile(NamespaceFromBytes(ns), page_tokens, rules));
           }),
           py::arg("namespace"), py::arg("page_tokens"), py::arg("groups"))
      .def_property_readonly("page_tokens", &state::RecoveryContract::page_tokens)
      .def(
          "required_ranges",
          [](const state::RecoveryContract& c, const py::bytes& ns, uint64_t start, uint64_t end) {
            auto demand = ValueOrThrow(c.RequiredRanges(NamespaceFromBytes(ns), start, end));
            std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> out;
            for (const auto& r : demand.ranges) out.emplace_back(r.group, r.begin, r.end);
            return out;
          },
          py::arg("namespace"), py::arg("start"), py::arg("end"))
      .def(
          "restorable_boundaries",
          [](const state::RecoveryContract& c, const py::bytes& ns, uint64_t start, uint64_t end,
             const std::vector<std::pair<uint32_t, std::vector<uint64_t>>>& groups) {
            std::vector<state::GroupCoverage> coverage;
            for (const auto& [group, pages] : groups) coverage.push_back({group, pages});
            return ValueOrThrow(c.RestorableBoundaries(NamespaceFromBytes(ns), start, end, coverage));
          },
          py::arg("namespace"), py::arg("start"), py::arg("end"), py::arg("groups"));

  m.def(
      "intersect_boundaries",
      [](std::vector<std::vector<uint64_t>> sets) {
        for (auto& set : sets) {
          std::sort(set.begin(), set.end());
          set.erase(std::unique(set.begin(), set.end()), set.end());
        }
        return state::IntersectBoundaries(sets);
      },
      py::arg("sets"), "Boundaries legal on every rank: the intersection of ascending lists.");
}

}  // namespace orbitkv::python
