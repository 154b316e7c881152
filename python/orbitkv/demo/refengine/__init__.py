"""A reference paged-attention engine: a small Llama-architecture transformer in plain PyTorch.

It exists so OrbitKV can prove, on real attention math, that restored KV gives exactly the output of recomputation. It
is driven vLLM-style (block tables, chained block hashes, per-layer KV tensors) by the vLLM connector harness and
SGLang-style (64-token pages, SHA-256 page hashes, page_first host pools) by the SGLang adapter tests.
Random weights from a fixed seed; CPU (torch 1.13) and CUDA. The package itself never uses ``orbitkv._native``
(though importing it runs ``orbitkv/__init__.py``, which loads that extension).

Model (``ModelConfig``, ``preset``)
    ``ModelConfig(num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size,
    rope_theta=10000.0, rms_norm_eps=1e-6, dtype="float32", block_size=16, sliding_window=None, qk_norm=False,
    seed=0, name="custom")`` is a frozen dataclass. ``dtype`` is a string ("float32", "bfloat16", "float16"; the
    torch dtype is ``config.torch_dtype``). ``sliding_window`` is None (all layers full attention) or a tuple with
    one entry per layer: None for a full layer, W for a sliding-window layer whose query at position p attends
    positions p-W+1 .. p (W tokens, itself included; vLLM's convention). ``config.fingerprint()`` is a short
    string naming every field that changes the KV bytes (use it in StateKey namespaces).
    ``preset(name, **overrides)``: "tiny" (2 layers, CI speed), "tiny_hybrid" (4 layers, SWA W=32 on layers 0
    and 2), "small" (4 layers, hidden 256: CPU benchmarks), "medium" (8 layers, hidden 1024), "qwen3_8b_shaped"
    (36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 12288, vocab 151936, rope 1e6,
    q/k RMSNorm, bf16; ~8.2e9 parameters, so CUDA only). ``PRESETS`` lists them.
    Architecture per layer: RMSNorm -> fused QKV projection -> (optional per-head q/k RMSNorm) -> RoPE (rotate-half,
    fp32) -> write K,V into the paged cache -> GQA attention that reads K,V back from the paged cache -> output
    projection + residual -> RMSNorm -> SwiGLU MLP + residual. Final RMSNorm and an untied LM head.

KV cache (``PagedKVCache``)
    One tensor per layer, all with ``num_blocks`` blocks of ``config.block_size`` tokens; K is stored after RoPE.
    ``kv_layout`` selects the per-layer shape:
      "nhd" (default; vLLM's layout since PR #44455, 2026-07, K/V packed in the last dimension):
            ``[num_blocks, block_size, num_kv_heads, 2 * head_dim]``; K = ``[..., :head_dim]``,
            V = ``[..., head_dim:]``.
            Block b of a layer is ``tensor[b]``, one contiguous page (what ``CacheManagerClient.register_group``
            expects: first dimension = page index).
      "hnd":   ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (vLLM's HND physical order).
      "split": ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K plane then V plane; vLLM FlashAttention
            before PR #42095, and per layer the same token-major K/V buffers as SGLang's device pool). A block is
            two runs per layer: ``tensor[0, b]`` and ``tensor[1, b]``; register ``tensor[0]`` and ``tensor[1]``.
    Build it with ``PagedKVCache(config, num_blocks, device=..., kv_layout=..., allocator=None, tensors=None)``:
    ``allocator(shape, torch_dtype) -> tensor`` is called once per layer (for shared memory pass
    ``functools.partial(orbitkv.shm.empty, like="torch")``); or pass ``tensors`` (one pre-allocated tensor per
    layer, checked for shape, dtype and device). Default: ``torch.zeros`` on ``device``.
    Members: ``layers`` (list of tensors), ``layer_shape``, ``kv_layout``, ``num_blocks``, ``page_bytes`` (bytes
    of one block in one layer), ``block_bytes`` (all layers), ``named_tensors(prefix="model.layers")`` (vLLM-style
    ``{"model.layers.{i}.self_attn.attn": tensor}``, the dict ``register_kv_caches`` receives),
    ``page_tensors()`` (per-layer tensors whose first dimension is the block id: the layer tensor, or its K and V
    planes for "split"), ``read_blocks(block_ids, layers=None) -> bytes`` and ``write_blocks(block_ids, data,
    layers=None)`` (opaque bytes: block-major, then layer, then the layer's page bytes in memory order; this is
    how tests "save" and "restore" without a Manager),
    ``copy_blocks_from(src_cache, src_ids, dst_ids, layers=None)``, ``fill_blocks(block_ids, value, layers=None)``,
    and the token-level access attention uses: ``write_tokens(layer, block_table, positions, k, v)`` and
    ``read_tokens(layer, block_table, positions) -> (k, v)`` (each [T, num_kv_heads, head_dim]; block_table and
    positions are long tensors on the cache's device). ``sglang_device_buffers() -> (k_buffer, v_buffer)``: for
    the "split" layout, per-layer ``[num_blocks * block_size, H, D]`` views shaped like SGLang's MHA device pool
    (token slot = block_id * block_size + offset).
    ``BlockAllocator(num_blocks, order=None)``: a FIFO free list (``order`` = initial order, so tests can place a
    restored prefix at different block ids); ``allocate(n)``, ``free(ids)``, ``num_free``; ``OutOfBlocks`` when full.

Hashes (``vllm_block_hashes``, ``sglang_page_hashes``)
    vLLM: block i's hash = SHA-256 over the canonical CBOR encoding (RFC 8949 deterministic: shortest integer
    heads, definite lengths) of the 3-array ``(parent, tokens, extra_keys)``: ``parent`` = previous block's 32-byte
    hash, or ``none_hash`` for block 0; ``tokens`` = the block's ``block_size`` token ids as an array of ints;
    ``extra_keys`` = CBOR null, or an array (LoRA name, then cache_salt on block 0 only). This is vLLM's
    ``--prefix-caching-hash-algo sha256_cbor``; ``none_hash(seed)`` = SHA-256(CBOR text string ``seed``) equals vLLM's
    NONE_HASH with ``PYTHONHASHSEED=seed`` (default seed "0"). 32 bytes each; only full blocks are hashed.
    ``vllm_block_hashes(token_ids, block_size, *, none_hash=None, lora_name=None, cache_salt=None, parent=None,
    first_block=0) -> list[bytes]`` (``parent``/``first_block`` continue a chain).
    SGLang: ``sglang_page_hashes(token_ids, page_size=64, prior_hash=None) -> list[str]``: page i's key =
    lowercase hex SHA-256(raw 32 bytes of page i-1's hash (nothing for page 0 unless ``prior_hash``) || token ids as
    uint32 little-endian); only full pages.

Engine (``RefEngine``, ``Request``)
    ``RefEngine(config, num_blocks, *, device="cpu", kv_layout="nhd", kv_allocator=None, kv_tensors=None,
    chunk_size=256, hash_seed="0", block_order=None, attn_impl="eager", model=None)``. ``engine.cache``
    (PagedKVCache), ``engine.blocks`` (BlockAllocator), ``engine.none_hash``, ``engine.model`` (the weights; pass
    ``model=other.model`` to share them between engines of the same config, device and attn_impl).
    ``chunk_size`` must be a multiple of block_size. ``attn_impl="sdpa"`` (torch >= 2 only) uses
    ``F.scaled_dot_product_attention`` on the same gathered K/V; determinism holds within one attn_impl.
    ``add_request(prompt_token_ids, request_id=None, *, lora_name=None, cache_salt=None) -> Request``: computes
    ``request.block_hashes`` (vLLM-style, extended as output tokens complete blocks); allocates no blocks.
    ``Request`` fields: ``request_id``, ``prompt_token_ids``, ``output_token_ids``, ``all_token_ids``,
    ``num_tokens``, ``num_computed_tokens``, ``block_ids`` (the block table: block_ids[i] holds tokens
    [i*bs, (i+1)*bs)), ``block_hashes``, ``page_hashes(page_size=64)`` (SGLang keys of the same tokens).
    ``allocate(request, num_tokens=None) -> list[int]``: extends the block table to cover ``num_tokens`` (default
    all tokens); returns the new block ids. ``free(request)`` returns its blocks to the allocator.
    ``forward(request, num_tokens) -> logits``: the primitive step (what one vLLM scheduler step does for one
    request): computes tokens [num_computed_tokens, +num_tokens) of ``all_token_ids``, writes their K/V into the
    request's blocks, returns float32 logits ``[vocab]`` of the last computed position.
    ``prefill(request, start_token=None, chunk_size=None) -> logits``: computes the prompt from ``start_token``
    (default ``num_computed_tokens``) to its end in chunks whose ends fall on absolute multiples of chunk_size;
    ``start_token=n`` means "the KV of tokens [0, n) is already in this request's blocks" (restored by someone
    else). Needs 0 <= n < len(prompt) (the last prompt token is always computed: it produces the logits).
    ``decode(request) -> logits``: computes the last token (which must be the only uncomputed one).
    ``sample(logits) -> int`` (greedy argmax); ``append_token(request, token)`` (extends hashes, allocates a
    block when needed). ``generate(request, max_new_tokens, start_token=None) -> Generation(tokens, logits)``.
    ``computed_full_blocks(request) -> list[int]``: block ids whose tokens are all computed (savable).
    ``required_blocks(n_cached) -> dict[int, list[int]]``: per layer, the logical block indices (positions in a
    request's ``block_ids``) in [0, ceil(n_cached/bs)) that the layer reads when computing on from n_cached: all
    of them for a full layer; for a sliding-window layer only those holding positions >= n_cached - W + 1
    (``config.needed_block_range(layer, n_cached)``). A hybrid restore may leave a sliding-window layer's other
    blocks untouched (even NaN): they are never read, by the prefill or by any later decode step.

Determinism contract
    Attention always reads K/V back from the paged cache (gathered by absolute position through the block table),
    never from the freshly computed in-register K/V, so where a prefix's KV came from cannot matter. For the same
    config, weights, device and chunk schedule, logits are bit-identical whether tokens [0, n) were computed in
    this run or their blocks' bytes were restored (into any block ids, from any earlier run with the same
    config) and ``prefill(start_token=n)`` ran. The chunk schedules coincide when n is a multiple of chunk_size;
    with other n the suffix's first chunk differs in shape and results may differ in the last bits.

Timing (``time_to_first_token``, ``prefix_kv_bytes``)
    ``time_to_first_token(engine, prompt_token_ids, *, cached_tokens=0, restore=None, chunk_size=None,
    free=True) -> TTFT(ttft_s, restore_s, compute_s, first_token, logits, request)``: admits the prompt, allocates
    its blocks, calls ``restore(request)`` (timed; it must fill the first ``cached_tokens`` tokens' KV into
    ``request.block_ids``) when ``cached_tokens > 0``, prefills the rest and samples; CUDA is synchronized before
    each clock read. ``prefix_kv_bytes(config, n_tokens)``: KV bytes a restore of n_tokens moves (all layers).

Tensor parallelism (``Transformer(..., tp_rank, tp_size, all_reduce)``, ``ThreadTPGroup``)
    A Transformer built with ``tp_size`` > 1 is one TP rank of the model, sharded as vLLM shards Llama (its query
    and KV heads, O's input columns, the MLP's intermediate slice; ``shard_config`` is the rank's KV cache shape);
    ``all_reduce`` sums the ranks' partial outputs. ``ThreadTPGroup(tp_size).reducer(rank)`` is that all-reduce
    for ranks run as threads of one process, deterministic (summed in rank order); ``run(fn)`` runs ``fn(rank)``
    for every rank at once and breaks the group when one fails. The ranks of one TP shape
    compute bit-identically run after run; a different TP shape computes the same model up to rounding.

SGLang host pool (``HostKVPool``)
    ``HostKVPool(config, num_pages, layout="page_first", allocator=None)``: SGLang's MHA host pool for one rank,
    ``kv_buffer`` shaped (2, size, L, H, D) for "page_first" or (2, num_pages, L, page, H, D) for
    "page_first_direct" (page = config.block_size). ``backup(cache, block_ids, page_ids)`` and ``load_back(cache,
    page_ids, block_ids)`` copy whole pages between the engine cache and the pool; ``page_blobs(page_id) ->
    (k, v)`` are uint8 views of the page's two contiguous byte runs (what ``get_page_buffer_meta`` points at),
    ``blob_bytes`` bytes each. ``allocator(shape, torch_dtype)`` as for the KV cache (default: zeros on CPU).
    It also carries the ``HostKVCache`` members an SGLang storage backend reads (MHA): ``layout``, ``page_size``,
    ``page_num``, ``size`` (token slots), ``layer_num``, ``head_num``, ``head_dim``, ``dtype``, ``k_buffer``,
    ``v_buffer``, ``get_hybrid_pool_buffer() -> [k_buffer, v_buffer]``, ``get_ksize_per_token()``,
    ``get_size_per_token()``, ``get_page_buffer_meta(host_indices) -> (ptrs, sizes)`` (K and V interleaved per
    page, one entry pair per ``page_size`` slots), so it can stand in for SGLang's pool in adapter tests.
"""

