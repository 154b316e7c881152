"""The connector's configuration: ``kv_connector_extra_config`` keys, the engine's identity and its KV groups.

Everything here is derived from the vLLM config alone, so the scheduler process (which never sees a KV tensor) and
every worker compute the same namespace, recovery contract and group list. Workers then check their real tensors
against it in ``register_kv_caches``. docs/vllm.md documents every key.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import orbitkv
from orbitkv.link import canonical_options
from orbitkv.vllm._compat import scheduler_recovers_hybrid
from orbitkv.vllm.identity import WeightsIdentity, hub_cache_dirs, resolve_weights, tokenizer_identity
from orbitkv.vllm import computation
from orbitkv.vllm.keys import KEY_SCHEME

log = logging.getLogger("orbitkv.vllm")

PREFIX = "orbitkv."

# key -> (type, default). A None default means "derived" (see OrbitKVConfig.from_vllm).
_KEYS: dict[str, tuple[type, Any]] = {
    "socket_path": (str, None),
    "timeout_ms": (int, 5000),
    "spin_iterations": (int, 4096),
    "mode": (str, None),
    "instance_id": (int, None),
    "model_id": (str, None),
    "weights_revision": (str, None),
    "tokenizer": (str, None),
    "cache_scope": (str, None),
    "model_fingerprint": (str, None),
    "save_decode": (bool, True),
    "save_mode": (str, "deferred"),
    "require_manager": (bool, True),
    "reconnect_interval_s": (float, 1.0),
    "min_load_blocks": (int, 1),
    "weights_epoch": (str, ""),
    "load_mode": (str, "auto"),
    "layer_wait": (str, "auto"),
    "decline_slow_hits": (bool, True),
    "prefill_tokens_per_s": (float, 0.0),
}
_MODES = ("read_write", "save_only", "load_only")
_SAVE_MODES = ("deferred", "sync")
_LOAD_MODES = ("auto", "async", "layerwise")
_LAYER_WAITS = ("auto", "gpu", "cpu")


def _device_type(vllm_config) -> str:
    """vLLM's device type ("cuda", "cpu", ...): DeviceConfig.device_type, else its torch.device; "" if unknown."""
    device = getattr(vllm_config, "device_config", None)
    kind = getattr(device, "device_type", None) or getattr(getattr(device, "device", None), "type", None)
    return str(kind or "")


def _coerce(key: str, kind: type, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"kv_connector_extra_config['{PREFIX}{key}'] must be true or false, got {value!r}")
    if kind is int and isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config['{PREFIX}{key}'] must be an integer, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config['{PREFIX}{key}'] must be {kind.__name__}, got {value!r}") from None


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV-cache group as OrbitKV stores it: group id = vLLM's group index."""

    group: int
    kind: str  # "prefix" (full attention, MLA) or "window" (sliding window)
    window: int  # tokens; 0 for prefix groups
    layer_names: tuple
    page_bytes: int  # one block of one layer on one rank (vLLM's spec.page_size_bytes)
    block_size: int = 0  # tokens per block of this group (spec.block_size)
    layer_bytes: dict = field(default_factory=dict, hash=False)  # layer -> page bytes where they differ (workers)

    def bytes_of(self, layer: str) -> int:
        return self.layer_bytes.get(layer, self.page_bytes)


def _dtype_name(dtype: Any) -> str:
    """OrbitKV's dtype name for a torch dtype or a vLLM cache_dtype string."""
    text = str(dtype).replace("torch.", "").lower()
    table = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
             "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
             "float8_e5m2": "fp8_e5m2", "int8": "int8", "uint8": "uint8", "bf16": "bf16", "fp16": "fp16",
             "fp32": "fp32"}
    if text not in table:
        raise ValueError(f"OrbitKVConnector: unsupported KV cache dtype {dtype!r}")
    return table[text]


def _page_bytes(spec) -> int:
    return int(getattr(spec, "page_size_padded", None) or spec.page_size_bytes)


