"""The computation a vLLM engine runs, from what vLLM hands the connector (``vllm_config``, as vLLM 6adad087 has it),
for the namespace's model digest (``orbitkv.config_digest`` makes it canonical).

Bound (each changes the KV bytes of a token sequence):
- the model config as vLLM loads it: config.json with ``hf_overrides`` applied as vLLM applies them (``get_config``
  sets flat overrides on the top level, ``_apply_dict_overrides`` merges dict ones into a nested config or sets them,
  e.g. ``rope_scaling``): RoPE parameters, attention, head and layer settings, the checkpoint's
  ``quantization_config``; minus paths and versions. Read from the file, not from ``model_config.hf_config``, which
  some models change while the worker builds them (so the scheduler's copy and the workers' would differ); with a
  callable override or no config.json, ``hf_config`` (and ``hf_text_config``) as this process holds them;
- the resolved ``model_config.dtype``, ``quantization`` (after vLLM's verification, e.g. ``gptq_marlin``) and the
  online ``quantization_config``;
- ``model_impl`` and the resolved architecture, ``override_attention_dtype``, ``use_mla`` (``VLLM_MLA_DISABLE``);
- ``cache_config.cache_dtype`` (``auto`` as the model dtype; the namespace's dtype has it too) and
  ``kv_cache_dtype_skip_layers``, ``calculate_kv_scales`` where this vLLM still has it;
- ``code_revision`` when remote code runs;
- for LongRoPE models only, whether ``max_model_len`` passes ``original_max_position_embeddings`` (vLLM then builds
  the long factors, which changes every key);
- ``attention_config.indexer_kv_dtype`` and ``use_non_causal``; the speculative method and draft model (draft
  layers share the KV cache groups).

Not bound (two engines that differ only here share blocks): the model path or download directory
(``model``, ``hf_config_path``, ``download_dir``), ``served_model_name``, ``max_model_len`` (LongRoPE aside),
``max_num_seqs``, ``gpu_memory_utilization``, ``generation_config`` and ``override_generation_config``, ``seed``,
``enforce_eager``, ``hf_overrides`` as given (its effect on ``hf_config`` is bound; a callable has no stable form).
The weights revision and the tokenizer have their own places in the namespace.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

from orbitkv.config_digest import computation_digest, config_dict
from orbitkv.vllm.identity import hub_cache_dirs, resolve_weights

log = logging.getLogger("orbitkv.vllm")


def _text(value: Any) -> Any:
    return None if value is None else str(value).replace("torch.", "")


def _longrope_long_factors(model, hf_text: dict) -> Any:
    rope = hf_text.get("rope_parameters") or hf_text.get("rope_scaling") or {}
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type")) != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or hf_text.get("original_max_position_embeddings")
    length = getattr(model, "original_max_model_len", None) or getattr(model, "max_model_len", None)
    if original is None or length is None:
        return None
    return bool(int(length) > int(original))


def _draft_identity(vllm_config, speculative, draft) -> Any:
    """The draft model's weights (a path names them as the main model's do: by hub commit or weights digest), its
    quantization and KV dtype. None without a draft model (n-gram and suffix decoding add no KV)."""
    if speculative is None or draft is None:
        return None
    name = str(getattr(draft, "model", None) or getattr(speculative, "model", None) or "")
    revision = getattr(draft, "revision", None) or getattr(speculative, "revision", None)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    found = resolve_weights(name, revision, download_dir) if name else None
    weights = (f"{found.model_id}@{found.revision}" if found is not None
               else f"{os.path.basename(name.rstrip('/'))}@{revision or ''}")
    return {"weights": weights, "quantization": _text(getattr(draft, "quantization", None)),
            "kv_cache_dtype": _text(getattr(speculative, "kv_cache_dtype", None))}


# Top-level keys of config.json that hold a nested model config (transformers' sub_configs): vLLM's
# _apply_dict_overrides merges a dict override into these and replaces any other dict (rope_scaling, ...).
_SUB_CONFIGS = frozenset({"text_config", "vision_config", "audio_config", "speech_config", "llm_config",
                          "language_config", "thinker_config", "talker_config", "encoder_config", "decoder_config"})


def _merge(target: dict, updates: dict) -> None:
    """vLLM's ModelConfig._update_nested on plain dicts: dict values merge into existing mappings."""
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def _config_file(vllm_config) -> Optional[str]:
    """The config.json vLLM loaded the model config from: the model (or hf_config_path) directory, or the
    snapshot of the repository in the hub cache (vLLM downloaded it before the connector starts)."""
    model = vllm_config.model_config
    name = str(getattr(model, "hf_config_path", None) or model.model)
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        return path if os.path.isfile(path) else None
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    found = resolve_weights(name, getattr(model, "revision", None), download_dir)
    if found is None or found.model_id != name:
        return None
    for root in hub_cache_dirs(download_dir):
        path = os.path.join(root, "models--" + name.replace("/", "--"), "snapshots", found.revision, "config.json")
        if os.path.isfile(path):
            return path
    return None


