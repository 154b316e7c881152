"""What an engine computes, as a digest for the namespace (issue 59): two engines whose KV bytes for the same tokens
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
    # generation defaults
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
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
    """A JSON value of `value`: a nested model config (a dict with a ``model_type``, e.g. ``text_config``) as
    ``canonical_config`` makes it, other mappings with their keys sorted."""
    if isinstance(value, dict):
        if "model_type" in value:
            return canonical_config(value)
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda item: str(item[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return {"__float__": repr(value)}
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    nested = config_dict(value) if hasattr(value, "to_dict") else None
    if nested is not None:
        return _canonical(nested)
    return str(value).replace("torch.", "")  # a dtype, an enum


def canonical_config(config: dict) -> dict:
    """`config` without the ignored keys, recursively, with RoPE in one form: transformers 4's ``rope_scaling`` and
    ``rope_theta`` and transformers 5's ``rope_parameters`` (``rope_scaling`` is its alias there) become one
    ``rope_parameters`` mapping with ``rope_type`` (legacy ``type``) and ``rope_theta`` inside."""
    out = {k: v for k, v in config.items() if k not in IGNORED_CONFIG_KEYS}
    rope = out.pop("rope_parameters", None)
    legacy = out.pop("rope_scaling", None)
    rope = dict(rope) if isinstance(rope, dict) else {}
    if isinstance(legacy, dict):
        for k, v in legacy.items():
            rope.setdefault(k, v)
    if "rope_theta" in out:
        rope.setdefault("rope_theta", out.pop("rope_theta"))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
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
