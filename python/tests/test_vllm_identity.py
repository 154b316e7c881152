"""The vLLM connector's engine identity and keys, with vLLM's defaults (issue 18, items 1 and 1b).

``vllm serve ORG/NAME`` leaves ``model_config.revision`` None; ``model_config.model`` may be a local path; vLLM's
block-hash root is random per process unless PYTHONHASHSEED is set. None of that may stop the connector from
starting or from sharing blocks between processes and hosts, and different weights must never share a block.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from orbitkv.vllm import identity
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.keys import KeyCache
from vllm_harness.config import hub_fetch
from vllm_harness.engine import vllm_config
from vllm_harness.models import SyntheticModel
from vllm_harness.request import Request, SamplingParams, block_hasher

KV = SyntheticModel(2).kv_cache_config(16)


def config_for(model, **kw):
    return OrbitKVConfig.from_vllm(vllm_config("/nonexistent.sock", model=model, **kw), KV)


def weights_dir(path, payload: bytes, name="model.safetensors"):
    """A local model directory: a config and one safetensors file (an 8-byte header length, a JSON header, data)."""
    os.makedirs(path, exist_ok=True)
    header = b'{"w": {"dtype": "BF16", "shape": [4096], "data_offsets": [0, 8192]}}'
    with open(os.path.join(path, name), "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + payload)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"architectures": ["X"]}')
    return str(path)


def test_default_vllm_serve_starts_and_names_the_commit():
    # Before: revision None -> "weights_revision is empty" and the engine did not start.
    cfg = config_for("org/served-model")
    snapshot = hub_fetch("org/served-model", None)
    commit = os.path.basename(snapshot)
    assert cfg.identity["model_id"] == "org/served-model"
    assert cfg.identity["weights_revision"] == commit
    assert cfg.weights.source.startswith("hub cache")
    # --revision v2 is another commit, so another namespace; a commit given as the revision is taken as is.
    other = config_for("org/served-model", revision="v2")
    assert other.identity["weights_revision"] != commit
    assert other.namespace(0, 1, 0, 1) != cfg.namespace(0, 1, 0, 1)
    pinned = config_for("org/served-model", revision=commit)
    assert pinned.namespace(0, 1, 0, 1) == cfg.namespace(0, 1, 0, 1)


def test_a_snapshot_path_is_the_repository_on_every_host(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    host_a = weights_dir(tmp_path / "a" / "models--org--m" / "snapshots" / commit, b"w" * 8192)
    host_b = weights_dir(tmp_path / "mnt" / "hf" / "models--org--m" / "snapshots" / commit, b"w" * 8192)
    a, b = config_for(host_a), config_for(host_b)
    assert a.identity["model_id"] == "org/m" and a.identity["weights_revision"] == commit
    assert a.namespace(0, 1, 0, 1) == b.namespace(0, 1, 0, 1)
    # The identity never contains the local path.
    assert str(tmp_path) not in repr(a.identity)


def test_local_weights_are_named_by_a_digest_of_their_bytes(tmp_path):
    base = weights_dir(tmp_path / "base", b"\x01" * 8192)
    same_elsewhere = weights_dir(tmp_path / "copy" / "of" / "base", b"\x01" * 8192)
    # A fine-tune: same file names, sizes and header, different bytes.
    tuned = weights_dir(tmp_path / "tuned", b"\x01" * 4096 + b"\x02" * 4096)
    a, b, c = config_for(base), config_for(same_elsewhere), config_for(tuned)
    assert a.identity["model_id"] == "weights-sha256"
    assert a.namespace(0, 1, 0, 1) == b.namespace(0, 1, 0, 1)
    assert a.namespace(0, 1, 0, 1) != c.namespace(0, 1, 0, 1)
    assert str(tmp_path) not in repr(a.identity)


def test_the_digest_is_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    path = weights_dir(tmp_path / "m", b"\x05" * 8192)
    first = identity.weights_digest(path)
    identity._digest_memory.clear()
    reads = []
    real = identity._file_digest
    monkeypatch.setattr(identity, "_file_digest", lambda *a: reads.append(a) or real(*a))
    assert identity.weights_digest(path) == first and reads == []  # from the on-disk cache
    # A rewritten file (new mtime) is read again.
    weights_dir(tmp_path / "m", b"\x06" * 8192)
    os.utime(os.path.join(path, "model.safetensors"), ns=(1, 1))
    assert identity.weights_digest(path) != first and reads


def test_unknown_weights_are_refused_with_the_key_to_set(tmp_path):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    with pytest.raises(ValueError, match="orbitkv.weights_revision"):
        config_for(str(empty))
    explicit = config_for(str(empty), extra={"orbitkv.weights_revision": "sha256:abc",
                                             "orbitkv.model_id": "org/m"})
    assert explicit.identity["weights_revision"] == "sha256:abc" and explicit.identity["model_id"] == "org/m"


def _keys(seed, tokens):
    request = Request("r", tokens, SamplingParams(), block_hasher(16, "sha256", seed))
    return request.block_hashes, KeyCache(16, 16).keys(request)


def test_keys_do_not_depend_on_vllms_hash_root():
    tokens = list(range(100, 180))
    hashes_a, keys_a = _keys(None, tokens)  # two processes' random roots
    hashes_b, keys_b = _keys(None, tokens)
    assert hashes_a != hashes_b  # vLLM's own hashes differ...
    assert keys_a == keys_b and len(keys_a) == 5  # ...OrbitKV's keys do not
    # They still chain: a different earlier token changes every later key; the salt changes all of them.
    _, changed = _keys(None, [7] + tokens[1:])
    assert not set(changed) & set(keys_a)
    salted = Request("s", tokens, SamplingParams(), None, cache_salt="tenant")
    assert not set(KeyCache(16, 16).keys(salted)) & set(keys_a)


SAVER = textwrap.dedent("""
    import sys
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from vllm_harness.engine import Engine, vllm_config
    from vllm_harness.models import SyntheticModel
    engine = Engine(vllm_config(sys.argv[1]), lambda rank: SyntheticModel(4), 64)
    engine.add_request("w", list(range(300, 380)), 2)
    engine.run()
    engine.drain(2)
    engine.shutdown()
    print(engine.hasher(type("R", (), {"block_hashes": [], "all_token_ids": list(range(300, 380)),
                                       "cache_salt": None})())[0].hex())