from orbitkv.demo.refengine.config import PRESETS, ModelConfig, preset  # noqa: F401
from orbitkv.demo.refengine.engine import Generation, RefEngine, Request  # noqa: F401
from orbitkv.demo.refengine.hashing import (  # noqa: F401
    cbor_encode,
    none_hash,
    sglang_page_hashes,
    vllm_block_hashes,
)
from orbitkv.demo.refengine.host_pool import HostKVPool  # noqa: F401
from orbitkv.demo.refengine.kvcache import KV_LAYOUTS, BlockAllocator, OutOfBlocks, PagedKVCache  # noqa: F401
from orbitkv.demo.refengine.model import ThreadTPGroup, Transformer  # noqa: F401
from orbitkv.demo.refengine.timing import TTFT, prefix_kv_bytes, time_to_first_token  # noqa: F401

__all__ = [
    "KV_LAYOUTS",
    "PRESETS",
    "TTFT",
    "BlockAllocator",
    "Generation",
    "HostKVPool",
    "ModelConfig",
    "OutOfBlocks",
    "PagedKVCache",
    "RefEngine",
    "Request",
    "ThreadTPGroup",
    "Transformer",
    "cbor_encode",
    "none_hash",
    "prefix_kv_bytes",
    "preset",
    "sglang_page_hashes",
    "time_to_first_token",
    "vllm_block_hashes",
]
