"""What the harness's model runner executes: a model over vLLM-layout paged KV caches.

Both models keep one KV tensor per layer, allocated the way vLLM's ``initialize_kv_cache`` does it: one raw
buffer per ``KVCacheTensor`` (shared by one layer of each group under the hybrid allocator), viewed with the
physical NHD shape ``[num_blocks, block_size, num_kv_heads, 2 * head_size]`` (K and V packed in the last dimension)
and handed to the connector as the logical view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
permuted back, exactly the strided view ``register_kv_caches`` gets from vLLM. The raw buffers are ordinary
``torch.zeros(size, dtype=torch.int8)`` tensors, as vLLM allocates them (``memory="ordinary"``: the Manager
copies them with process_vm_readv/writev), or OrbitKV shared memory (``memory="shm"``, the zero-syscall path).

``SyntheticModel``: K/V of token p in layer l on rank r is a fixed function of (tokens[0..p], l, r); "attention"
reads back every K/V the layer attends to (a sliding-window layer only its window) and compares it with what it
must be; the sampled token depends on that comparison, so a wrong restore changes the output and is counted
(``bad_reads``). Fast enough for TP, preemption and fault tests.

``RefEngineModel``: the reference engine's transformer (real attention math). Each layer reads and writes
through its own KV group's block table (the hybrid allocator gives each group its own table).
"""

from __future__ import annotations

import numpy as np
import torch

from orbitkv import shm
from vllm_harness.config import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def kv_cache_config_for(num_layers: int, windows, num_kv_heads: int, head_size: int, block_size: int,
                        dtype: torch.dtype, num_blocks: int) -> KVCacheConfig:
    """vLLM's KVCacheConfig for full-attention layers plus sliding-window layers (hybrid allocator: one group per
    attention kind, one raw tensor shared by one layer of each group)."""
    windows = list(windows) if windows is not None else [None] * num_layers
    full = [i for i in range(num_layers) if windows[i] is None]
    swa = [i for i in range(num_layers) if windows[i] is not None]
    groups = [KVCacheGroupSpec([layer_name(i) for i in full],
                               FullAttentionSpec(block_size, num_kv_heads, head_size, dtype))]
    if swa:
        w = {windows[i] for i in swa}
        assert len(w) == 1, "one sliding window size per model in the harness"
        groups.append(KVCacheGroupSpec([layer_name(i) for i in swa],
                                       SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype,
                                                         sliding_window=w.pop())))
    page = groups[0].kv_cache_spec.page_size_bytes
    per_group = max(len(g.layer_names) for g in groups)
    tensors = []
    for j in range(per_group):
        shared = [g.layer_names[j] for g in groups if j < len(g.layer_names)]
        tensors.append(KVCacheTensor(size=page * num_blocks, shared_by=shared))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


MEMORY_KINDS = ("shm", "ordinary")


def allocate_kv_caches(kv_cache_config: KVCacheConfig, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                       head_size: int, memory: str = "shm"):
    """-> ({layer name: logical strided view}, {layer name: physical NHD tensor}); raw buffers in ``memory``."""
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {memory!r}")
    logical, physical = {}, {}
    nb = kv_cache_config.num_blocks
    for spec in kv_cache_config.kv_cache_tensors:
        if memory == "shm":
            raw = shm.zeros((spec.size,), "uint8", like="torch")
        else:  # vLLM's _allocate_kv_cache_tensors: one int8 tensor per KVCacheTensor
            raw = torch.zeros(spec.size, dtype=torch.int8)
        for name in spec.shared_by:
            phys = raw.view(dtype).view(nb, block_size, num_kv_heads, 2 * head_size)
            physical[name] = phys
            logical[name] = phys.permute(0, 2, 1, 3)  # logical (blocks, heads, block_size, 2D), NHD strides
    return logical, physical


def _group_of(kv_cache_config: KVCacheConfig) -> dict:
    return {name: g for g, spec in enumerate(kv_cache_config.kv_cache_groups) for name in spec.layer_names}