def kv_groups(kv_cache_config) -> list[GroupInfo]:
    """The KV groups of ``kv_cache_config`` (vLLM's KVCacheConfig); NotImplementedError for state OrbitKV cannot
    restore yet (Mamba/SSM, chunked-local attention)."""
    groups = []
    for index, spec_group in enumerate(kv_cache_config.kv_cache_groups):
        spec = spec_group.kv_cache_spec
        name = type(spec).__name__
        window = getattr(spec, "sliding_window", None)
        if "Mamba" in name or "ChunkedLocal" in name:
            raise NotImplementedError(
                f"OrbitKVConnector: KV group {index} is {name}; only full, MLA and sliding-window attention groups "
                "can be restored (disable the connector for this model)")
        kind, window = ("window", int(window)) if window else ("prefix", 0)
        # UniformTypeKVCacheSpecs (worker configs only; its page_size_bytes sums every layer): layers of one kind
        # whose pages differ in size. The scheduler's config carries the first layer's spec instead, so the
        # namespace is built from that one on both sides and workers check each layer against its own spec.
        per_layer = getattr(spec, "kv_cache_specs", None) or {}
        layer_bytes = {name: _page_bytes(s) for name, s in per_layer.items()}
        if per_layer:
            spec = per_layer.get(spec_group.layer_names[0]) or next(iter(per_layer.values()))
        groups.append(GroupInfo(index, kind, window, tuple(spec_group.layer_names), _page_bytes(spec),
                                int(getattr(spec, "block_size", 0) or 0), layer_bytes))
    if not groups:
        raise ValueError("OrbitKVConnector: the KV cache config has no groups")
    sizes = sorted({g.block_size for g in groups if g.block_size})
    if len(sizes) > 1:
        raise NotImplementedError(
            f"OrbitKVConnector: the KV cache groups have different block sizes {sizes}; a key names one block of "
            "every group, so all groups must share one block size (disable the connector for this model)")
    if not any(g.kind == "prefix" for g in groups):
        raise NotImplementedError("OrbitKVConnector: a model with only sliding-window layers is not supported")
    return groups


_warned: set = set()


def _warn_once(what: str, message: str, *args) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message, *args)


# v3: the model digest binds the computation (orbitkv.vllm.computation), not only a fingerprint.
NAMESPACE_VERSION = "orbitkv.vllm.v3"


def kv_cache_layout() -> str:
    """The KV cache layout vLLM's attention backends use (``VLLM_KV_CACHE_LAYOUT``, NHD by default): blocks saved
    in one layout are other bytes in the other (vLLM #55904)."""
    return os.environ.get("VLLM_KV_CACHE_LAYOUT", "NHD")


def _weights_identity(vllm_config, model_id: Optional[str], revision: Optional[str]) -> WeightsIdentity:
    """The weights' identity: explicit keys override, else what vLLM loaded (orbitkv.vllm.identity)."""
    model = vllm_config.model_config
    name = str(model.model)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    if model_id and revision:
        return WeightsIdentity(model_id, revision, "kv_connector_extra_config")
    found = resolve_weights(name, getattr(model, "revision", None), download_dir)
    if revision:
        return WeightsIdentity(model_id or (found.model_id if found else name), revision,
                               "kv_connector_extra_config")
    if found is None:
        raise ValueError(
            f"OrbitKVConnector cannot tell which weights {name!r} are: it is neither a local path nor found in "
            f"the Hugging Face cache ({', '.join(hub_cache_dirs(download_dir))}). Set "
            f"kv_connector_extra_config['{PREFIX}weights_revision'] to the weights' commit or checksum (the "
            "model name alone would let different weights share KV)")
    return WeightsIdentity(model_id or found.model_id, found.revision, found.source)


