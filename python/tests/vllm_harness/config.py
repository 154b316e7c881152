"""vLLM's configuration objects, reduced to the fields the scheduler, the model runner and a KV connector read.

Field names and meanings follow ``vllm/config/*.py`` and ``vllm/v1/kv_cache_interface.py`` (see
../shared/docs/reference/vllm_connector.md); anything a connector could read that vLLM sets is set here too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


def hub_cache() -> str:
    """huggingface_hub's cache directory (HF_HUB_CACHE, else $HF_HOME/hub)."""
    env = os.environ.get("HF_HUB_CACHE")
    if env:
        return env
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def hub_fetch(repo: str, revision: Optional[str], commit: Optional[str] = None) -> str:
    """What ``get_config`` leaves in the hub cache when vLLM resolves ``repo``: refs/<revision or main> naming a
    commit and that snapshot's config.json. The commit is derived from the repository name unless given (a
    published repository has one commit per revision). Returns the snapshot directory."""
    ref = revision or "main"
    commit = commit or hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
    base = os.path.join(hub_cache(), "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(base, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    if len(ref) != 40:
        with open(os.path.join(base, "refs", ref), "w") as f:
            f.write(commit)
    config = os.path.join(snapshot, "config.json")
    if not os.path.exists(config):
        with open(config, "w") as f:
            f.write('{"architectures": ["OrbitKVTestModel"]}')
    return snapshot


TRANSFORMERS_VERSION = "5.17.0"  # what the GPU machine's image has; written into every to_dict()


class PretrainedConfig:
    """transformers 5's ``PreTrainedConfig``, reduced to what vLLM and a connector touch: attributes from
    config.json, ``_name_or_path`` (where it was loaded from), ``update()``, ``get_text_config()``, ``to_dict()``
    (the attributes, ``model_type``, the installed ``transformers_version``; nested configs as dicts) and
    ``rope_scaling`` as an alias of ``rope_parameters`` (legacy ``rope_scaling``/``rope_theta`` in config.json are
    converted at load)."""

    def __init__(self, name_or_path: str = "", **kwargs):
        self._name_or_path = name_or_path
        self._commit_hash = kwargs.pop("_commit_hash", None)
        legacy = kwargs.pop("rope_scaling", None)
        theta = kwargs.pop("rope_theta", None)
        rope = dict(kwargs.pop("rope_parameters", None) or legacy or {})
        if theta is not None:
            rope.setdefault("rope_theta", theta)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope:
            kwargs["rope_parameters"] = rope
        text = kwargs.pop("text_config", None)
        for key, value in kwargs.items():
            setattr(self, key, value)
        if isinstance(text, dict):
            self.text_config = PretrainedConfig(name_or_path, **text)

    def __setattr__(self, key, value):
        if key == "rope_scaling":  # the v5 alias
            key = "rope_parameters"
        object.__setattr__(self, key, value)

    @property
    def rope_scaling(self):
        return getattr(self, "rope_parameters", None)

    def update(self, values: dict) -> None:
        for key, value in values.items():
            setattr(self, key, value)

    def get_text_config(self):
        return getattr(self, "text_config", self)

    def to_dict(self) -> dict:
        out = {}
        for key, value in self.__dict__.items():
            out[key] = value.to_dict() if isinstance(value, PretrainedConfig) else copy.deepcopy(value)
            if isinstance(value, PretrainedConfig):
                out[key].pop("transformers_version", None)
        out.setdefault("model_type", "")
        out["transformers_version"] = TRANSFORMERS_VERSION
        return out


def _load_hf_config(path: str) -> PretrainedConfig:
    """config.json of a model directory; an empty config where there is none (vLLM reads params.json and other
    formats the harness does not model: the connector must still decide from what it is given)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return PretrainedConfig(path)
    with open(file) as f:
        values = json.load(f)
    return PretrainedConfig(path, **values)


def _update_nested(target, updates: dict) -> None:
    """``ModelConfig._update_nested``: dict values merge recursively into existing configs and dicts."""
    for key, value in updates.items():
        if isinstance(value, dict):
            nested = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
            if nested is not None and (isinstance(nested, dict) or hasattr(nested, "__dict__")):
                _update_nested(nested, value)
                continue
        if isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


@dataclass
class ModelConfig:
    """``vllm/config/model.py`` at 6adad087: ``model`` is a repository id or a local path; ``revision`` is None
    unless the user passes ``--revision``; ``tokenizer_revision`` defaults to ``revision``. Constructing it fetches
    the model's config from the hub into the local hub cache (a repository id) as vLLM's ``get_config`` does and
    loads it as ``hf_config``: ``hf_overrides`` applied as vLLM applies them (a callable on the config; flat values
    by ``config.update`` on the top-level config inside ``get_config``; dict values after it by
    ``_apply_dict_overrides``: a nested config updated in place, anything else set on the top level, e.g.
    ``{"rope_scaling": {...}}``), the checkpoint's ``quantization_config`` detected into ``quantization`` when none
    is given (``_verify_quantization``), ``hf_text_config = hf_config.get_text_config()``. There are no
    ``rope_scaling``/``rope_theta`` fields since vLLM #28006: RoPE changes come through ``hf_overrides``."""

    model: str = "orbitkv/ref-tiny"
    tokenizer: Optional[str] = None
    revision: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    code_revision: Optional[str] = None
    trust_remote_code: bool = False
    dtype: torch.dtype = torch.bfloat16
    max_model_len: int = 32768
    is_encoder_decoder: bool = False
    served_model_name: Optional[str] = None
    hf_config_path: Optional[str] = None
    hf_overrides: Any = field(default_factory=dict)
    quantization: Optional[str] = None
    quantization_config: Optional[dict] = None
    model_impl: str = "auto"
    override_attention_dtype: Optional[str] = None
    generation_config: str = "auto"
    override_generation_config: dict = field(default_factory=dict)
    seed: int = 0
    enforce_eager: bool = False

    def __post_init__(self):
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.tokenizer_revision is None:
            self.tokenizer_revision = self.revision
        if self.served_model_name is None:
            self.served_model_name = self.model
        source = self.hf_config_path or self.model
        if not os.path.exists(source):
            source = hub_fetch(source, self.revision)
        self.original_max_model_len = self.max_model_len
        flat, nested, fn = {}, {}, None
        if callable(self.hf_overrides):
            fn = self.hf_overrides
        else:
            for key, value in (self.hf_overrides or {}).items():
                (nested if isinstance(value, dict) else flat)[key] = value
        config = _load_hf_config(source)
        config.update(flat)  # get_config: config.update(hf_overrides_kw)
        if fn is not None:
            config = fn(config)
        for key, value in nested.items():  # ModelConfig._apply_dict_overrides, after get_config
            current = getattr(config, key, None)
            if isinstance(current, PretrainedConfig):
                _update_nested(current, value)
            else:
                setattr(config, key, value)
        self.hf_config = config
        self.hf_text_config = config.get_text_config()
        if self.quantization is None:
            checkpoint = getattr(config, "quantization_config", None)
            if isinstance(checkpoint, dict) and checkpoint.get("quant_method"):
                self.quantization = str(checkpoint["quant_method"])

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or [""])[0]

    @property
    def use_mla(self) -> bool:
        return bool(getattr(self.hf_text_config, "kv_lora_rank", None)) and not os.environ.get("VLLM_MLA_DISABLE")


