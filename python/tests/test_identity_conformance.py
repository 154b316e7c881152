"""Identity conformance (issue 59): one case per public report of wrong KV reuse between engines, each checked
twice: the two engines of the report get different namespaces (or keys) here, and with the binding that prevents it
taken out (monkeypatched away) they collide, so each case is known to test that binding. Then the cases that must
still share: the same weights and computation with another download path, context length, batch limits, memory
fraction or sampling defaults.

The engines are the harnesses' (vLLM at 6adad087: ``vllm_harness.config.ModelConfig`` loads config.json and applies
``hf_overrides`` as vLLM does; SGLang's ServerArgs and HiCache storage config at 2026-08-22).
"""

import hashlib
import json
import os

import pytest
import torch

from orbitkv.config_digest import computation_digest
from orbitkv.vllm import computation, keys as vllm_keys
from orbitkv.vllm import config as vllm_config_module
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.identity import WeightsIdentity
from orbitkv.vllm.keys import KeyCache
from vllm_harness.config import hub_fetch
from vllm_harness.engine import vllm_config
from vllm_harness.models import SyntheticModel
from vllm_harness.request import LoRARequest, Request, SamplingParams

KV = SyntheticModel(2).kv_cache_config(16)

# Qwen3-0.6B's config.json as the hub has it (the fields that matter here), transformers 4 spelling.
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "head_dim": 128,
         "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 28,
         "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None,
         "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "vocab_size": 151936}


def hub_model(repo: str, config: dict, revision=None) -> str:
    snapshot = hub_fetch(repo, revision)
    with open(os.path.join(snapshot, "config.json"), "w") as f:
        json.dump(config, f)
    return repo


def namespace(model: str, **kw) -> bytes:
    return OrbitKVConfig.from_vllm(vllm_config("/nonexistent.sock", model=model, **kw), KV).namespace(0, 1, 0, 1)


def without_factor(monkeypatch, *names):
    """Takes `names` out of the computation digest (the model config with "hf_config")."""
    real = computation.factors

    def reduced(cfg):
        model_config, other = real(cfg)
        for name in names:
            other.pop(name, None)
        return (None if "hf_config" in names else model_config), other

    monkeypatch.setattr(computation, "factors", reduced)


# ---- vLLM -------------------------------------------------------------------------------------------------------

