"""Which weights an engine serves, derived from what vLLM loaded (the namespace's model id and weights revision).

``vllm serve ORG/NAME`` leaves ``model_config.revision`` None and ``model_config.model`` may be a local path, so
neither names the weights by itself. The identity is, in order:

1. explicit ``orbitkv.model_id`` / ``orbitkv.weights_revision`` (overrides);
2. a Hugging Face repository id: its commit, read from the hub cache (``refs/<revision or main>``, or a 40-digit
   revision given as is), where vLLM downloaded it before the connector starts; a ``--revision`` that is not in
   the cache (another loader) is taken as given;
3. a path inside a hub-cache snapshot (``.../models--ORG--NAME/snapshots/<commit>``): the repository and commit it
   names, so two hosts with different cache roots still agree;
4. any other local directory or file: ``weights-sha256`` and a digest of the weights themselves (every file's name
   and size, each safetensors header in full, and 16 samples of 4 KiB spread over every weight file), which differs
   for any two fine-tunes of one architecture. It is cached by path, size and mtime (in memory and in
   ``$XDG_CACHE_HOME/orbitkv/weights-digest.json``), so a restart does not read the weights again.

The model name alone is never an identity: when none of these can be found the connector refuses to start and says
which key to set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("orbitkv.vllm")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
_CONFIG_FILES = ("config.json", "generation_config.json", "params.json")
_SAMPLES = 16
_SAMPLE_BYTES = 4096
_SAFETENSORS_HEADER_MAX = 256 << 20


@dataclass(frozen=True)
class WeightsIdentity:
    model_id: str
    revision: str
    source: str  # how it was found, for the log and `orbitkv status`

    def __str__(self) -> str:
        return f"{self.model_id}@{self.revision} ({self.source})"


def hub_cache_dirs(download_dir: Optional[str] = None) -> list[str]:
    """Where huggingface_hub keeps repositories, in the order vLLM would use them."""
    dirs = []
    if download_dir:
        dirs.append(download_dir)
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        dirs.append(env)
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    dirs.append(os.path.join(home, "hub"))
    seen, unique = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            unique.append(d)
    return unique


def _snapshot_of_path(path: str) -> Optional[tuple[str, str]]:
    """(repo id, commit) when ``path`` lies inside a hub-cache snapshot directory."""
    for candidate in (os.path.abspath(path), os.path.realpath(path)):
        parts = candidate.split(os.sep)
        for i in range(len(parts) - 2):
            if parts[i].startswith("models--") and parts[i + 1] == "snapshots" and _COMMIT.match(parts[i + 2]):
                return parts[i][len("models--"):].replace("--", "/"), parts[i + 2]
    return None


def _commit_in_cache(repo: str, revision: Optional[str], download_dir: Optional[str]) -> Optional[str]:
    folder = "models--" + repo.replace("/", "--")
    ref = revision or "main"
    for root in hub_cache_dirs(download_dir):
        base = os.path.join(root, folder)
        if not os.path.isdir(base):
            continue
        if _COMMIT.match(ref) and os.path.isdir(os.path.join(base, "snapshots", ref)):
            return ref
        try:
            with open(os.path.join(base, "refs", ref)) as f:
                commit = f.read().strip()
        except OSError:
            continue
        if _COMMIT.match(commit):
            return commit
    return None


# ---- the weights digest ---------------------------------------------------------------------------------------

_digest_lock = threading.Lock()
_digest_memory: dict = {}


def _cache_file() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "orbitkv", "weights-digest.json")


def _load_disk_cache() -> dict:
    try:
        with open(_cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_disk_cache(key: str, digest: str) -> None:
    path = _cache_file()
    try:
        data = _load_disk_cache()
        data[key] = digest
        if len(data) > 256:
            data = dict(list(data.items())[-256:])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as error:  # a read-only home only costs a re-read next start
        log.debug("orbitkv: cannot write %s: %s", path, error)


def _weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(_WEIGHT_SUFFIXES) or name in _CONFIG_FILES:
                files.append(os.path.join(dirpath, name))
    return files


def _file_digest(h, path: str, rel: str) -> None:
    size = os.path.getsize(path)
    h.update(struct.pack("<Q", len(rel.encode())) + rel.encode() + struct.pack("<Q", size))
    with open(path, "rb") as f:
        if os.path.basename(path) in _CONFIG_FILES:
            h.update(f.read(1 << 20))
            return
        if path.endswith(".safetensors") and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len <= min(size - 8, _SAFETENSORS_HEADER_MAX):
                h.update(f.read(header_len))
        for i in range(_SAMPLES):
            offset = (size - _SAMPLE_BYTES) * i // (_SAMPLES - 1) if size > _SAMPLE_BYTES else 0
            f.seek(max(0, offset))
            h.update(f.read(_SAMPLE_BYTES))


def weights_digest(path: str) -> Optional[str]:
    """The hex SHA-256 identifying the weights at ``path`` (a directory or one file); None without weight files."""
    files = _weight_files(path)
    if not any(f.endswith(_WEIGHT_SUFFIXES) for f in files):
        return None
    stats = [(f, os.stat(f)) for f in files]
    key = json.dumps([os.path.abspath(path)] + [[os.path.relpath(f, path) if f != path else os.path.basename(f),
                                                  s.st_size, s.st_mtime_ns] for f, s in stats])
    key = hashlib.sha256(key.encode()).hexdigest()
    with _digest_lock:
        if key in _digest_memory:
            return _digest_memory[key]
        cached = _load_disk_cache().get(key)
        if isinstance(cached, str) and re.match(r"^[0-9a-f]{64}$", cached):
            _digest_memory[key] = cached
            return cached
        h = hashlib.sha256(b"orbitkv.weights.v1")
        for f, _ in stats:
            _file_digest(h, f, os.path.relpath(f, path) if f != path else os.path.basename(f))
        digest = h.hexdigest()
        _digest_memory[key] = digest
        _store_disk_cache(key, digest)
        return digest


# ---- resolution -----------------------------------------------------------------------------------------------


def resolve_weights(model: str, revision: Optional[str], download_dir: Optional[str] = None) -> Optional[
        WeightsIdentity]:
    """The identity of the weights vLLM loaded for ``model`` (``model_config.model``) at ``revision``."""
    if os.path.exists(model):
        snapshot = _snapshot_of_path(model)
        if snapshot is not None:
            return WeightsIdentity(snapshot[0], snapshot[1], "hub-cache snapshot path")
        digest = weights_digest(model)
        if digest is None:
            return None
        return WeightsIdentity("weights-sha256", digest, f"digest of the weights in {model}")
    commit = _commit_in_cache(model, revision, download_dir)
    if commit is not None:
        return WeightsIdentity(model, commit, f"hub cache, revision {revision or 'main'}")
    if revision and _COMMIT.match(revision):
        return WeightsIdentity(model, revision, "revision given as a commit")
    if revision:  # pinned by the user (--revision), but not in the hub cache (ModelScope, another loader)
        return WeightsIdentity(model, revision, "revision as given (not found in the hub cache)")
    return None


def tokenizer_identity(tokenizer: Optional[str], tokenizer_revision: Optional[str], model: str,
                       weights: WeightsIdentity, download_dir: Optional[str] = None) -> str:
    """The tokenizer as the namespace names it: the weights' identity when it is the model's own."""
    if not tokenizer or tokenizer == model:
        return f"{weights.model_id}@{weights.revision}"
    if os.path.exists(tokenizer):
        snapshot = _snapshot_of_path(tokenizer)
        if snapshot is not None:
            return f"{snapshot[0]}@{snapshot[1]}"
        h = hashlib.sha256(b"orbitkv.tokenizer.v1")
        folder = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
        for name in sorted(os.listdir(folder)):
            full = os.path.join(folder, name)
            if os.path.isfile(full) and (name.startswith(("tokenizer", "vocab", "merges", "special_tokens"))
                                         or name.endswith((".model", ".tiktoken"))):
                with open(full, "rb") as f:
                    h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        return f"tokenizer-sha256@{h.hexdigest()}"
    commit = _commit_in_cache(tokenizer, tokenizer_revision, download_dir)
    return f"{tokenizer}@{commit or tokenizer_revision or weights.revision}"