""")


def test_a_prefix_saved_by_another_engine_process_is_restored(build_dir, root):
    from vllm_harness.engine import Engine
    from vllm_harness.manager import ManagerProcess

    manager = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager")
    try:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        out = subprocess.run([sys.executable, "-c", SAVER, manager.socket, str(root / "python"),
                              str(root / "python" / "tests")], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        engine = Engine(vllm_config(manager.socket), lambda rank: SyntheticModel(4), 64)
        request = engine.add_request("r", list(range(300, 380)), 2)
        assert request.block_hashes[0].hex() != out.stdout.strip()  # another process, another hash root
        engine.run()
        engine.drain(2)
        assert engine.worker_stats.data["restored_blocks"] == 4  # (80 - 1) // 16 blocks
        assert sum(w.model.bad_reads for w in engine.workers) == 0
        engine.shutdown()
    finally:
        manager.close()


def test_orbitkv_status_shows_each_instances_identity(build_dir):
    from vllm_harness.engine import Engine
    from vllm_harness.manager import ManagerProcess

    manager = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager")
    try:
        engine = Engine(vllm_config(manager.socket, tp=2, model="org/status-model"), lambda rank: SyntheticModel(
            2, tp_rank=rank), 32)
        commit = os.path.basename(hub_fetch("org/status-model", None))
        out = subprocess.run([str(build_dir / "tools" / "orbitkv"), "status", "--socket", manager.socket],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "4 engine instances registered" in out.stdout  # two workers, two scheduler query instances
        for role, rank in (("worker", 0), ("worker", 1), ("scheduler", 0), ("scheduler", 1)):
            assert (f"vLLM {role} org/status-model@{commit} (hub cache, revision main), bf16, tp {rank}/2, pp 0/1"
                    in out.stdout), out.stdout
        assert len(manager.stats()["instances"]) == 4
        table = subprocess.run([str(build_dir / "tools" / "orbitkv"), "stats", "--socket", manager.socket],
                               capture_output=True, text=True, timeout=30).stdout
        assert table.count(": vLLM worker org/status-model@") == 2 and "\nidentity " not in table, table
        engine.shutdown()
    finally:
        manager.close()
