"""vLLM's scheduler-side ``Request`` and its prefix-cache block hashes (``vllm/v1/request.py``,
``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``).

A block's hash is ``hash_fn((parent_hash or NONE_HASH, tuple(block_token_ids), extra_keys))``; only full blocks are
hashed, at creation for the prompt and whenever output tokens complete a block. ``sha256`` pickles the tuple,
``sha256_cbor`` encodes it as canonical CBOR (the reference engine's encoder, which is vLLM's format).
NONE_HASH is ``hash_fn(seed)`` with the PYTHONHASHSEED-style seed, or 32 random bytes without one.
"""

from __future__ import annotations

import enum
import hashlib
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Optional


def hash_fn(algo: str):
    if algo == "sha256":
        return lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algo == "sha256_cbor":
        from orbitkv.demo.refengine.hashing import cbor_encode

        return lambda obj: hashlib.sha256(cbor_encode(obj)).digest()
    raise ValueError(f"unsupported prefix_caching_hash_algo {algo!r} in the harness")


def none_hash(algo: str, seed: Optional[str]) -> bytes:
    return os.urandom(32) if seed is None else hash_fn(algo)(seed)


def block_hasher(block_size: int, algo: str, seed: Optional[str]):
    """vLLM's ``get_request_block_hasher``: returns the new full blocks' hashes of a request."""
    fn = hash_fn(algo)
    root = none_hash(algo, seed)

    def hasher(request: "Request") -> list[bytes]:
        start = len(request.block_hashes)
        tokens = request.all_token_ids
        new = []
        parent = request.block_hashes[-1] if request.block_hashes else root
        for index in range(start, len(tokens) // block_size):
            block = tuple(tokens[index * block_size:(index + 1) * block_size])
            extra = (request.cache_salt,) if (index == 0 and request.cache_salt) else None
            parent = fn((parent, block, extra))
            new.append(parent)
        return new

    return hasher


@dataclass
class LoRARequest:
    """``vllm/lora/request.py``: a request's adapter; vLLM's prefix cache keys it by ``lora_name`` (since #27211)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass
class SamplingParams:
    max_tokens: int = 16
    extra_args: dict = field(default_factory=dict)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list, sampling_params: SamplingParams,
                 block_hasher=None, *, cache_salt: Optional[str] = None, arrival_time: Optional[float] = None,
                 priority: int = 0, client_index: int = 0):
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list = []
        self._all_token_ids: list = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.lora_request = None
        self.mm_features: list = []
        self.skip_reading_prefix_cache = False
        self.kv_transfer_params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.stop_reason = None
        self.block_hashes: list = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> tuple:
        return tuple(self._output_token_ids)

    @property
    def all_token_ids(self) -> tuple:
        return tuple(self._all_token_ids)

    def append_output_token_ids(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[str]:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self.status)