def test_vllm_56311_rope_scaling_override_does_not_share(monkeypatch):
    """vLLM #56311: the same checkpoint restarted with hf_overrides={"rope_scaling": linear factor 2} reused 1,168
    tokens cached under factor 1 and changed the output."""
    model = hub_model("conf/qwen3-rope", QWEN3)
    factor = lambda f: {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": f}}}  # noqa: E731
    one, two = namespace(model, model_options=factor(1.0)), namespace(model, model_options=factor(2.0))
    plain = namespace(model)
    assert one != two and two != plain
    without_factor(monkeypatch, "hf_config", "hf_text_config")
    assert namespace(model, model_options=factor(1.0)) == namespace(model, model_options=factor(2.0))


def test_vllm_flat_overrides_and_callables_bind_too(monkeypatch):
    """Overrides that are not dicts go through config.update (get_config); a callable rewrites the config."""
    model = hub_model("conf/qwen3-flat", QWEN3)
    base = namespace(model)
    assert namespace(model, model_options={"hf_overrides": {"max_position_embeddings": 131072}}) != base

    def swa(config):
        config.sliding_window = 4096
        return config

    assert namespace(model, model_options={"hf_overrides": swa}) != base


def test_vllm_quantized_weights_do_not_share_with_bf16(monkeypatch):
    """Issue 59: one server with --quantization fp8, one in bf16, same weights revision: other KV."""
    model = hub_model("conf/qwen3-quant", QWEN3)
    assert namespace(model, model_options={"quantization": "fp8"}) != namespace(model)
    without_factor(monkeypatch, "quantization")
    assert namespace(model, model_options={"quantization": "fp8"}) == namespace(model)


def test_vllm_49261_another_revision_of_the_same_repository_does_not_share(monkeypatch):
    """vLLM #49261: two deployments of different revisions of one repository shared a namespace."""
    model = hub_model("conf/qwen3-rev", QWEN3, revision="v1")
    hub_model("conf/qwen3-rev", QWEN3, revision="v2")
    assert namespace(model, revision="v1") != namespace(model, revision="v2")
    monkeypatch.setattr(vllm_config_module, "_weights_identity",
                        lambda *a, **k: WeightsIdentity("conf/qwen3-rev", "main", "test"))
    assert namespace(model, revision="v1") == namespace(model, revision="v2")


def test_vllm_55904_another_kv_layout_does_not_share(monkeypatch):
    """vLLM #55904: a run with another KV cache layout hit every block of the first and generated garbage."""
    model = hub_model("conf/qwen3-layout", QWEN3)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    nhd = namespace(model)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    assert namespace(model) != nhd
    monkeypatch.setattr(vllm_config_module, "kv_cache_layout", lambda: "NHD")
    assert namespace(model) == nhd


def test_vllm_44701_a_lora_name_never_collides_with_a_cache_salt(monkeypatch):
    """vLLM #44701: a LoRA request named X and a base-model request with cache_salt X hashed the same first block
    (one untagged tuple of extra keys)."""
    tokens = list(range(1000, 1064))

    def first_key(**kw):
        lora = kw.pop("lora", None)
        request = Request("r", tokens, SamplingParams(), None, **kw)
        request.lora_request = lora
        return KeyCache(16, 16).keys(request)[0]

    lora = first_key(lora=LoRARequest("COLLIDE_SALT", 1, "/adapters/x"))
    salted = first_key(cache_salt="COLLIDE_SALT")
    assert lora != salted != first_key()
    monkeypatch.setattr(vllm_keys, "_text", lambda tag, value: value.encode())  # untagged, as vLLM's tuple
    assert first_key(lora=LoRARequest("COLLIDE_SALT", 1, "/adapters/x")) == first_key(cache_salt="COLLIDE_SALT")


def test_vllm_longrope_binds_the_long_factor_switch(monkeypatch):
    """vLLM builds LongRoPE's long factors when max_model_len passes original_max_position_embeddings (#56311's
    second finding): that switch is bound, the length itself is not."""
    config = dict(QWEN3, rope_scaling={"type": "longrope", "original_max_position_embeddings": 4096,
                                       "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    model = hub_model("conf/phi-longrope", config)
    short = namespace(model, model_options={"max_model_len": 4096})
    assert namespace(model, model_options={"max_model_len": 2048}) == short
    assert namespace(model, model_options={"max_model_len": 131072}) != short
    without_factor(monkeypatch, "longrope_long_factors")
    assert namespace(model, model_options={"max_model_len": 131072}) == namespace(model)


def test_vllm_shares_where_only_paths_limits_and_sampling_differ(tmp_path):
    """Issue 59, item 2: what does not change the KV bytes never splits the namespace."""
    model = hub_model("conf/qwen3-share", QWEN3)
    base = namespace(model)
    assert namespace(model, max_num_seqs=8, budget=8192) == base
    assert namespace(model, model_options={"max_model_len": 4096}) == base
    assert namespace(model, cache_options={"gpu_memory_utilization": 0.5}) == base
    assert namespace(model, model_options={"generation_config": "vllm",
                                           "override_generation_config": {"temperature": 0.2}, "seed": 7,
                                           "enforce_eager": True, "served_model_name": "served"}) == base
    # One commit mounted under two cache roots on two hosts: the same namespace (the config's _name_or_path, a
    # path, is not part of it).
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    paths = []
    for root in ("host-a/hf", "mnt/models"):
        snapshot = tmp_path / root / "models--conf--mounted" / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(QWEN3))
        (snapshot / "model.safetensors").write_bytes(b"\0" * 64)
        paths.append(str(snapshot))
    assert namespace(paths[0]) == namespace(paths[1])
    # transformers 4's rope_theta/rope_scaling and 5's rope_parameters spell one computation...
    v5 = {k: v for k, v in QWEN3.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000}
    v4 = dict(QWEN3, rope_scaling={"type": "linear", "factor": 2.0})
    assert computation_digest(v5, {}) == computation_digest(v4, {})
    # ...while a top-level rope_theta that differs from the one inside rope_parameters is a third (models read
    # either): kept beside it, not folded away.
    assert computation_digest(dict(v5, rope_theta=500000), {}) != computation_digest(v5, {})
    assert computation_digest(dict(v4, rope_theta=500000), {}) != computation_digest(v4, {})


def test_vllm_a_config_the_worker_changes_while_building_the_model_keeps_its_digest():
    """Some models set fields of hf_config while the worker builds them (Llama 4's attn_temperature_tuning,
    MiniMax-M2's max_model_len), after the scheduler's copy was made: the digest comes from what vLLM loads, so the
    scheduler and the workers agree."""
    model = hub_model("conf/qwen3-built", QWEN3)
    cfg = vllm_config(None, model=model, model_options={"hf_overrides": {"rope_scaling": {"rope_type": "linear",
                                                                                          "factor": 2.0}}})
    before = computation.digest(cfg)
    cfg.model_config.hf_config.attn_temperature_tuning = True
    cfg.model_config.hf_config.max_model_len = 4096
    assert computation.digest(cfg) == before


def test_values_without_a_stable_form_are_refused_not_hashed_by_address():
    class Opaque:
        __slots__ = ()

    with pytest.raises(ValueError, match="no stable form"):
        computation_digest({"model_type": "x", "hook": Opaque()}, {})
    assert computation_digest({"model_type": "x", "ids": {3, 1, 2}}, {}) == \
        computation_digest({"model_type": "x", "ids": {2, 3, 1}}, {})


def test_an_explicit_fingerprint_still_wins():
    model = hub_model("conf/qwen3-fp", QWEN3)
    fingerprint = {"orbitkv.model_fingerprint": hashlib.sha256(b"mine").hexdigest()}
    a = namespace(model, extra=fingerprint)
    b = namespace(model, extra=fingerprint, model_options={"quantization": "fp8"})
    assert a == b != namespace(model)


# ---- SGLang -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manager(build_dir):
    from sglang_harness.manager import ManagerProcess

    m = ManagerProcess(build_dir)
    yield m
    m.stop()


def _sglang_backend(socket, args, **extra):
    from orbitkv.sglang import OrbitKVStorage
    from sglang_harness.hicache import ServerArgs
    from orbitkv.sglang._compat import HiCacheStorageConfig
    from sglang_harness.pools import MHATokenToKVPoolHost

    (args or ServerArgs()).install()
    extra_config = {"backend_name": "orbitkv", "module_path": "orbitkv.sglang", "class_name": "OrbitKVStorage",
                    "interface_v1": 1, "socket": socket, "model_revision": "r1", **extra}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=True, is_page_first_layout=False,
                               model_name="conf/sglang-model", extra_config=extra_config)
    pool = MHATokenToKVPoolHost(layer_num=2, head_num=2, head_dim=8, page_size=16, page_num=8,
                                dtype=torch.bfloat16, layout="page_first", shared=True)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(torch.bfloat16))
    storage = OrbitKVStorage(cfg, {})
    storage.register_mem_pool_host(pool)
    return storage


