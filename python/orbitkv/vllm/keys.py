"""OrbitKV's block keys for vLLM requests: the same tokens under the same namespace give the same keys in every
process, on every host, after every restart.

vLLM's own block hashes cannot be used as keys: their chain starts at ``NONE_HASH``, which vLLM draws at random
per process unless ``PYTHONHASHSEED`` is set (every release before 2026-08, and still with the xxhash algorithms),
so one engine process would never find what another saved. The connector therefore keys blocks with its own
chain, computed in the scheduler process from what vLLM's hash covers:

    key[i] = SHA-256(key[i-1] | "T" u32 count, the block's token ids as u32 LE | extra keys)
    key[-1] = SHA-256("orbitkv.vllm.block-keys.v1" | epoch)

The extra keys are those vLLM mixes into its hash (``generate_block_hash_extra_keys``): the LoRA adapter's name,
each multimodal item overlapping the block (its identifier and offset from the block start) and the cache salt on
the first block, each tagged and length-prefixed. Requests whose hash depends on something the connector cannot
name exactly (prompt embeddings, an unknown multimodal input shape) get no keys: they are neither looked up nor
saved. The namespace adds everything else (model, weights, layout, rank).

The epoch is the weights epoch (``orbitkv.weights_epoch``, empty by default), which ``reset_cache`` advances: KV
saved before a reset (RL weight sync keeps the weights' path, hence their derived identity) is never hit again by
this engine, while engines that did not reset keep their keys. With a configured epoch, each reset chains it
deterministically (engines that start from one epoch and reset in lockstep share again); without one, a reset
draws a random epoch, shared with nobody.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional

KEY_SCHEME = "sha256-u32-v1"


def key_root(epoch: bytes = b"") -> bytes:
    return hashlib.sha256(b"orbitkv.vllm.block-keys.v1" + epoch).digest()


def next_epoch(epoch: bytes, configured: bool) -> bytes:
    """The epoch after a reset: chained from the configured one, else random."""
    import os

    if configured:
        return hashlib.sha256(b"orbitkv.vllm.epoch-reset" + epoch).digest()
    return os.urandom(32)


def _text(tag: bytes, value: str) -> bytes:
    data = value.encode()
    return tag + struct.pack("<I", len(data)) + data


def _multimodal(request) -> Optional[list]:
    """[(identifier, offset, length)] of the request's multimodal items; None when their shape is unknown."""
    features = getattr(request, "mm_features", None)
    if features:
        items = []
        for feature in features:
            identifier = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
            position = getattr(feature, "mm_position", None)
            offset, length = getattr(position, "offset", None), getattr(position, "length", None)
            if identifier is None or offset is None or length is None:
                return None
            items.append((str(identifier), int(offset), int(length)))
        return sorted(items, key=lambda item: item[1])
    if getattr(request, "mm_hashes", None) or getattr(request, "mm_positions", None):
        return None  # an older Request shape: not keyed rather than keyed wrongly
    return []


class RequestKeys:
    """The keys of one request's full blocks, extended as its tokens grow (tokens are append-only in vLLM)."""

    __slots__ = ("keys", "_root", "_lora", "_salt", "_mm", "ok")

    def __init__(self, request, root: bytes):
        self.keys: list = []
        self._root = root
        lora = getattr(request, "lora_request", None)
        name = getattr(lora, "lora_name", None) if lora is not None else None
        self._lora = _text(b"L", str(name)) if name else b""
        salt = getattr(request, "cache_salt", None)
        self._salt = _text(b"S", str(salt)) if salt else b""
        mm = _multimodal(request)
        self.ok = mm is not None and getattr(request, "prompt_embeds", None) is None
        self._mm = mm or []

    def extend(self, tokens, block_size: int) -> list:
        if not self.ok:
            return self.keys
        full = len(tokens) // block_size
        if full <= len(self.keys):
            return self.keys
        parent = self.keys[-1] if self.keys else self._root
        header = b"T" + struct.pack("<I", block_size)
        for index in range(len(self.keys), full):
            start = index * block_size
            block = tokens[start:start + block_size]
            h = hashlib.sha256(parent)
            h.update(header)
            h.update(struct.pack(f"<{block_size}I", *block))
            if self._lora:
                h.update(self._lora)
            for identifier, offset, length in self._mm:
                if offset < start + block_size and offset + length > start:
                    h.update(_text(b"M", identifier) + struct.pack("<q", offset - start))
            if index == 0 and self._salt:
                h.update(self._salt)
            parent = h.digest()
            self.keys.append(parent)
        return self.keys


class KeyCache:
    """Per-request keys, kept while the scheduler tracks the request."""

    def __init__(self, block_size: int, hash_block_size: int, epoch: bytes = b""):
        self.block_size = block_size
        self.hash_block_size = hash_block_size  # tokens per vLLM block hash
        self.root = key_root(epoch)
        self._requests: dict[str, RequestKeys] = {}

    def new_epoch(self, epoch: bytes) -> None:
        """Every key from now on chains from ``epoch``; keys computed before are forgotten."""
        self.root = key_root(epoch)
        self._requests.clear()

    def keys(self, request) -> list:
        """The keys of the request's full blocks that may be stored or looked up (``num_publishable_block_hashes``,
        where vLLM has it, in vLLM's hash blocks, limits them)."""
        entry = self._requests.get(request.request_id)
        if entry is None:
            entry = self._requests[request.request_id] = RequestKeys(request, self.root)
        keys = entry.extend(request.all_token_ids, self.block_size)
        limit = getattr(request, "num_publishable_block_hashes", None)
        if limit is not None:
            keys = keys[:limit * self.hash_block_size // self.block_size]
        return keys

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
