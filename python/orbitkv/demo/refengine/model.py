"""The transformer: random Llama-architecture weights from a seed, and the forward pass over a paged KV cache.

Every weight tensor is drawn from its own generator seeded by (config.seed, layer, slot), on the target device,
so weights are reproducible per device and large models need no host round trip. Attention never uses the K/V it
just computed directly: it writes them into the paged cache and reads the whole attended range back through the
block table, so a prefix computed here and a prefix restored from bytes are read by identical operations.

Tensor parallelism as vLLM shards a Llama model: with ``tp_size`` > 1 a rank keeps its share of the query and KV
heads (QKVParallelLinear), of the O projection's input columns and of the MLP's intermediate size
(column-parallel gate/up, row-parallel down), and ``all_reduce`` sums the ranks' partial outputs after O and down;
embedding, norms and the LM head stay whole. The weights are the full model's, drawn as for one rank and sliced, so
every TP shape computes the same model; its KV cache holds the rank's KV heads only (``shard_config``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from orbitkv.demo.refengine.config import ModelConfig
from orbitkv.demo.refengine.kvcache import PagedKVCache

_EMBED, _LM_HEAD, _FINAL = -1, -2, -3  # non-layer generator slots


def _generator(device: torch.device, config: ModelConfig, layer: int, slot: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((config.seed * 1_000_003 + (layer + 8) * 1_009 + slot) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def _normal(shape, std: float, g: torch.Generator, device, dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)


def _norm_weight(size: int, g, device, dtype) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn((size,), generator=g, device=device, dtype=torch.float32)).to(dtype)


class LayerWeights:
    """One decoder layer: fused QKV [(H + 2*Hkv) * D, hidden], O [hidden, H*D], fused gate/up [2*I, hidden],
    down [hidden, I], input and post-attention RMSNorm weights, optional per-head q/k RMSNorm weights [D]."""

    def __init__(self, config: ModelConfig, layer: int, device: torch.device):
        c, dt = config, config.torch_dtype
        hd = c.head_dim
        slot = iter(range(100))

        def normal(shape, fan_in):
            return _normal(shape, 1.0 / math.sqrt(fan_in), _generator(device, c, layer, next(slot)), device, dt)

        def norm(size):
            return _norm_weight(size, _generator(device, c, layer, next(slot)), device, dt)

        self.qkv = normal(((c.num_heads + 2 * c.num_kv_heads) * hd, c.hidden_size), c.hidden_size)
        self.o = normal((c.hidden_size, c.num_heads * hd), c.num_heads * hd)
        self.gate_up = normal((2 * c.intermediate_size, c.hidden_size), c.hidden_size)
        self.down = normal((c.hidden_size, c.intermediate_size), c.intermediate_size)
        self.input_norm = norm(c.hidden_size)
        self.post_norm = norm(c.hidden_size)
        self.q_norm = norm(hd) if c.qk_norm else None
        self.k_norm = norm(hd) if c.qk_norm else None


class Transformer:
    """Weights plus the forward pass of one request's chunk of consecutive tokens."""

    def __init__(self, config: ModelConfig, device="cpu", attn_impl: str = "eager", *, tp_rank: int = 0,
                 tp_size: int = 1, all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        if tp_size > 1:
            for name in ("num_heads", "num_kv_heads", "intermediate_size"):
                if getattr(config, name) % tp_size:
                    raise ValueError(f"{name} ({getattr(config, name)}) must be a multiple of tp_size ({tp_size})")
            if all_reduce is None:
                raise ValueError("tp_size > 1 needs an all_reduce that sums the ranks' partial outputs")
        if attn_impl not in ("eager", "sdpa"):
            raise ValueError(f"attn_impl must be 'eager' or 'sdpa', got {attn_impl!r}")
        if attn_impl == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
            raise ValueError("attn_impl='sdpa' needs torch >= 2.0")
        self.config = config
        self.device = torch.device(device)
        self.attn_impl = attn_impl
        self.tp_rank, self.tp_size, self.all_reduce = tp_rank, tp_size, all_reduce
        self.shard_config = config if tp_size == 1 else dataclasses.replace(
            config, num_heads=config.num_heads // tp_size, num_kv_heads=config.num_kv_heads // tp_size,
            intermediate_size=config.intermediate_size // tp_size)
        c, dt, dev = config, config.torch_dtype, self.device
        with torch.no_grad():
            self.embed = _normal((c.vocab_size, c.hidden_size), 1.0, _generator(dev, c, _EMBED, 0), dev, dt)
            self.layers = [self._shard(LayerWeights(c, i, dev)) for i in range(c.num_layers)]
            self.final_norm = _norm_weight(c.hidden_size, _generator(dev, c, _FINAL, 0), dev, dt)
            self.lm_head = _normal((c.vocab_size, c.hidden_size), 1.0 / math.sqrt(c.hidden_size),
                                   _generator(dev, c, _LM_HEAD, 0), dev, dt)
            half = torch.arange(0, c.head_dim, 2, device=dev, dtype=torch.float32) / c.head_dim
            self.inv_freq = 1.0 / (c.rope_theta ** half)

    def _shard(self, w: LayerWeights) -> LayerWeights:
        """This rank's slices of one layer's weights (contiguous copies; the full tensors are dropped)."""
        if self.tp_size == 1:
            return w
        c, s, r, hd = self.config, self.shard_config, self.tp_rank, self.config.head_dim
        n_q, n_kv = c.num_heads * hd, c.num_kv_heads * hd
        q_rows = slice(r * s.num_heads * hd, (r + 1) * s.num_heads * hd)
        kv_rows = slice(r * s.num_kv_heads * hd, (r + 1) * s.num_kv_heads * hd)
        qkv = w.qkv
        w.qkv = torch.cat([qkv[:n_q][q_rows], qkv[n_q:n_q + n_kv][kv_rows], qkv[n_q + n_kv:][kv_rows]]).contiguous()
        w.o = w.o[:, q_rows].contiguous()
        inter = slice(r * s.intermediate_size, (r + 1) * s.intermediate_size)
        gate, up = w.gate_up.chunk(2, dim=0)
        w.gate_up = torch.cat([gate[inter], up[inter]]).contiguous()
        w.down = w.down[:, inter].contiguous()
        return w

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp_size == 1 else self.all_reduce(partial)

    # ---- building blocks ---------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.config.rms_norm_eps)
        return xf.to(x.dtype) * weight

    def _rope_tables(self, positions: torch.Tensor) -> tuple:
        """(cos, sin), each [T, 1, D] fp32, of rotate-half RoPE at ``positions``: computed once per forward pass,
        since they depend only on the absolute positions (the same for every layer)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
        return cos, sin

    @staticmethod
    def _rope(x: torch.Tensor, tables: tuple) -> torch.Tensor:
        """Rotate-half RoPE in fp32 on x [T, heads, D] with ``_rope_tables`` of its positions."""
        cos, sin = tables
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def _attention(self, layer: int, q: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                   cache: PagedKVCache, block_table: torch.Tensor, masks: dict) -> torch.Tensor:
        """q [T, H, D] of positions [start, end) -> [T, H*D], attending through the paged cache (H, Hkv: this
        rank's heads). ``masks``: the forward pass's (key positions, allowed, not allowed) per window, filled on first
        use."""
        c = self.shard_config
        window = c.window(layer)
        if window not in masks:  # the same for every layer of one window: built once per forward pass
            lo = 0 if window is None else max(0, start - window + 1)
            key_positions = torch.arange(lo, end, device=q.device)
            allowed = key_positions[None, :] <= positions[:, None]
            if window is not None:
                allowed &= key_positions[None, :] > positions[:, None] - window
            masks[window] = key_positions, allowed, ~allowed
        key_positions, allowed, blocked = masks[window]
        k, v = cache.read_tokens(layer, block_table, key_positions)  # [S, Hkv, D] each
        t, s, g, d = q.shape[0], key_positions.numel(), c.q_per_kv, c.head_dim
        scale = 1.0 / math.sqrt(d)
        if self.attn_impl == "sdpa":
            qh = q.permute(1, 0, 2)  # [H, T, D]
            kh = k.permute(1, 0, 2).repeat_interleave(g, dim=0)
            vh = v.permute(1, 0, 2).repeat_interleave(g, dim=0)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed)  # [H, T, D]
            return out.permute(1, 0, 2).reshape(t, c.num_heads * d)
        # Query head h uses KV head h // g: group the g query heads of each KV head into one batched matmul.
        qh = q.view(t, c.num_kv_heads, g, d).permute(1, 2, 0, 3).reshape(c.num_kv_heads, g * t, d)
        scores = torch.bmm(qh, k.permute(1, 2, 0)).view(c.num_kv_heads, g, t, s).float() * scale
        scores = scores.masked_fill(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(c.num_kv_heads, g * t, s)
        out = torch.bmm(probs, v.permute(1, 0, 2))  # [Hkv, g*T, D]
        return out.view(c.num_kv_heads, g, t, d).permute(2, 0, 1, 3).reshape(t, c.num_heads * d)

    # ---- one chunk ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start: int, cache: PagedKVCache,
                block_table: torch.Tensor) -> torch.Tensor:
        """Computes tokens at positions [start, start + T) of one request whose earlier tokens' KV is in the
        cache under ``block_table``; writes their KV; returns float32 logits [vocab] of the last position."""
        c = self.shard_config
        t = token_ids.numel()
        end = start + t
        positions = torch.arange(start, end, device=self.device)
        x = self.embed[token_ids]
        n_q, n_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        rope, masks = self._rope_tables(positions), {}
        for i, w in enumerate(self.layers):
            h = self._rms_norm(x, w.input_norm)
            qkv = F.linear(h, w.qkv)
            q = qkv[:, :n_q].reshape(t, c.num_heads, c.head_dim)
            k = qkv[:, n_q:n_q + n_kv].reshape(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, n_q + n_kv:].reshape(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = self._rms_norm(q, w.q_norm)
                k = self._rms_norm(k, w.k_norm)
            q = self._rope(q, rope)
            k = self._rope(k, rope)
            cache.write_tokens(i, block_table, positions, k, v)
            x = x + self._reduce(F.linear(self._attention(i, q, positions, start, end, cache, block_table, masks), w.o))
            gate, up = F.linear(self._rms_norm(x, w.post_norm), w.gate_up).chunk(2, dim=-1)
            x = x + self._reduce(F.linear(F.silu(gate) * up, w.down))
        last = self._rms_norm(x[-1:], self.final_norm)
        return F.linear(last, self.lm_head)[0].float()


class ThreadTPGroup:
    """The all-reduce of ``tp_size`` ranks run as threads of one process (on one device or several): each rank
    hands in its partial sum; every rank gets the same total, summed in rank order on its own device, so the result
    is deterministic. A rank that fails or stops arriving breaks the group after ``timeout_s``: the others raise
    ``threading.BrokenBarrierError`` instead of waiting for ever."""

    def __init__(self, tp_size: int, timeout_s: float = 120.0):
        import threading

        if tp_size < 2:
            raise ValueError(f"a TP group needs at least 2 ranks, got {tp_size}")
        self.tp_size = tp_size
        self.errors: list = []  # the ranks' exceptions in the last run()
        self._parts: list = [None] * tp_size
        self._barrier = threading.Barrier(tp_size, timeout=timeout_s)

    def reducer(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce(partial: torch.Tensor) -> torch.Tensor:
            self._parts[rank] = partial
            self._barrier.wait()  # every partial is in
            total = self._parts[0].to(partial.device)
            for other in self._parts[1:]:
                total = total + other.to(partial.device)
            self._barrier.wait()  # every rank has read them: the slots may be reused
            return total

        return all_reduce

    def abort(self) -> None:
        """Breaks the group: ranks waiting in an all-reduce raise at once (call when a rank failed)."""
        self._barrier.abort()

    def run(self, fn: Callable[[int], object], timeout_s: float = 300.0) -> list:
        """``[fn(0), ..., fn(tp_size - 1)]``, each rank on a thread of its own, all at once (as TP workers run,
        meeting in the all-reduces). A rank that raises breaks the group, so the others stop waiting; then the
        first error is raised here and every rank's is in ``errors``. A rank still running after ``timeout_s``
        breaks the group and raises TimeoutError."""
        import threading

        results: list = [None] * self.tp_size
        self.errors = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: B902 - re-raised in the caller's thread
                self.errors.append(e)
                self.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank{r}", daemon=True)
                   for r in range(self.tp_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout_s)
        if any(t.is_alive() for t in threads):
            self.abort()
            raise TimeoutError(f"a TP rank ran past {timeout_s} s")
        if self.errors:
            raise self.errors[0]
        return results
