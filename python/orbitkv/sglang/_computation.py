"""The computation an SGLang server runs, for the namespace's model digest of the HiCache backend and the linker
(``orbitkv.config_digest`` makes it canonical).

Neither is handed SGLang's ``ModelConfig``: ``HiCacheStorageConfig`` carries ranks, ``is_mla_model`` and the served
model name only. Both read the process's ``ServerArgs`` (``get_global_server_args``), whose fields decide what
``ModelConfig.from_server_args`` loads. Bound (each changes the KV bytes of a token sequence):
``json_model_override_args`` (applied to the loaded ``hf_config``: RoPE scaling, attention settings; in the
canonical form, so transformers 4 and 5 spellings of RoPE agree), ``dtype``, ``quantization``, ``modelopt_quant``,
``kv_cache_dtype``, ``quantization_param_path`` (the FP8 KV scales: its content, not its path) and ``model_impl``.
Not bound: ``model_path`` and ``served_model_name`` (the namespace's model id and weights revision name the weights),
``context_length``, memory and scheduling options, sampling defaults. Without ServerArgs (SGLang absent) the digest
is that of SGLang's defaults.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Any, Optional

from orbitkv.config_digest import computation_digest
from orbitkv.sglang._compat import HAVE_SGLANG, server_args

log = logging.getLogger("orbitkv.sglang")


def _overrides(args: Any) -> Optional[dict]:
    raw = getattr(args, "json_model_override_args", None)
    if not raw:
        return None
    if isinstance(raw, dict):
        return dict(raw) or None
    try:
        parsed = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"OrbitKV: SGLang's --json-model-override-args is not JSON ({e}): {raw!r}") from None
    return parsed or None


def _file_digest(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "path:" + os.path.basename(str(path))  # unreadable here: at least which file


def factors(args: Any) -> tuple[Optional[dict], dict]:
    """(the model-config overrides, the other factors) of SGLang's ServerArgs ``args``."""
    # Without ServerArgs (None has none of these attributes) every factor is SGLang's default.
    get = functools.partial(getattr, args)
    return _overrides(args), {
        "dtype": str(get("dtype", "auto") or "auto"),
        "quantization": get("quantization", None),
        "modelopt_quant": get("modelopt_quant", None),
        "kv_cache_dtype": str(get("kv_cache_dtype", "auto") or "auto"),
        "quantization_param_path": _file_digest(get("quantization_param_path", None)),
        "model_impl": str(get("model_impl", "auto") or "auto"),
    }


def digest(args: Any = None) -> bytes:
    """The 32-byte model digest of the SGLang server in this process (``args``: its ServerArgs, by default
    ``get_global_server_args()``). Where SGLang runs but its ServerArgs cannot be had, a digest of its own that no
    known configuration has (with a warning): a server with overrides must never share with a default one."""
    if args is None:
        args = server_args()
    if args is None and HAVE_SGLANG:
        log.warning("orbitkv: SGLang's ServerArgs are not available in this process (get_global_server_args): "
                    "pages are stored under an 'unknown computation' namespace, shared only with other servers in "
                    "the same state")
        return computation_digest(None, {"server_args": "unknown"})
    model_config, other = factors(args)
    return computation_digest(model_config, other)