class SyntheticModel:
    def __init__(self, num_layers: int, *, windows=None, num_kv_heads: int = 2, head_size: int = 8,
                 block_size: int = 16, tp_rank: int = 0, vocab_size: int = 997, dtype=torch.bfloat16,
                 memory: str = "shm"):
        self.memory = memory
        self.num_layers = num_layers
        self.windows = list(windows) if windows is not None else [None] * num_layers
        self.num_kv_heads, self.head_size, self.block_size = num_kv_heads, head_size, block_size
        self.tp_rank = tp_rank
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.layer_names = [layer_name(i) for i in range(num_layers)]
        self.bad_reads = 0
        self.tokens_computed = 0

    def kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        return kv_cache_config_for(self.num_layers, self.windows, self.num_kv_heads, self.head_size,
                                   self.block_size, self.dtype, num_blocks)

    def bind(self, kv_cache_config: KVCacheConfig) -> dict:
        logical, physical = allocate_kv_caches(kv_cache_config, self.dtype, self.block_size, self.num_kv_heads,
                                               self.head_size, self.memory)
        self.pages = {name: t.view(torch.int16).numpy() for name, t in physical.items()}
        self.group_of = _group_of(kv_cache_config)
        return logical

    @staticmethod
    def digests(tokens) -> np.ndarray:
        out = np.empty(len(tokens), dtype=np.int64)
        h = 0x12345
        for i, t in enumerate(tokens):
            h = (h * 1000003 + int(t) + 1) & 0xFFFFFFFF
            out[i] = h
        return out

    def _content(self, layer: int, digests: np.ndarray) -> np.ndarray:
        width = self.num_kv_heads * 2 * self.head_size
        base = (digests * 0x9E3779B1 + layer * 0x85EBCA77 + self.tp_rank * 0xC2B2AE3D) & 0xFFFF
        values = (base[:, None] + np.arange(width, dtype=np.int64)[None, :] * 40503) & 0x7F7F  # finite bf16
        return values.astype(np.int16).reshape(len(digests), self.num_kv_heads, 2 * self.head_size)

    def execute(self, batch, hooks) -> dict:
        """batch: [(req_id, token_ids, start, n, block_tables per group)] -> {req_id: logits [vocab]}."""
        bs = self.block_size
        digests = {req_id: self.digests(tokens[:start + n]) for req_id, tokens, start, n, _ in batch}
        checks = {req_id: 0 for req_id, *_ in batch}
        for layer, name in enumerate(self.layer_names):
            hooks.begin_layer(name)
            pages = self.pages[name]
            window = self.windows[layer]
            for req_id, tokens, start, n, tables in batch:
                table = tables[self.group_of[name]]
                pos = np.arange(start, start + n)
                blocks = np.array([table[p // bs] for p in pos])
                assert (blocks != 0).all(), "K/V written into vLLM's null block"
                pages[blocks, pos % bs] = self._content(layer, digests[req_id][start:start + n])
                lo = 0 if window is None else max(0, start - window + 1)
                read = np.arange(lo, start + n)
                got = pages[np.array([table[p // bs] for p in read]), read % bs]
                want = self._content(layer, digests[req_id][lo:start + n])
                bad = int((got != want).reshape(len(read), -1).any(axis=1).sum())
                self.bad_reads += bad
                checks[req_id] += bad
            hooks.end_layer(name, None)
        self.tokens_computed += sum(n for _, _, _, n, _ in batch)
        out = {}
        for req_id, tokens, start, n, _ in batch:
            logits = torch.zeros(self.vocab_size)
            logits[(int(digests[req_id][-1]) + 31 * checks[req_id]) % self.vocab_size] = 1.0
            out[req_id] = logits
        return out


class _GroupTables:
    """A PagedKVCache seen through per-layer block tables: the engine's transformer asks for (layer, table,
    positions); this substitutes the table of the layer's KV group."""

    def __init__(self, cache, layer_group: list):
        self.cache = cache
        self.layer_group = layer_group
        self.tables = None
        self.hooks = None
        self.names = None
        self.first = self.last = False

    def write_tokens(self, layer, _table, positions, k, v):
        if self.first:
            self.hooks.begin_layer(self.names[layer])
        self.cache.write_tokens(layer, self.tables[self.layer_group[layer]], positions, k, v)

    def read_tokens(self, layer, _table, positions):
        out = self.cache.read_tokens(layer, self.tables[self.layer_group[layer]], positions)
        if self.last:
            self.hooks.end_layer(self.names[layer], self.cache.layers[layer])
        return out


class RefEngineModel:
    """The reference engine's transformer on harness-allocated KV caches (CPU). With ``group`` (a ThreadTPGroup)
    it is TP rank ``tp_rank`` of ``group.tp_size``: its share of the heads and its KV heads' caches, summing partial
    outputs with the other ranks; those run as threads (``concurrent_ranks``), as vLLM's workers run at once."""

    def __init__(self, config, *, device="cpu", memory: str = "shm", tp_rank: int = 0, group=None):
        from orbitkv.demo.refengine.model import Transformer

        self.config = config
        self.memory = memory
        self.device = torch.device(device)
        self.block_size = config.block_size
        self.layer_names = [layer_name(i) for i in range(config.num_layers)]
        self.group = group
        self.concurrent_ranks = group is not None
        if group is None:
            self.transformer = Transformer(config, self.device)
        else:
            self.transformer = Transformer(config, self.device, tp_rank=tp_rank, tp_size=group.tp_size,
                                           all_reduce=group.reducer(tp_rank))
        self.shard = self.transformer.shard_config
        self.tokens_computed = 0
        self.bad_reads = 0

    def kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        c = self.shard  # vLLM's KV cache spec is per worker: this rank's KV heads
        return kv_cache_config_for(c.num_layers, c.sliding_window, c.num_kv_heads, c.head_dim, c.block_size,
                                   c.torch_dtype, num_blocks)

    def bind(self, kv_cache_config: KVCacheConfig) -> dict:
        from orbitkv.demo.refengine.kvcache import PagedKVCache

        c = self.shard
        logical, physical = allocate_kv_caches(kv_cache_config, c.torch_dtype, c.block_size, c.num_kv_heads,
                                               c.head_dim, self.memory)
        cache = PagedKVCache(c, kv_cache_config.num_blocks, device=self.device,
                             tensors=[physical[name] for name in self.layer_names])
        groups = _group_of(kv_cache_config)
        self.view = _GroupTables(cache, [groups[name] for name in self.layer_names])
        self.view.names = self.layer_names
        return logical

    def execute(self, batch, hooks) -> dict:
        """Requests run one after another; vLLM's per-layer hooks keep their order: wait_for_layer_load(l) before
        any attention of layer l (first request), save_kv_layer(l) after the last request's layer l."""
        out = {}
        self.view.hooks = hooks
        for i, (req_id, tokens, start, n, tables) in enumerate(batch):
            self.view.first, self.view.last = i == 0, i == len(batch) - 1
            self.view.tables = [torch.tensor(t, dtype=torch.long, device=self.device) for t in tables]
            ids = torch.tensor(tokens[start:start + n], dtype=torch.long, device=self.device)
            out[req_id] = self.transformer.forward(ids, start, self.view, None)
            self.tokens_computed += n
        return out