def _sglang_shares(manager, writer_args, reader_args, writer_extra=None, reader_extra=None, tag="x") -> bool:
    """Whether a server started with `reader_args` finds the pages one with `writer_args` stored (token-only page
    hashes, as SGLang at 2026-08-22 computes them)."""
    from sglang_harness.hashing import page_hashes

    hashes = page_hashes(list(range(32)), 16, hashlib.sha256(tag.encode()).hexdigest())
    writer = _sglang_backend(manager.socket, writer_args, **(writer_extra or {}))
    try:
        assert writer.batch_set_v1(hashes, torch.arange(0, 32, dtype=torch.int64)) == [True, True]
    finally:
        writer.close()
    reader = _sglang_backend(manager.socket, reader_args, **(reader_extra or {}))
    try:
        return reader.batch_exists(hashes) == 2
    finally:
        reader.close()


def test_sglang_26747_tenants_with_their_own_scope_never_share(manager):
    """SGLang #26747: HiCache's L3 page keys are token-only (extra_key and cache_salt never reach the backend at
    2026-08-22), so tenant B read tenant A's pages. A server per tenant with its own cache_scope is isolated; without
    the scope (the binding taken out) the tenants share."""
    assert not _sglang_shares(manager, None, None, {"cache_scope": "tenant-a"}, {"cache_scope": "tenant-b"}, "t1")
    assert _sglang_shares(manager, None, None, {"cache_scope": "tenant-a"}, {"cache_scope": "tenant-a"}, "t2")
    assert _sglang_shares(manager, None, None, {}, {}, "t3")  # no scope: the collision the report describes


def test_sglang_binds_the_model_config_it_loaded(manager, monkeypatch):
    """Item 4: SGLang's --json-model-override-args (RoPE scaling) and --quantization change the KV: no sharing;
    with the computation digest taken out, they would share."""
    from orbitkv.sglang import _computation
    from sglang_harness.hicache import ServerArgs

    rope = ServerArgs(json_model_override_args=json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    assert not _sglang_shares(manager, ServerArgs(), rope, tag="s1")
    assert not _sglang_shares(manager, ServerArgs(), ServerArgs(quantization="fp8"), tag="s2")
    # Only what does not change the bytes differs: they share.
    assert _sglang_shares(manager, ServerArgs(), ServerArgs(served_model_name="other-name"), tag="s3")
    monkeypatch.setattr(_computation, "digest", lambda args=None: b"\0" * 32)
    monkeypatch.setattr("orbitkv.sglang.hicache.computation_digest", lambda args=None: b"\0" * 32)
    assert _sglang_shares(manager, ServerArgs(), rope, tag="s4")


def test_sglang_without_its_server_args_never_shares_with_a_default_server(monkeypatch):
    from orbitkv.sglang import _computation
    from sglang_harness.hicache import ServerArgs

    monkeypatch.setattr(_computation, "HAVE_SGLANG", True)
    monkeypatch.setattr(_computation, "server_args", lambda: None)
    assert _computation.digest() != _computation.digest(ServerArgs())
