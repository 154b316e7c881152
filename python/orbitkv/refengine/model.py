"""The transformer: random Llama-architecture weights from a seed, and the forward pass over a paged KV cache.

Every weight tensor is drawn from its own generator seeded by (config.seed, layer, slot), on the target device,
so weights are reproducible per device and large models need no host round trip. Attention never uses the K/V it
just computed directly: it writes them into the paged cache and reads the whole attended range back through the
block table, so a prefix computed here and a prefix restored from bytes are read by identical operations.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from orbitkv.refengine.config import ModelConfig
from orbitkv.refengine.kvcache import PagedKVCache

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

    def __init__(self, config: ModelConfig, device="cpu", attn_impl: str = "eager"):
        if attn_impl not in ("eager", "sdpa"):
            raise ValueError(f"attn_impl must be 'eager' or 'sdpa', got {attn_impl!r}")
        if attn_impl == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
            raise ValueError("attn_impl='sdpa' needs torch >= 2.0")
        self.config = config
        self.device = torch.device(device)
        self.attn_impl = attn_impl
        c, dt, dev = config, config.torch_dtype, self.device
        with torch.no_grad():
            self.embed = _normal((c.vocab_size, c.hidden_size), 1.0, _generator(dev, c, _EMBED, 0), dev, dt)
            self.layers = [LayerWeights(c, i, dev) for i in range(c.num_layers)]
            self.final_norm = _norm_weight(c.hidden_size, _generator(dev, c, _FINAL, 0), dev, dt)
            self.lm_head = _normal((c.vocab_size, c.hidden_size), 1.0 / math.sqrt(c.hidden_size),
                                   _generator(dev, c, _LM_HEAD, 0), dev, dt)
            half = torch.arange(0, c.head_dim, 2, device=dev, dtype=torch.float32) / c.head_dim
            self.inv_freq = 1.0 / (c.rope_theta ** half)

    # ---- building blocks ---------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.config.rms_norm_eps)
        return xf.to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in fp32 on x [T, heads, D]; angles depend only on the absolute position."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def _attention(self, layer: int, q: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                   cache: PagedKVCache, block_table: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] of positions [start, end) -> [T, H*D], attending through the paged cache."""
        c = self.config
        window = c.window(layer)
        lo = 0 if window is None else max(0, start - window + 1)
        key_positions = torch.arange(lo, end, device=q.device)
        k, v = cache.read_tokens(layer, block_table, key_positions)  # [S, Hkv, D] each
        allowed = key_positions[None, :] <= positions[:, None]
        if window is not None:
            allowed &= key_positions[None, :] > positions[:, None] - window
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
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(c.num_kv_heads, g * t, s)
        out = torch.bmm(probs, v.permute(1, 0, 2))  # [Hkv, g*T, D]
        return out.view(c.num_kv_heads, g, t, d).permute(2, 0, 1, 3).reshape(t, c.num_heads * d)

    # ---- one chunk ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start: int, cache: PagedKVCache,
                block_table: torch.Tensor) -> torch.Tensor:
        """Computes tokens at positions [start, start + T) of one request whose earlier tokens' KV is in the
        cache under ``block_table``; writes their KV; returns float32 logits [vocab] of the last position."""
        c = self.config
        t = token_ids.numel()
        end = start + t
        positions = torch.arange(start, end, device=self.device)
        x = self.embed[token_ids]
        n_q, n_kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, w in enumerate(self.layers):
            h = self._rms_norm(x, w.input_norm)
            qkv = F.linear(h, w.qkv)
            q = qkv[:, :n_q].reshape(t, c.num_heads, c.head_dim)
            k = qkv[:, n_q:n_q + n_kv].reshape(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, n_q + n_kv:].reshape(t, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = self._rms_norm(q, w.q_norm)
                k = self._rms_norm(k, w.k_norm)
            q = self._rope(q, positions)
            k = self._rope(k, positions)
            cache.write_tokens(i, block_table, positions, k, v)
            x = x + F.linear(self._attention(i, q, positions, start, end, cache, block_table), w.o)
            gate, up = F.linear(self._rms_norm(x, w.post_norm), w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        last = self._rms_norm(x[-1:], self.final_norm)
        return F.linear(last, self.lm_head)[0].float()
