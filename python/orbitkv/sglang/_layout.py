"""How an SGLang KV pool maps onto OrbitKV group buffers.

OrbitKV copies a block as the concatenation of one fragment per registered buffer, each buffer indexed by page.
An SGLang page of ``page_size`` tokens becomes one block:

- ``page_first`` (MHA K/V ``(S, L, H, D)``, MLA ``(S, L, 1, C)``) and ``page_first_direct`` / ``page_head``
  (``(N, ...)`` with the page first): one contiguous blob per buffer, so a block is [K blob][V blob] (MHA) or the
  one MLA blob. Pages are views of the pool, nothing is copied.
- ``layer_first`` (``(L, S, ...)``): every layer of every buffer is its own paged view, so a block is
  [K layer 0]..[K layer L-1][V layer 0]..[V layer L-1] (MHA) or the L MLA layers.

In every layout that order equals SGLang's flat page (``get_data_page(flat=True)``), so the legacy generic calls
store the same bytes as the zero-copy ones. The bytes still depend on the layout, which is why the layout and
shapes are part of the namespace (``detail``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from orbitkv import client as _client

__all__ = ["PoolGeometry", "describe_host_pool", "describe_device_pool", "dtype_name", "orbitkv_layout"]

_DTYPES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
}
_KV_CACHE_DTYPES = {  # SGLang --kv-cache-dtype spellings, and ours
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "fp8": "fp8_e4m3",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "int8": "int8",
    "uint8": "uint8",
}
_PAGED_FIRST = ("page_first_direct", "page_head")  # (N, ...): the page is the first axis
SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")


@dataclass(frozen=True)
class PoolGeometry:
    """A pool as OrbitKV sees it. ``buffers`` are ``[num_pages, ...]`` views whose rows are contiguous pages."""

    layout: str  # SGLang's layout name
    page_tokens: int
    num_pages: int
    buffers: tuple
    block_bytes: int
    dtype: str  # OrbitKV dtype name
    state_layout: str  # OrbitKV StateFormat layout
    detail: str  # everything else the bytes depend on (shapes, layer range, pool label)
    is_mla: bool


def dtype_name(torch_dtype) -> str:
    name = str(torch_dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"OrbitKV cannot store a KV pool of dtype {name}")
    return _DTYPES[name]


def orbitkv_layout(sglang_layout: str, is_mla: bool) -> str:
    if is_mla:
        return "mla"
    return {"layer_first": "layer_first", "page_first": "page_first", "page_first_direct": "page_first_direct",
            "page_head": "page_first"}[sglang_layout]


def _resolve_dtype(tensors: Sequence, kv_cache_dtype: Optional[str], require_real: bool = True) -> str:
    pool_dtype = dtype_name(tensors[0].dtype)
    if any(dtype_name(t.dtype) != pool_dtype for t in tensors):
        raise ValueError("the KV buffers of one pool have different dtypes")
    if kv_cache_dtype is None:
        if pool_dtype == "uint8" and require_real:
            # SGLang keeps an fp8 KV cache in uint8 storage: without the real dtype, e4m3 and e5m2 runs would share
            # keys and read each other's bytes (sgl-project/sglang#33268).
            raise ValueError("the host KV pool stores uint8 (SGLang's storage for fp8 KV caches) and the server's "
                             "--kv-cache-dtype does not say which fp8 (it is auto, or unreadable here): pass "
                             "--kv-cache-dtype fp8_e4m3 or fp8_e5m2, or set \"kv_cache_dtype\" in "
                             "--hicache-storage-backend-extra-config")
        return pool_dtype
    wanted = _KV_CACHE_DTYPES.get(str(kv_cache_dtype).lower())
    if wanted is None:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {sorted(_KV_CACHE_DTYPES)}")
    itemsize = {"fp32": 4, "fp16": 2, "bf16": 2}.get(wanted, 1)
    if itemsize != tensors[0].element_size():
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} does not match the pool's {pool_dtype} elements")
    return wanted


def _shape_signature(tensor, paged_axis: int) -> str:
    dims = [str(d) for d in tensor.shape]
    dims[paged_axis] = "*"
    return "x".join(dims)


def _registrable(views: list, what: str) -> list:
    """``views`` if ``CacheManagerClient.register_group`` can take their memory: any CPU memory (OrbitKV shared
    memory, or ordinary memory registered as this process's); memory on another device only once the client
    registers it (the GPU path). Otherwise a clear NotImplementedError."""
    device = views[0].device.type if views else "cpu"
    probe = getattr(_client, "_layout", None)  # what register_group runs on every buffer
    if device == "cpu" or probe is None:
        return views
    try:
        probe(views[0])
    except Exception as error:  # noqa: BLE001 - any refusal means this device cannot be registered
        raise NotImplementedError(
            f"OrbitKV: the SGLang {what} is on {device}, which this OrbitKV client cannot register yet ({error}). "
            "GPU pools need the OrbitKV GPU path (CUDA IPC registration); CPU pools work, in ordinary (pinned) "
            "memory or in orbitkv.shm") from None
    return views


def _page_rowed(tensor, layout: str, num_pages: int, page_tokens: int) -> bool:
    """Whether a side pool's buffer has one row per page rather than per token along its paged axis: SGLang's DSA
    indexer host pool (``index_k_with_scale_buffer``, (pages, layers, 1, stride) in page_first and
    page_first_direct, (layers, pages, stride) in layer_first; mem_cache/pool_host/dsa.py at db570fe6)."""
    axis = 1 if layout == "layer_first" else 0
    if layout in _PAGED_FIRST or page_tokens == 1 or tensor.dim() <= axis:
        return False
    rows = int(tensor.shape[axis])
    return num_pages <= rows < num_pages * page_tokens


def _paged_views(tensor, layout: str, num_pages: int, page_tokens: int, page_rowed: bool = False) -> list:
    """[num_pages, page_elements] views of one pool buffer, in block fragment order."""
    if not tensor.is_contiguous():
        raise ValueError(f"a {layout} KV buffer must be contiguous, got strides {tuple(tensor.stride())}")
    if page_rowed:
        if layout == "layer_first":
            return _registrable([tensor[layer, :num_pages].reshape(num_pages, -1) for layer in range(tensor.shape[0])],
                                "host side pool")
        return _registrable([tensor[:num_pages].reshape(num_pages, -1)], "host side pool")
    if layout in _PAGED_FIRST:
        if tensor.shape[0] < num_pages:
            raise ValueError(f"a {layout} buffer of {tensor.shape[0]} pages is smaller than the pool's {num_pages}")
        return _registrable([tensor[:num_pages].view(num_pages, -1)], "host KV pool")
    tokens = num_pages * page_tokens
    if layout == "page_first":
        if tensor.shape[0] < tokens:
            raise ValueError(f"a page_first buffer of {tensor.shape[0]} tokens is smaller than the pool's {tokens}")
        return _registrable([tensor[:tokens].view(num_pages, -1)], "host KV pool")
    if layout == "layer_first":
        if tensor.dim() < 2 or tensor.shape[1] < tokens:
            raise ValueError(f"a layer_first buffer of shape {tuple(tensor.shape)} holds fewer than {tokens} tokens")
        return _registrable([tensor[layer, :tokens].view(num_pages, -1) for layer in range(tensor.shape[0])],
                            "host KV pool")
    raise ValueError(f"OrbitKV does not support the SGLang host layout {layout!r}; use one of "
                     f"{', '.join(SUPPORTED_LAYOUTS)} (page_first_direct or page_first recommended)")


def host_pool_group_anchor(pool):
    """The anchor entry's host pool when ``pool`` is a ``HostPoolGroup`` (hybrid models on the UnifiedRadixCache
    path), else None."""
    anchor = getattr(pool, "anchor_entry", None)
    if anchor is None and getattr(pool, "entries", None) is not None and hasattr(pool, "get_pool"):
        entries = list(pool.entries)
        anchor = next((e for e in entries if getattr(e, "is_primary_index_anchor", False)), entries[0] if entries
                      else None)
    return getattr(anchor, "host_pool", None) if anchor is not None else None


# Dimensions of one K (or V) buffer per layout; MHA host pools keep K and V stacked in one (2, ...) kv_buffer.
_HALF_DIMS = {"page_first": 4, "layer_first": 4, "page_first_direct": 5, "page_head": 5}


def _pool_tensors(pool, layout: str, is_mla: bool) -> Optional[list]:
    """The pool's buffers in block fragment order: K then V for MHA, the one latent buffer for MLA."""
    if hasattr(pool, "get_hybrid_pool_buffer"):
        return list(pool.get_hybrid_pool_buffer() or [])
    kv = getattr(pool, "kv_buffer", None)
    if kv is None:
        return None
    if not is_mla and kv.dim() == _HALF_DIMS.get(layout, -1) + 1 and kv.shape[0] == 2:
        return [kv[0], kv[1]]  # the stacked MHA buffer: K half, V half
    return [kv]