def loaded_config(vllm_config) -> Optional[dict]:
    """The model config as vLLM loads it, from config.json with ``hf_overrides`` applied as vLLM applies them
    (flat values set on the top level, dict values merged into a nested config or set), or None where that cannot
    be had (no config.json: another format; a callable override, which needs transformers' objects).

    Read from the file rather than from ``model_config.hf_config`` because the latter is not the same in every
    process of one engine: some models change it while the worker builds them (Llama 4, MiniMax-M2, Falcon, ...),
    after the scheduler's copy was made, and a digest that differed between the scheduler and the workers would
    never hit. The file also does not depend on the installed transformers' defaults."""
    model = vllm_config.model_config
    overrides = getattr(model, "hf_overrides", None) or {}
    if callable(overrides):
        return None
    path = _config_file(vllm_config)
    if path is None:
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for key, value in overrides.items():
        current = config.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and (key in _SUB_CONFIGS or "model_type" in current):
            _merge(current, value)
        else:
            config[key] = value
    return config


def factors(vllm_config) -> tuple[dict, dict]:
    """(the model config to bind, the other factors) of ``vllm_config``."""
    model = vllm_config.model_config
    cache = getattr(vllm_config, "cache_config", None)
    hf_config = loaded_config(vllm_config)
    hf_text = None
    if hf_config is None:  # what this process holds (a callable override, or no config.json)
        log.warning("orbitkv: the namespace binds the model config this process holds (%s): models that change it "
                    "while they are built may then get no hits across processes; set orbitkv.model_fingerprint to "
                    "pin the computation", "a callable hf_overrides" if callable(getattr(model, "hf_overrides", None))
                    else "no config.json found")
        hf_config = config_dict(getattr(model, "hf_config", None))
        hf_text_object = getattr(model, "hf_text_config", None)
        if hf_text_object is not None and hf_text_object is not getattr(model, "hf_config", None):
            hf_text = config_dict(hf_text_object)  # a multimodal model's language config
    try:
        use_mla = bool(getattr(model, "use_mla", False))
    except Exception:  # noqa: BLE001 - a property that needs more of vLLM than this process has
        use_mla = None
    cache_dtype = str(getattr(cache, "cache_dtype", "auto") or "auto") if cache is not None else "auto"
    attention = getattr(vllm_config, "attention_config", None)
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None) if speculative is not None else None
    out = {
        "hf_text_config": hf_text,
        "dtype": _text(getattr(model, "dtype", None)),
        "quantization": _text(getattr(model, "quantization", None)),
        "quantization_config": config_dict(getattr(model, "quantization_config", None)),
        "model_impl": _text(getattr(model, "model_impl", None)),
        "architecture": _text(getattr(model, "architecture", None)),
        "override_attention_dtype": _text(getattr(model, "override_attention_dtype", None)),
        "use_mla": use_mla,
        "cache_dtype": _text(getattr(model, "dtype", None)) if cache_dtype == "auto" else cache_dtype,
        "kv_cache_dtype_skip_layers": list(getattr(cache, "kv_cache_dtype_skip_layers", None) or []) or None,
        "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None) or None,
        "code_revision": _text(getattr(model, "code_revision", None))
        if getattr(model, "trust_remote_code", False) else None,
        "longrope_long_factors": _longrope_long_factors(
            model, hf_text or (hf_config or {}).get("text_config") or hf_config or {}),
        "indexer_kv_dtype": _text(getattr(attention, "indexer_kv_dtype", None)) if attention is not None else None,
        "use_non_causal": getattr(attention, "use_non_causal", None) or None if attention is not None else None,
        "speculative_method": _text(getattr(speculative, "method", None)) if speculative is not None else None,
        "speculative_draft": _draft_identity(vllm_config, speculative, draft),
    }
    return hf_config, out


def digest(vllm_config) -> bytes:
    """The 32-byte model digest of the computation ``vllm_config`` describes."""
    model_config, other = factors(vllm_config)
    return computation_digest(model_config, other)
