"""The computation a vLLM engine runs, from what vLLM hands the connector (``vllm_config``, as vLLM 6adad087 has it),
for the namespace's model digest (issue 59; ``orbitkv.config_digest`` makes it canonical).

Bound (each changes the KV bytes of a token sequence):
- ``model_config.hf_config`` as loaded with ``hf_overrides`` applied (vLLM's ``get_config`` updates the top-level
  config with flat overrides and ``_apply_dict_overrides`` sets dict-valued ones, e.g. ``rope_scaling``, after its
  RoPE normalisation), and ``hf_text_config`` where it is another object (multimodal models): RoPE parameters,
  attention, head and layer settings, the checkpoint's ``quantization_config``; minus paths and versions;
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

from typing import Any

from orbitkv.config_digest import computation_digest, config_dict
from orbitkv.vllm.identity import resolve_weights


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
    """The draft model's weights (a path names them as the main model's do: by hub commit or weights digest)."""
    if speculative is None:
        return None
    name = getattr(speculative, "model", None) or getattr(draft, "model", None)
    if not name:
        return None  # n-gram and other methods without a draft model
    revision = getattr(draft, "revision", None) or getattr(speculative, "revision", None)
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    found = resolve_weights(str(name), revision, download_dir)
    return str(found.model_id) + "@" + str(found.revision) if found is not None else f"{name}@{revision or ''}"


def factors(vllm_config) -> tuple[dict, dict]:
    """(the model config to bind, the other factors) of ``vllm_config``."""
    model = vllm_config.model_config
    cache = getattr(vllm_config, "cache_config", None)
    hf_config = config_dict(getattr(model, "hf_config", None))
    hf_text_object = getattr(model, "hf_text_config", None)
    hf_text = config_dict(hf_text_object) if hf_text_object is not None else None
    if hf_text_object is getattr(model, "hf_config", None):
        hf_text = None  # a text-only model: the same object
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
        "longrope_long_factors": _longrope_long_factors(model, hf_text or hf_config or {}),
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