def describe_host_pool(pool, *, is_mla: bool, kv_cache_dtype: Optional[str] = None,
                       label: str = "kv") -> Optional[PoolGeometry]:
    """The geometry of an SGLang host pool (``HostKVCache``), or None for a logical anchor with no buffer."""
    anchor = host_pool_group_anchor(pool)
    if anchor is not None:
        pool = anchor
    layout = getattr(pool, "layout", "layer_first")
    page_tokens = int(getattr(pool, "page_size", 1) or 1)
    if page_tokens <= 0:
        raise ValueError(f"page_size must be positive, got {page_tokens}")
    num_pages = int(getattr(pool, "page_num", 0) or pool.size // page_tokens)
    tensors = _pool_tensors(pool, layout, is_mla and label == "kv")
    if tensors is None or len(tensors) == 0 or any(t is None for t in tensors):
        return None
    tensors = list(tensors)
    # Side pools (Mamba state, indexer keys) keep whatever storage SGLang gives them; their label and shapes are in
    # the namespace, and only the KV pool's uint8 needs the real fp8 dtype. A side pool may mix dtypes (SGLang's
    # MambaPoolHost: a float32 temporal buffer beside bf16 conv buffers): its blocks are bytes, and every buffer's
    # dtype goes into the namespace's detail.
    mixed = label != "kv" and len({dtype_name(t.dtype) for t in tensors}) > 1
    dtype = dtype_name(tensors[0].dtype) if mixed else \
        _resolve_dtype(tensors, kv_cache_dtype if label == "kv" else None, require_real=label == "kv")
    buffers = []
    for tensor in tensors:
        rowed = label != "kv" and _page_rowed(tensor, layout, num_pages, page_tokens)
        buffers.extend(_paged_views(tensor, layout, num_pages, page_tokens, rowed))
    block_bytes = sum(b[0].numel() * b.element_size() for b in buffers)
    paged_axis = 1 if layout == "layer_first" else 0
    shapes = ",".join(_shape_signature(t, paged_axis) + (f":{dtype_name(t.dtype)}" if mixed else "") for t in tensors)
    layers = ""
    if getattr(pool, "start_layer", None) is not None and getattr(pool, "end_layer", None) is not None:
        layers = f"/layers{pool.start_layer}-{pool.end_layer}"
    detail = f"sglang-host/{label}/{layout}/{'mla' if is_mla else 'mha'}/{shapes}{layers}"
    return PoolGeometry(layout, page_tokens, num_pages, tuple(buffers), block_bytes, dtype,
                        orbitkv_layout(layout, is_mla) if label == "kv" else "layer_first", detail, is_mla)


def describe_device_pool(kvcache, page_tokens: int, *, is_mla: bool,
                         kv_cache_dtype: Optional[str] = None) -> PoolGeometry:
    """The geometry of an SGLang device KV pool (per-layer ``k_buffer``/``v_buffer`` lists of ``[slots, H, D]``, or
    ``kv_buffer`` for MLA): a block is one page of every layer, K layers then V layers."""
    if is_mla:
        layers = list(getattr(kvcache, "kv_buffer", None) or kvcache.k_buffer)
    else:
        layers = list(kvcache.k_buffer) + list(kvcache.v_buffer)
    if not layers:
        raise ValueError("the device KV pool has no layer buffers")
    dtype = _resolve_dtype(layers, kv_cache_dtype)
    num_pages = min(int(t.shape[0]) for t in layers) // page_tokens
    if num_pages == 0:
        raise ValueError(f"the device KV pool holds fewer than one {page_tokens}-token page")
    buffers = []
    for tensor in layers:
        if not tensor.is_contiguous():
            raise ValueError("a device KV layer buffer must be contiguous")
        buffers.extend(_registrable([tensor[: num_pages * page_tokens].view(num_pages, -1)], "device KV pool"))
    block_bytes = sum(b[0].numel() * b.element_size() for b in buffers)
    shapes = "x".join(str(d) for d in layers[0].shape[1:])
    detail = f"sglang-device/{'mla' if is_mla else 'mha'}/{len(layers)}x[*x{shapes}]"
    return PoolGeometry("layer_first", page_tokens, num_pages, tuple(buffers), block_bytes, dtype,
                        "mla" if is_mla else "layer_first", detail, is_mla)
