"""Model configuration of the reference engine, and its presets (tiny for CI up to a Qwen3-8B shape)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Optional

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and identity of a Llama-architecture model with random weights drawn from ``seed``."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"
    block_size: int = 16
    # None: every layer attends to the whole prefix. Otherwise one entry per layer: None (full) or W (the query at
    # position p attends positions p-W+1 .. p).
    sliding_window: Optional[tuple] = None
    qk_norm: bool = False
    seed: int = 0
    name: str = "custom"

    def __post_init__(self):
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "block_size")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        if self.sliding_window is not None:
            windows = tuple(self.sliding_window)
            if len(windows) != self.num_layers:
                raise ValueError(f"sliding_window needs one entry per layer ({self.num_layers}), got {len(windows)}")
            for w in windows:
                if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
                    raise ValueError(f"a sliding window must be None or a positive int, got {w!r}")
            object.__setattr__(self, "sliding_window", windows)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer``, or None for a full-attention layer."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return None if self.sliding_window is None else self.sliding_window[layer]

    @property
    def full_layers(self) -> list:
        return [i for i in range(self.num_layers) if self.window(i) is None]

    @property
    def swa_layers(self) -> list:
        return [i for i in range(self.num_layers) if self.window(i) is not None]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block (K and V) in one layer."""
        return self.block_size * self.num_kv_heads * 2 * self.head_dim * self.itemsize

    @property
    def num_parameters(self) -> int:
        per_layer = (self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
                     + self.num_heads * self.head_dim * self.hidden_size
                     + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
                     + (2 * self.head_dim if self.qk_norm else 0))
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size

    def needed_block_range(self, layer: int, n_cached: int) -> range:
        """Logical block indices of [0, ceil(n_cached / block_size)) that ``layer`` reads when tokens from
        ``n_cached`` on are computed: all of them for a full layer, the window's for a sliding-window layer."""
        if n_cached < 0:
            raise ValueError(f"n_cached must be >= 0, got {n_cached}")
        end = -(-n_cached // self.block_size)
        w = self.window(layer)
        if w is None or n_cached == 0:
            return range(0, end)
        first_position = max(0, n_cached - w + 1)
        return range(min(first_position // self.block_size, end), end)

    def fingerprint(self) -> str:
        """Names every field that changes the KV bytes (weights come from the seed), for StateKey namespaces."""
        fields = dataclasses.asdict(self)
        fields.pop("name")
        text = ";".join(f"{k}={fields[k]!r}" for k in sorted(fields))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return f"orbitkv-refengine/{self.name}/{digest}"


PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=256),
    "tiny_hybrid": dict(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=256, sliding_window=(32, None, 32, None)),
    "small": dict(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=768,
                  vocab_size=2048),
    "medium": dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, head_dim=64,
                   intermediate_size=2816, vocab_size=8192),
    "qwen3_8b_shaped": dict(num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=12288, vocab_size=151936, rope_theta=1_000_000.0, qk_norm=True,
                            dtype="bfloat16"),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset config with ``overrides`` applied (e.g. ``preset("small", block_size=64, dtype="bfloat16")``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    fields = dict(PRESETS[name], name=name)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
    fields.update(overrides)
    return ModelConfig(**fields)
