"""The reference engine: requests with block tables and block hashes, chunked prefill, decode, greedy sampling."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from orbitkv.demo.refengine import hashing
from orbitkv.demo.refengine.config import ModelConfig
from orbitkv.demo.refengine.kvcache import BlockAllocator, PagedKVCache
from orbitkv.demo.refengine.model import Transformer


@dataclass
class Request:
    """One sequence: its tokens, how many have KV in the cache, its block table and its block hashes."""

    request_id: str
    prompt_token_ids: list
    output_token_ids: list = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    lora_name: Optional[str] = None
    cache_salt: Optional[str] = None

    @property
    def all_token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def page_hashes(self, page_size: int = 64) -> list:
        """SGLang-style keys (hex) of this request's full ``page_size``-token pages."""
        return hashing.sglang_page_hashes(self.all_token_ids, page_size)


@dataclass
class Generation:
    tokens: list   # sampled tokens, in order
    logits: list   # logits[i] produced tokens[i] (float32 [vocab])


class RefEngine:
    """A single-device engine over one paged KV cache; requests run one at a time (no batching)."""

    def __init__(self, config: ModelConfig, num_blocks: int, *, device="cpu", kv_layout: str = "nhd",
                 kv_allocator: Optional[Callable] = None, kv_tensors: Optional[Sequence[torch.Tensor]] = None,
                 chunk_size: int = 256, hash_seed: str = "0", block_order: Optional[Sequence[int]] = None,
                 attn_impl: str = "eager", model: Optional[Transformer] = None):
        if not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % config.block_size:
            raise ValueError(f"chunk_size must be a positive multiple of block_size ({config.block_size}), "
                             f"got {chunk_size!r}")
        self.config = config
        self.device = torch.device(device)
        self.chunk_size = chunk_size
        if model is not None:
            if model.config != config or model.device != self.device or model.attn_impl != attn_impl:
                raise ValueError("a shared model must have the same config, device and attn_impl")
            self.model = model
        else:
            self.model = Transformer(config, self.device, attn_impl)
        # A TP rank's model (Transformer(..., tp_size > 1)) keeps its KV heads only: the cache has that shape.
        self.cache = PagedKVCache(self.model.shard_config, num_blocks, device=self.device, kv_layout=kv_layout,
                                  allocator=kv_allocator, tensors=kv_tensors)
        self.blocks = BlockAllocator(num_blocks, block_order)
        self.none_hash = hashing.none_hash(hash_seed)
        self._ids = itertools.count()

    # ---- requests and blocks -----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], request_id: Optional[str] = None, *,
                    lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> Request:
        tokens = [int(t) for t in prompt_token_ids]
        if not tokens:
            raise ValueError("a prompt needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {bad[:4]}")
        req = Request(request_id if request_id is not None else f"req-{next(self._ids)}", tokens,
                      lora_name=lora_name, cache_salt=cache_salt)
        req.block_hashes = hashing.vllm_block_hashes(tokens, self.config.block_size, none_hash=self.none_hash,
                                                     lora_name=lora_name, cache_salt=cache_salt)
        return req

    def allocate(self, request: Request, num_tokens: Optional[int] = None) -> list:
        """Extends the block table to cover ``num_tokens`` (default: all tokens); returns the new block ids."""
        num_tokens = request.num_tokens if num_tokens is None else num_tokens
        needed = -(-num_tokens // self.config.block_size) - len(request.block_ids)
        if needed <= 0:
            return []
        new = self.blocks.allocate(needed)
        request.block_ids.extend(new)
        return new

    def free(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0

    def computed_full_blocks(self, request: Request) -> list:
        """Block ids whose tokens all have KV in the cache (what a connector may save)."""
        return request.block_ids[:request.num_computed_tokens // self.config.block_size]

    def required_blocks(self, n_cached: int) -> dict:
        """Per layer, the logical block indices (into a request's block table) of [0, n_cached) that the layer
        reads when computing from ``n_cached`` on; a sliding-window layer needs only its window's blocks."""
        return {i: list(self.config.needed_block_range(i, n_cached)) for i in range(self.config.num_layers)}

    def append_token(self, request: Request, token: int) -> None:
        """Appends a sampled token: extends the block hashes when it completes a block, allocates its block."""
        token = int(token)
        if not 0 <= token < self.config.vocab_size:
            raise ValueError(f"token id {token} outside [0, {self.config.vocab_size})")
        request.output_token_ids.append(token)
        bs = self.config.block_size
        if request.num_tokens % bs == 0:
            first = request.num_tokens // bs - 1
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes += hashing.vllm_block_hashes(
                request.all_token_ids[first * bs:], bs, none_hash=self.none_hash, lora_name=request.lora_name,
                cache_salt=request.cache_salt, parent=parent, first_block=first)
        self.allocate(request)

    # ---- compute -----------------------------------------------------------------------------------------------
    def forward(self, request: Request, num_tokens: int, cache=None) -> torch.Tensor:
        """Computes tokens [num_computed_tokens, +num_tokens) (allocating blocks if needed); returns the float32
        logits of the last one. The KV of every earlier token must already be in the request's blocks. ``cache``:
        what the model reads and writes the KV through (default the engine's PagedKVCache; a wrapper with the same
        read_tokens/write_tokens may hook each layer's access)."""
        start = request.num_computed_tokens
        end = start + num_tokens
        if num_tokens <= 0 or end > request.num_tokens:
            raise ValueError(f"cannot compute {num_tokens} tokens from {start} of a {request.num_tokens}-token "
                             "request")
        self.allocate(request, end)
        tokens = torch.tensor(request.all_token_ids[start:end], dtype=torch.long, device=self.device)
        table = torch.tensor(request.block_ids, dtype=torch.long, device=self.device)
        logits = self.model.forward(tokens, start, self.cache if cache is None else cache, table)
        request.num_computed_tokens = end
        return logits

    def prefill(self, request: Request, start_token: Optional[int] = None,
                chunk_size: Optional[int] = None) -> torch.Tensor:
        """Computes the request's tokens from ``start_token`` to the end in chunks ending on absolute multiples
        of ``chunk_size``; tokens [0, start_token) must already have KV in the request's blocks."""
        chunk = self.chunk_size if chunk_size is None else chunk_size
        if not isinstance(chunk, int) or chunk <= 0 or chunk % self.config.block_size:
            raise ValueError(f"chunk_size must be a positive multiple of block_size ({self.config.block_size}), "
                             f"got {chunk!r}")
        start = request.num_computed_tokens if start_token is None else int(start_token)
        if not 0 <= start < request.num_tokens:
            raise ValueError(f"start_token must be in [0, {request.num_tokens}) (the last token is always "
                             f"computed), got {start}")
        self.allocate(request)
        request.num_computed_tokens = start
        logits = None
        while request.num_computed_tokens < request.num_tokens:
            pos = request.num_computed_tokens
            end = min(request.num_tokens, (pos // chunk + 1) * chunk)
            logits = self.forward(request, end - pos)
        return logits

    def decode(self, request: Request) -> torch.Tensor:
        """Computes the newest token (the only one without KV) and returns its logits."""
        if request.num_computed_tokens != request.num_tokens - 1:
            raise ValueError(f"decode needs exactly one uncomputed token; {request.num_computed_tokens} of "
                             f"{request.num_tokens} are computed")
        return self.forward(request, 1)

    @staticmethod
    def sample(logits: torch.Tensor) -> int:
        """Greedy: the highest logit (the lowest index among equals)."""
        return int(torch.argmax(logits).item())

    def generate(self, request: Request, max_new_tokens: int, start_token: Optional[int] = None,
                 chunk_size: Optional[int] = None) -> Generation:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        logits = self.prefill(request, start_token, chunk_size)
        out = Generation([], [])
        for i in range(max_new_tokens):
            token = self.sample(logits)
            out.tokens.append(token)
            out.logits.append(logits)
            self.append_token(request, token)
            if i + 1 < max_new_tokens:
                logits = self.decode(request)
        return out