@dataclass
class OrbitKVConfig:
    """The parsed ``kv_connector_extra_config`` plus the identity the namespace is derived from."""

    socket_path: Optional[str]
    timeout_ms: int
    spin_iterations: int
    load_enabled: bool
    save_enabled: bool
    instance_base: int
    save_decode: bool
    save_mode: str
    require_manager: bool
    reconnect_interval_s: float
    min_load_blocks: int
    block_size: int
    hash_algo: str
    hash_block_size: int
    groups: list
    # namespace identity (derive_namespace arguments, minus the rank)
    identity: dict
    weights: Optional[WeightsIdentity] = None
    weights_epoch: str = ""
    load_mode: str = "async"  # "async" (between steps) or "layerwise" (inside the step, layer by layer)
    # Layer-wise loads on a GPU: "gpu" makes the engine's stream wait for each layer's pages (the CPU never waits
    # per layer), "cpu" waits on the CPU for the restore's reply; "auto": gpu where the driver can, else cpu.
    layer_wait: str = "auto"
    decline_slow_hits: bool = True
    prefill_tokens_per_s: float = 0.0  # 0: measured from the engine's steps

    @classmethod
    def from_vllm(cls, vllm_config, kv_cache_config) -> "OrbitKVConfig":
        transfer = vllm_config.kv_transfer_config
        extra = canonical_options(dict(getattr(transfer, "kv_connector_extra_config", None) or {}), PREFIX)
        values: dict[str, Any] = {}
        for raw_key, value in extra.items():
            if not raw_key.startswith(PREFIX):
                continue  # other connectors' keys (MultiConnector passes its whole dict)
            key = raw_key[len(PREFIX):]
            if key not in _KEYS:
                known = ", ".join(PREFIX + k for k in sorted(_KEYS))
                raise ValueError(f"unknown kv_connector_extra_config key '{raw_key}' (known: {known})")
            values[key] = _coerce(key, _KEYS[key][0], value)
        get = lambda key: values.get(key, _KEYS[key][1])  # noqa: E731

        role = getattr(transfer, "kv_role", "kv_both") or "kv_both"
        mode = get("mode") or {"kv_producer": "save_only", "kv_consumer": "load_only"}.get(role, "read_write")
        if mode not in _MODES:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}mode'] must be one of {_MODES}, got {mode!r}")
        save_mode = get("save_mode")
        if save_mode not in _SAVE_MODES:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}save_mode'] must be one of {_SAVE_MODES}, "
                             f"got {save_mode!r}")
        for key in ("timeout_ms", "reconnect_interval_s"):
            if get(key) <= 0:
                raise ValueError(f"kv_connector_extra_config['{PREFIX}{key}'] must be positive")
        load_mode = get("load_mode")
        if load_mode not in _LOAD_MODES:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}load_mode'] must be one of {_LOAD_MODES}, "
                             f"got {load_mode!r}")
        layer_wait = get("layer_wait")
        if layer_wait not in _LAYER_WAITS:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}layer_wait'] must be one of {_LAYER_WAITS}, "
                             f"got {layer_wait!r}")
        if load_mode == "auto":  # on a GPU the restore overlaps the layers' compute; elsewhere between steps
            load_mode = "layerwise" if _device_type(vllm_config) == "cuda" else "async"
        if get("prefill_tokens_per_s") < 0:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}prefill_tokens_per_s'] must be >= 0")
        if get("min_load_blocks") < 1:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}min_load_blocks'] must be >= 1")

        cache = vllm_config.cache_config
        groups = kv_groups(kv_cache_config)
        block_size = next((g.block_size for g in groups if g.block_size), 0) or int(cache.block_size)
        dcp = int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)
        if dcp != 1:
            raise NotImplementedError("OrbitKVConnector: decode context parallelism is not supported yet")
        hash_algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256") or "sha256")
        # vLLM hashes blocks of hash_block_size tokens (resolve_kv_cache_block_sizes): the group block size with one
        # group, prefix_match_unit (else the gcd of the group sizes, here the one size) with several.
        hash_block_size = block_size
        if len(groups) > 1:
            hash_block_size = int(getattr(cache, "prefix_match_unit", None) or getattr(cache, "hash_block_size", None)
                                  or block_size)
        if hash_block_size <= 0 or block_size % hash_block_size:
            raise NotImplementedError(f"OrbitKVConnector: vLLM's hash block size {hash_block_size} does not divide "
                                      f"the KV block size {block_size}")

        model = vllm_config.model_config
        cache_dtype = getattr(cache, "cache_dtype", "auto") or "auto"
        dtype = _dtype_name(model.dtype if cache_dtype == "auto" else cache_dtype)
        weights = _weights_identity(vllm_config, get("model_id"), get("weights_revision"))
        model_id, revision = weights.model_id, weights.revision
        download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
        tokenizer = get("tokenizer") or tokenizer_identity(
            getattr(model, "tokenizer", None), getattr(model, "tokenizer_revision", None), str(model.model), weights,
            download_dir)
        scope = get("cache_scope") or os.environ.get("ORBITKV_CACHE_SCOPE", "")
        fingerprint = get("model_fingerprint") or os.environ.get("ORBITKV_MODEL_FINGERPRINT", "")
        # What the engine computes (RoPE overrides, quantization, ...), unless the user names it.
        model_digest = b"" if fingerprint else computation.digest(vllm_config)
        if fingerprint:
            try:
                model_digest = bytes.fromhex(fingerprint)
            except ValueError:
                model_digest = b""
            if len(model_digest) != 32:
                raise ValueError(f"{PREFIX}model_fingerprint must be 64 hex digits (a SHA-256), got {fingerprint!r}")
        # The block hash algorithm and the group structure decide which bytes a key names: both are part of the
        # stored representation, so they go into the namespace.
        # Keys are OrbitKV's own chain over token ids (orbitkv.vllm.keys), not vLLM's block hashes, whose root is
        # random per process unless PYTHONHASHSEED is set: the algorithm of vLLM's hashes is not part of it.
        layout = kv_cache_layout()
        group_text = ";".join(f"{g.group}:{g.kind}:{g.window}:{len(g.layer_names)}x{g.page_bytes}" for g in groups)
        detail = f"vllm-blocks;layout={layout};keys={KEY_SCHEME};groups={group_text}"
        implementation = hashlib.sha256(f"{NAMESPACE_VERSION};keys={KEY_SCHEME}".encode()).digest()
        identity = dict(model_id=model_id, weights_revision=revision, tokenizer=tokenizer, engine_kind="vllm",
                        cache_scope=scope, model_digest=model_digest, implementation_digest=implementation,
                        dtype=dtype, layout="layer_first", layout_detail=detail, page_size_tokens=block_size)

        # Instance ids: base | rank for workers, base | 0x8000 | rank for the scheduler's query instances.
        instance = get("instance_id")
        if instance is None:
            engine_id = str(getattr(transfer, "engine_id", None) or "")
            if not engine_id:
                raise ValueError("OrbitKVConnector needs kv_transfer_config.engine_id or "
                                 f"kv_connector_extra_config['{PREFIX}instance_id']")
            base = int.from_bytes(hashlib.sha256(engine_id.encode()).digest()[:8], "little") & 0x7FFF_FFFF_FFFF_0000
        elif not 0 <= instance < 1 << 47:
            raise ValueError(f"kv_connector_extra_config['{PREFIX}instance_id'] must be in [0, 2^47)")
        else:
            base = instance << 16
        socket_path = get("socket_path") or os.environ.get("ORBITKV_SOCKET") or None
        log.info("orbitkv: weights %s, tokenizer %s", weights, tokenizer)
        load_enabled = mode != "save_only"
        if load_enabled and len(groups) > 1 and not scheduler_recovers_hybrid():
            _warn_once("hybrid", "orbitkv: loads are off for this model: it has %d KV-cache groups and this vLLM's "
                       "scheduler cannot recover from a failed load on such a model (it unpacks one group and "
                       "EngineCore exits; fixed by vLLM PR #50388). Saves continue; upgrade vLLM to load.",
                       len(groups))
            load_enabled = False
        policy = getattr(transfer, "kv_load_failure_policy", None) or "fail"
        if load_enabled and policy == "fail":
            _warn_once("policy", "orbitkv: kv_load_failure_policy is 'fail' (vLLM's default): a load OrbitKV cannot "
                       "complete (a restarted or stopped Manager, an evicted block) fails that request instead of "
                       "recomputing it. Set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config to "
                       "recompute instead.")
        return cls(socket_path=socket_path, timeout_ms=get("timeout_ms"), spin_iterations=get("spin_iterations"),
                   load_enabled=load_enabled, save_enabled=mode != "load_only",
                   instance_base=base, save_decode=get("save_decode"),
                   save_mode=save_mode,
                   require_manager=get("require_manager"), reconnect_interval_s=get("reconnect_interval_s"),
                   min_load_blocks=get("min_load_blocks"), block_size=block_size, hash_algo=hash_algo,
                   hash_block_size=hash_block_size,
                   groups=groups, identity=identity, weights=weights, weights_epoch=get("weights_epoch"),
                   load_mode=load_mode, layer_wait=layer_wait, decline_slow_hits=get("decline_slow_hits"),
                   prefill_tokens_per_s=get("prefill_tokens_per_s"))

    def namespace(self, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> bytes:
        return orbitkv.derive_namespace(**self.identity, tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size,
                                        pp_rank=pp_rank)

    def contract(self, namespace: bytes):
        rules = [(g.group, g.kind, g.window) for g in self.groups]
        return orbitkv.RecoveryContract(namespace, self.block_size, rules)

    def label(self, role: str, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> str:
        """What ``orbitkv status`` shows for an instance: the engine, its weights and how they were found, its
        rank."""
        w = self.weights
        source = f" ({w.source})" if w is not None else ""
        epoch = f", epoch {self.weights_epoch}" if self.weights_epoch else ""
        return (f"vLLM {role} {self.identity['model_id']}@{self.identity['weights_revision']}{source}{epoch}, "
                f"{self.identity['dtype']}, tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size}")

    def worker_instance(self, tp_rank: int, tp_size: int, pp_rank: int) -> int:
        return self.instance_base | (pp_rank * tp_size + tp_rank)

    def scheduler_instance(self, rank: int) -> int:
        return self.instance_base | 0x8000 | rank
