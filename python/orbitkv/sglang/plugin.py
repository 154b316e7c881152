"""SGLang plugin: registers the ``orbitkv`` radix-cache backend, a UnifiedRadixCache wired to OrbitKVLinker.

SGLang runs ``register()`` of every ``sglang.srt.plugins`` entry point (filtered by ``SGLANG_PLUGINS``) in the
launcher and in each scheduler process; a package that ships OrbitKV declares

    [project.entry-points."sglang.srt.plugins"]
    orbitkv = "orbitkv.sglang.plugin:register"

Then ``--radix-cache-backend orbitkv --enable-unified-cache-external-linker`` builds the cache below. This path
uses SGLang internals that change between releases (the radix-cache registry landed in PR #25101, the linker in
#37381); an SGLang without them gets a clear error here, and docs/sglang.md says which flags need which version.
The stable path for SGLang with a host tier is the HiCache storage backend (:class:`OrbitKVStorage`).

The linker reads its settings (socket, model_id, cache_scope...) from the JSON in ``ORBITKV_SGLANG_LINKER_CONFIG``,
else from ``--hicache-storage-backend-extra-config``.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("orbitkv.sglang")

__all__ = ["register", "create_cache", "BACKEND_NAME"]

BACKEND_NAME = "orbitkv"


def register() -> bool:
    """Registers the backend with SGLang's radix-cache registry; False (and a log line) when this SGLang has none."""
    try:
        from sglang.srt.mem_cache.registry import (  # type: ignore[import-not-found]
            register_radix_cache_backend,
            registered_radix_cache_backends,
        )
    except ImportError as e:
        logger.warning("OrbitKV: this SGLang has no radix-cache backend registry (%s); the orbitkv linker needs "
                       "an SGLang with --radix-cache-backend (PR #25101) and the external linker (PR #37381)", e)
        return False
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_cache)
    return True


def _linker_config(server_args) -> dict:
    text = os.environ.get("ORBITKV_SGLANG_LINKER_CONFIG")
    source = "ORBITKV_SGLANG_LINKER_CONFIG"
    if text is None:
        text = getattr(server_args, "hicache_storage_backend_extra_config", None)
        source = "--hicache-storage-backend-extra-config"
    if not text:
        return {}
    if isinstance(text, dict):
        return dict(text)
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"OrbitKV: {source} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"OrbitKV: {source} must be a JSON object")
    return config


def create_cache(ctx):
    """The radix-cache factory SGLang calls with its TreeCacheBuildContext."""
    if ctx.disable_radix_cache:
        raise ValueError("--radix-cache-backend orbitkv needs the radix cache; drop --disable-radix-cache")
    if ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend orbitkv replaces the host tier; for HiCache use "
                         "--hicache-storage-backend dynamic with orbitkv.sglang.OrbitKVStorage instead")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or getattr(ctx, "is_dsa", False):
        raise ValueError("OrbitKVLinker supports full-attention models only (no SWA, Mamba or DSA yet)")
    from sglang.srt.mem_cache.unified_cache.components import ComponentType  # type: ignore[import-not-found]
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # type: ignore[import-not-found]

    from orbitkv.sglang.linker import OrbitKVLinker

    params = ctx.params
    params.tree_components = (ComponentType.FULL,)
    cache = UnifiedRadixCache(params)
    linker = OrbitKVLinker(ctx.server_args, params, components=set(cache.components),
                           extra_config=_linker_config(ctx.server_args))
    cache.init_cache_linker(linker)
    counter = linker.layer_done_counter
    params.token_to_kv_pool_allocator.get_kvcache().register_layer_transfer_counter(counter)
    ctx.tp_worker.register_hicache_layer_transfer_counter(counter)
    return cache
