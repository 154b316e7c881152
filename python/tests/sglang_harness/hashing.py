"""Test-only: SGLang's L3 page keys (mem_cache/utils.py get_hash_str with page_size), from their documented
definition: key_i = hex SHA-256(raw 32 bytes of key_{i-1} (nothing for the first page unless a prior hash is
given) || the page's token ids as uint32 little-endian). Only whole pages are hashed."""

from __future__ import annotations

import hashlib
import struct
from typing import List, Optional, Sequence


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: Optional[str] = None) -> List[str]:
    out = []
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start:start + page_size]
        digest = hashlib.sha256(prior + struct.pack(f"<{len(page)}I", *page)).digest()
        out.append(digest.hex())
        prior = digest
    return out
