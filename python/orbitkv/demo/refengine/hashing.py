"""Prefix hashes the engines compute: vLLM's chained block hashes and SGLang's chained page hashes.

vLLM (``--prefix-caching-hash-algo sha256_cbor``): hash = SHA-256(canonical CBOR of the array
``[parent_hash, [token ids], extra_keys or null]``), parent of block 0 = NONE_HASH = SHA-256(CBOR text string of
the hash seed). SGLang (HiCache L3 keys): hex SHA-256(previous page's raw 32-byte hash || uint32-LE token ids).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence


def _head(major: int, value: int, out: bytearray) -> None:
    """A CBOR initial byte plus argument in its shortest form (RFC 8949 section 4.2.1)."""
    if value < 24:
        out.append((major << 5) | value)
    elif value < 1 << 8:
        out.append((major << 5) | 24)
        out.append(value)
    elif value < 1 << 16:
        out.append((major << 5) | 25)
        out += value.to_bytes(2, "big")
    elif value < 1 << 32:
        out.append((major << 5) | 26)
        out += value.to_bytes(4, "big")
    elif value < 1 << 64:
        out.append((major << 5) | 27)
        out += value.to_bytes(8, "big")
    else:
        raise ValueError(f"integer {value} does not fit a 64-bit CBOR argument")


def _encode(obj, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            _head(0, obj, out)
        else:
            _head(1, -1 - obj, out)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        _head(2, len(data), out)
        out += data
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _head(3, len(data), out)
        out += data
    elif isinstance(obj, (tuple, list)):
        _head(4, len(obj), out)
        for item in obj:
            _encode(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode a {type(obj).__name__} in a block hash")


def cbor_encode(obj) -> bytes:
    """Deterministic CBOR of None, bool, int, bytes, str and tuples/lists of them (no floats, no maps)."""
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


def none_hash(seed: str = "0") -> bytes:
    """The parent hash of a chain's first block: vLLM's NONE_HASH under sha256_cbor with PYTHONHASHSEED=seed."""
    if not isinstance(seed, str):
        raise TypeError("the hash seed is a string (the value PYTHONHASHSEED would hold)")
    return hashlib.sha256(cbor_encode(seed)).digest()


_seed_hash = none_hash  # vllm_block_hashes's keyword argument of the same name shadows the function


def _extra_keys(block_index: int, lora_name: Optional[str], cache_salt: Optional[str]):
    keys = []
    if lora_name is not None:
        keys.append(lora_name)
    if cache_salt is not None and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def vllm_block_hashes(token_ids: Sequence[int], block_size: int, *, none_hash: Optional[bytes] = None,
                      lora_name: Optional[str] = None, cache_salt: Optional[str] = None,
                      parent: Optional[bytes] = None, first_block: int = 0) -> list:
    """32-byte hashes of the full blocks of ``token_ids`` (a partial last block is not hashed).

    ``token_ids`` starts at block ``first_block`` of the request, whose parent hash is ``parent`` (required when
    ``first_block > 0``); a whole request passes neither. ``none_hash`` defaults to ``none_hash("0")``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if first_block < 0:
        raise ValueError(f"first_block must be >= 0, got {first_block}")
    if first_block > 0 and parent is None:
        raise ValueError("continuing a chain (first_block > 0) needs the parent hash")
    if parent is None:
        parent = none_hash if none_hash is not None else _seed_hash()
    hashes = []
    for i in range(len(token_ids) // block_size):
        tokens = tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size])
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be non-negative")
        parent = hashlib.sha256(
            cbor_encode((parent, tokens, _extra_keys(first_block + i, lora_name, cache_salt)))).digest()
        hashes.append(parent)
    return hashes


def sglang_page_hashes(token_ids: Sequence[int], page_size: int = 64, prior_hash: Optional[str] = None) -> list:
    """Hex SHA-256 keys of the full pages of ``token_ids``, chained from ``prior_hash`` (hex) when given."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    hashes = []
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    for i in range(len(token_ids) // page_size):
        hasher = hashlib.sha256(prior)
        for t in token_ids[i * page_size:(i + 1) * page_size]:
            t = int(t)
            if not 0 <= t < 1 << 32:
                raise ValueError(f"SGLang page hashes take uint32 token ids, got {t}")
            hasher.update(t.to_bytes(4, "little"))
        prior = hasher.digest()
        hashes.append(prior.hex())
    return hashes
