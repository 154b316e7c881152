"""What an engine computes, as a digest for the namespace: two engines whose KV bytes for the same tokens
can differ never share blocks; engines that differ only in where the weights are mounted, memory and scheduling
limits or sampling defaults still do.

The model config (a transformers ``PretrainedConfig`` as the engine loaded it, overrides applied) is serialised in
full, minus what names a path, a library version or a runtime switch that does not change the bytes, with the RoPE
keys of transformers 4 and 5 put into one form (``rope_parameters``). Everything else an engine contributes is a flat
mapping of named factors. The digest is SHA-256 over the canonical JSON of both, under a version tag.

The engine adapters (``orbitkv.vllm.computation``, ``orbitkv.sglang._identity``) decide which factors exist; this
module only makes them canonical.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from typing import Any, Optional

DIGEST_VERSION = "orbitkv.computation.v1"

# Keys of a model config that do not change the KV bytes of a token sequence: where the config came from, which
# transformers wrote it, runtime switches, task heads and generation defaults (transformers 4 kept those in the
# model config; vLLM and SGLang read them from the generation config, which sampling alone uses).
IGNORED_CONFIG_KEYS = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "_attn_implementation",
    "_attn_implementation_autoset", "_attn_implementation_internal", "_experts_implementation",
    "_experts_implementation_internal", "_auto_class", "auto_map", "_is_quantized", "_pre_quantization_dtype",
    "transformers_weights", "base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan", "distributed_config",
    "ignore_keys_at_rope_validation", "output_attentions", "_output_attentions", "output_hidden_states",
    "return_dict", "use_cache", "torchscript", "id2label", "label2id", "problem_type", "num_labels",
    "chunk_size_feed_forward", "torch_dtype", "dtype", "tf_legacy_loss", "use_bfloat16", "pruned_heads",
    # generation defaults that name nothing else (not top_k or max_length: some architectures use those names)
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty",
})


def config_dict(config: Any) -> Optional[dict]:
    """A model config as a plain dict: ``to_dict()`` (transformers), a dict as is, else the object's attributes."""
    if config is None:
        return None
    if isinstance(config, dict):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    return {k: v for k, v in vars(config).items() if not callable(v)}


def _canonical(value: Any) -> Any:
    """A JSON value of `value`, the same in every process: a nested model config (a dict with a ``model_type``,
    e.g. ``text_config``) as ``canonical_config`` makes it, other mappings with their keys sorted, sets sorted,
    enums by value, dataclasses and objects by their fields. A value with no stable form (a function, an object
    whose text names its address) raises: a digest that differed between the engine's processes would never hit."""
    if isinstance(value, dict):
        if "model_type" in value:
            return canonical_config(value)
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda item: str(item[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return {"__float__": repr(value)}
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if hasattr(value, "to_dict"):
        return _canonical(config_dict(value))
    text = str(value)
    if text.startswith("torch."):
        return text[len("torch."):]  # a dtype
    if callable(value) or " at 0x" in text:
        raise ValueError(f"OrbitKV: a model config value of type {type(value).__name__} has no stable form ({text!r})")
    if hasattr(value, "__dict__"):
        return _canonical({k: v for k, v in vars(value).items() if not k.startswith("_")})
    return text


def _fold(rope: dict, key: str, value: Any, out: dict, name: str) -> None:
    """Puts `value` into the RoPE mapping under `key` when it is absent there or equal; a different value stays
    beside it under `name` (a model may read either: both are bound)."""
    if key not in rope or rope[key] == value:
        rope[key] = value
    else:
        out[name] = value


def canonical_config(config: dict) -> dict:
    """`config` without the ignored keys, recursively, with RoPE in one form: transformers 4's ``rope_scaling`` and
    ``rope_theta`` and transformers 5's ``rope_parameters`` (``rope_scaling`` is its alias there) become one
    ``rope_parameters`` mapping with ``rope_type`` (legacy ``type``) and ``rope_theta`` inside."""
    out = {k: v for k, v in config.items() if k not in IGNORED_CONFIG_KEYS}
    rope = out.pop("rope_parameters", None)
    legacy = out.pop("rope_scaling", None)
    rope = dict(rope) if isinstance(rope, dict) else {}
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    if isinstance(legacy, dict):
        legacy = dict(legacy)
        if "type" in legacy and "rope_type" not in legacy:
            legacy["rope_type"] = legacy.pop("type")
        for k, v in legacy.items():
            _fold(rope, k, v, out, "rope_scaling." + k)
    if "rope_theta" in out:
        _fold(rope, "rope_theta", out.pop("rope_theta"), out, "rope_theta")
    if rope:
        out["rope_parameters"] = rope
    return {k: _canonical(v) for k, v in sorted(out.items())}


def computation_digest(model_config: Optional[dict], factors: dict) -> bytes:
    """SHA-256 of the canonical model config and the engine's factors (``None`` values left out)."""
    document = {
        "version": DIGEST_VERSION,
        "model_config": canonical_config(model_config) if model_config is not None else None,
        "factors": {k: _canonical(v) for k, v in sorted(factors.items()) if v is not None},
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).digest()