@dataclass
class LoadConfig:
    download_dir: Optional[str] = None


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    num_gpu_blocks: Optional[int] = None
    # With several KV groups vLLM hashes blocks of prefix_match_unit tokens when it is set
    # (resolve_kv_cache_block_sizes), else of the groups' gcd block size.
    prefix_match_unit: Optional[int] = None
    # Layers whose KV stays in the model dtype under a quantized cache_dtype (vllm/config/cache.py at 6adad087;
    # calculate_kv_scales was removed there, by vLLM #49389).
    kv_cache_dtype_skip_layers: list = field(default_factory=list)
    gpu_memory_utilization: float = 0.9


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True


@dataclass
class KVTransferConfig:
    kv_connector: Optional[str] = None
    kv_connector_module_path: Optional[str] = None
    kv_role: Optional[str] = None
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_load_failure_policy: str = "fail"  # vLLM's default ("recompute" must be asked for)

    def __post_init__(self):
        if self.kv_connector is not None and self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError("kv_role must be set (kv_producer, kv_consumer or kv_both) with kv_connector")
        if self.kv_connector_module_path == "":
            raise ValueError("kv_connector_module_path must not be empty")
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError("kv_load_failure_policy must be 'fail' or 'recompute'")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class DeviceConfig:
    """vllm/config/device.py: ``device="auto"`` resolves to the platform's device type ("cuda" on a GPU)."""

    device_type: str = "cpu"


@dataclass
class CompilationConfig:
    """vllm/config/compilation.py: the CUDA-graph mode. FULL_AND_PIECEWISE (the GPU default) replays a full graph,
    without the attention layers' connector hooks, for uniform decode batches and piecewise graphs (attention
    eager, hooks called) for the rest; NONE (enforce_eager, and CPU) never replays one."""

    cudagraph_mode: str = "NONE"


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer_config: Optional[KVTransferConfig] = None
    load_config: LoadConfig = field(default_factory=LoadConfig)
    kv_events_config: Optional[KVEventsConfig] = None


# ---- KV cache interface (vllm/v1/kv_cache_interface.py) ---------------------------------------------------------


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        # K and V of block_size tokens: block_size x heads x 2 x head_size elements.
        return self.block_size * self.num_kv_heads * 2 * self.head_size * _dtype_size(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 0


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: FullAttentionSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list
    kv_cache_groups: list


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs:
    """One group of layers of one attention type whose pages differ in size (``kv_cache_interface.py``): worker
    configs carry it; ``generate_scheduler_kv_cache_config`` gives the scheduler the first layer's spec instead."""

    block_size: int
    kv_cache_specs: dict  # layer name -> spec

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())
