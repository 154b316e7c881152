"""OrbitKVConnector's contract with vLLM that does not need an engine run: the class vLLM loads by module path,
every abstract and optional method, configuration errors, and how vLLM's KV tensors become Manager pages."""

import inspect
import pickle
import time

import numpy as np
import pytest
import torch

import orbitkv
from orbitkv import shm
from orbitkv.vllm import _compat, layout
from orbitkv.vllm.config import OrbitKVConfig
from orbitkv.vllm.metadata import OrbitKVConnectorMetadata, OrbitKVConnectorStats, OrbitKVWorkerMetadata
from vllm_harness.engine import vllm_config
from vllm_harness.manager import ManagerProcess
from vllm_harness.models import SyntheticModel
from vllm_harness.scheduler import create_connector

SCHEDULER, WORKER = _compat.KVConnectorRole.SCHEDULER, _compat.KVConnectorRole.WORKER


@pytest.fixture()
def manager(build_dir):
    m = ManagerProcess(build_dir / "src" / "server" / "orbitkv-manager")
    yield m
    m.close()


def test_loaded_by_module_path_with_every_method_vllm_calls():
    import importlib

    module = importlib.import_module("orbitkv.vllm")  # what kv_connector_module_path resolves
    cls = getattr(module, "OrbitKVConnector")
    assert issubclass(cls, _compat.KVConnectorBase_V1) and issubclass(cls, _compat.SupportsHMA)
    assert not inspect.isabstract(cls), "an abstract method is left unimplemented"
    assert list(inspect.signature(cls.__init__).parameters) == ["self", "vllm_config", "role", "kv_cache_config"]
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "request_finished_all_groups", "take_events",
                 "get_kv_connector_stats", "register_kv_caches", "handle_preemptions", "start_load_kv",
                 "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                 "get_block_ids_with_load_errors", "build_connector_worker_meta",
                 "get_kv_connector_kv_cache_events", "bind_gpu_block_pool", "on_new_request",
                 "has_pending_push_work", "reset_cache", "shutdown", "get_finished_count"):
        assert callable(getattr(cls, name)), name
    assert cls.get_required_kvcache_layout(None) is None
    assert cls.requires_piecewise_for_cudagraph({}) is False
    rebuilt = cls.build_kv_connector_stats({"hit_tokens": 32, "lookup_tokens": 64})
    assert isinstance(rebuilt, OrbitKVConnectorStats) and rebuilt.reduce()["hit_rate"] == 0.5


def test_both_roles_construct_against_a_manager_and_are_best_effort(manager):
    model = SyntheticModel(2)
    kv_config = model.kv_cache_config(32)
    config = vllm_config(manager.socket)
    sched = create_connector(config, SCHEDULER, kv_config)
    worker = create_connector(config, WORKER, kv_config)
    assert sched.requires_kv_delivery is False and sched.prefer_cross_layer_blocks is False
    worker.register_kv_caches(model.bind(kv_config))
    stats = manager.stats()
    assert stats["leases_active"] == 0
    # Metadata crosses process boundaries: it must survive pickle.
    meta = pickle.loads(pickle.dumps(OrbitKVConnectorMetadata(saves={0: [(0, 3, b"h" * 32)]})))
    assert meta.saves == {0: [(0, 3, b"h" * 32)]}
    merged = OrbitKVWorkerMetadata()
    merged.stored[(0, b"a")] += 1
    other = OrbitKVWorkerMetadata()
    other.stored[(0, b"a")] += 1
    assert merged.aggregate(other).stored[(0, b"a")] == 2
    sched.shutdown()
    worker.shutdown()


def test_shared_options_have_one_name_in_both_adapters(manager):
    """The options the SGLang backend also takes are accepted in its spelling too; both at once is an error."""
    kv_config = SyntheticModel(2).kv_cache_config(16)
    aliased = vllm_config(None)
    from vllm_harness.config import KVTransferConfig
    aliased.kv_transfer_config = KVTransferConfig(
        kv_connector="OrbitKVConnector", kv_connector_module_path="orbitkv.vllm", kv_role="kv_both",
        kv_connector_extra_config={"orbitkv.socket": manager.socket, "orbitkv.model_revision": "r7",
                                   "orbitkv.reconnect_interval_ms": 250})
    cfg = OrbitKVConfig.from_vllm(aliased, kv_config)
    assert cfg.socket_path == manager.socket
    assert cfg.identity["weights_revision"] == "r7"
    assert cfg.reconnect_interval_s == pytest.approx(0.25)
    with pytest.raises(ValueError, match="not both"):
        OrbitKVConfig.from_vllm(vllm_config(manager.socket, extra={"orbitkv.socket": manager.socket}), kv_config)


def test_configuration_errors_are_clear(manager, tmp_path):
    kv_config = SyntheticModel(2).kv_cache_config(16)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key 'orbitkv.sockt_path'"):
        OrbitKVConfig.from_vllm(vllm_config(manager.socket, extra={"orbitkv.sockt_path": "x"}), kv_config)
    with pytest.raises(ValueError, match="orbitkv.mode"):
        OrbitKVConfig.from_vllm(vllm_config(manager.socket, extra={"orbitkv.mode": "sideways"}), kv_config)
    with pytest.raises(ValueError, match="orbitkv.timeout_ms"):
        OrbitKVConfig.from_vllm(vllm_config(manager.socket, extra={"orbitkv.timeout_ms": "soon"}), kv_config)
    with pytest.raises(ValueError, match="model_fingerprint"):
        OrbitKVConfig.from_vllm(vllm_config(manager.socket, extra={"orbitkv.model_fingerprint": "abc"}), kv_config)
    # Keys of other connectors (MultiConnector passes one dict) are ignored.
    cfg = OrbitKVConfig.from_vllm(vllm_config(manager.socket, extra={"lmcache.chunk": 256}), kv_config)
    assert cfg.load_enabled and cfg.save_enabled
    producer = OrbitKVConfig.from_vllm(vllm_config(manager.socket, role="kv_producer"), kv_config)
    assert producer.save_enabled and not producer.load_enabled
    missing = str(tmp_path / "nobody.sock")
    with pytest.raises(orbitkv.ManagerUnavailable, match="orbitkv.socket_path"):
        create_connector(vllm_config(missing), SCHEDULER, kv_config)
    # Not required: the engine serves (no hits) until a Manager appears.
    lenient = create_connector(vllm_config(missing, extra={"orbitkv.require_manager": "false"}), SCHEDULER,
                               kv_config)

    class R:
        request_id, num_tokens, block_hashes = "r", 64, [bytes([i]) * 32 for i in range(4)]
        all_token_ids = list(range(64))

    assert lenient.get_num_new_matched_tokens(R(), 0) == (0, False)


def test_namespace_binds_every_identity_field(manager):
    kv_config = SyntheticModel(2).kv_cache_config(16)
    base = OrbitKVConfig.from_vllm(vllm_config(manager.socket), kv_config)
    ns = base.namespace(0, 1, 0, 1)
    assert base.namespace(0, 2, 0, 1) != ns and base.namespace(1, 2, 0, 1) != base.namespace(0, 2, 0, 1)
    for change in (dict(model="other/model"), dict(revision="v2"), dict(block_size=32),
                   dict(dtype=torch.float16), dict(extra={"orbitkv.cache_scope": "tenant-a"})):
        other_kv = SyntheticModel(2, block_size=change.get("block_size", 16)).kv_cache_config(16)
        other = OrbitKVConfig.from_vllm(vllm_config(manager.socket, **change), other_kv)
        assert other.namespace(0, 1, 0, 1) != ns, change
    # Keys are OrbitKV's own chain over the token ids: vLLM's hash algorithm does not change what they name.
    cbor = OrbitKVConfig.from_vllm(vllm_config(manager.socket, hash_algo="sha256_cbor"), kv_config)
    assert cbor.namespace(0, 1, 0, 1) == ns
    hybrid = OrbitKVConfig.from_vllm(vllm_config(manager.socket),
                                     SyntheticModel(2, windows=[32, None]).kv_cache_config(16))
    assert hybrid.namespace(0, 1, 0, 1) != ns
    assert [(g.group, g.kind, g.window) for g in hybrid.groups] == [(0, "prefix", 0), (1, "window", 32)]


def _filled(shape, dtype=torch.bfloat16, memory="shm"):
    if memory == "shm":
        t = shm.empty(shape, "bfloat16" if dtype == torch.bfloat16 else "float32", like="torch")
    else:  # an ordinary tensor, as vLLM allocates its KV caches
        t = torch.empty(shape, dtype=dtype)
    t.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).copy_(
        torch.arange(t.numel(), dtype=torch.int32).view(shape).to(
            torch.int16 if dtype == torch.bfloat16 else torch.int32))
    return t


def _in_shm(array) -> bool:
    try:
        shm.buffer_of(array)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("memory", ["shm", "ordinary"])
@pytest.mark.parametrize("name", ["nhd", "hnd"])
def test_page_views_of_vllm_packed_layouts(name, memory):
    nb, bs, heads, d2 = 6, 16, 2, 16
    physical = _filled((nb, bs, heads, d2) if name == "nhd" else (nb, heads, bs, d2), memory=memory)
    logical = physical.permute(0, 2, 1, 3) if name == "nhd" else physical  # vLLM's logical (nb, H, bs, 2D)
    views = layout.page_views("l0", logical, nb)
    assert len(views) == 1 and views[0].shape == (nb, bs * heads * d2 * 2)
    assert views[0].ctypes.data == physical.data_ptr()  # views of the layer's own memory, never copies
    assert _in_shm(views[0]) == (memory == "shm")  # what register_group maps, or registers as process memory
    for b in range(nb):
        assert views[0][b].tobytes() == physical[b].contiguous().view(torch.uint8).numpy().tobytes()
    later = layout.page_views("l0", logical[1:], nb - 1)[0]  # a view that starts inside its storage
    assert later.ctypes.data == physical[1].data_ptr() and later.shape == (nb - 1, views[0].shape[1])
    assert later[0].tobytes() == views[0][1].tobytes()
    physical[nb - 1].zero_()
    assert not views[0][nb - 1].any() and views[0][nb - 2].any()


@pytest.mark.parametrize("memory", ["shm", "ordinary"])
def test_page_views_of_split_planes_and_small_kernel_blocks(memory):
    nb = 5
    split = _filled((2, nb, 16, 2, 8), memory=memory)  # K plane, V plane (vLLM before 2026-05)
    views = layout.page_views("l0", split, nb)
    assert len(views) == 2
    assert views[1][3].tobytes() == split[1, 3].contiguous().view(torch.uint8).numpy().tobytes()
    kernel = _filled((nb * 2, 8, 2, 16), memory=memory)  # kernel blocks of 8 tokens under 16-token scheduler blocks
    merged = layout.page_views("l0", kernel, nb)
    assert len(merged) == 1
    assert merged[0][2].tobytes() == kernel[4:6].contiguous().view(torch.uint8).numpy().tobytes()
    gapped = _filled((nb * 2, 2, 8, 16), memory=memory)[:, 0]  # kernel blocks with gaps: one view per sub-block
    apart = layout.page_views("l0", gapped, nb)
    assert len(apart) == 2 and [v.shape for v in apart] == [(nb, 8 * 16 * 2)] * 2
    assert apart[1][2].tobytes() == gapped[5].contiguous().view(torch.uint8).numpy().tobytes()


def test_page_views_refuse_what_the_manager_cannot_map():
    with pytest.raises(NotImplementedError, match="keeps its KV cache on meta.*GPU path"):
        layout.page_views("l0", torch.empty(4, 16, 2, 16, device="meta"), 4)
    for memory in ("shm", "ordinary"):
        padded = _filled((4, 16, 2, 20), memory=memory)[..., :16]  # a page with holes
        with pytest.raises(ValueError, match="not one contiguous run"):
            layout.page_views("l0", padded, 4)
    with pytest.raises(ValueError, match="counts 5 blocks"):
        layout.page_views("l0", torch.zeros(4, 16, 2, 16), 5)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        layout.page_views("l0", np.zeros((4, 16)), 4)


def test_worker_registers_ordinary_tensors_and_refuses_mixed_or_wrong_ones(manager):
    model = SyntheticModel(2)
    kv_config = model.kv_cache_config(16)
    worker = create_connector(vllm_config(manager.socket), WORKER, kv_config)
    plain = {name: torch.zeros(16, 2, 16, 16, dtype=torch.bfloat16) for name in model.layer_names}
    worker.register_kv_caches(plain)  # vLLM's own CPU tensors: registered as this process's memory
    assert worker._worker.block_bytes == {0: 2 * 2 * 16 * 16 * 2}
    assert worker._worker.link.client() is not None  # connected, so register_group ran (and the Manager probed)
    assert len(worker._worker.views[0]) == 2 and not any(_in_shm(v) for v in worker._worker.views[0])
    mixed = dict(plain)
    mixed[model.layer_names[1]] = shm.zeros((16, 2, 16, 16), "bfloat16", like="torch")
    with pytest.raises(ValueError, match="all be in orbitkv.shm shared memory, or none"):
        worker.register_kv_caches(mixed)
    wrong = {name: shm.empty((16, 2, 16, 8), "bfloat16", like="torch") for name in model.layer_names}
    with pytest.raises(ValueError, match="bytes per block but its KV spec says"):
        worker.register_kv_caches(wrong)
    worker.shutdown()


def test_stats_merge_and_reduce():
    a = OrbitKVConnectorStats()
    a.add("restored_bytes", 2_000_000_000)
    a.add("restore_seconds", 1.0)
    b = OrbitKVConnectorStats()
    b.add("restored_bytes", 2_000_000_000)
    b.add("restore_seconds", 1.0)
    assert not a.is_empty() and OrbitKVConnectorStats().is_empty()
    reduced = a.aggregate(b).reduce()
    assert reduced["restored_bytes"] == 4_000_000_000 and np.isclose(reduced["restore_gb_per_s"], 2.0)


def test_a_manager_that_refuses_on_reconnect_is_a_warning_once(manager, caplog):
    from orbitkv.vllm.manager_link import VllmLink

    refusals = []

    def on_connect(client):
        if refusals:
            raise orbitkv.OrbitKVError(refusals[0])

    link = VllmLink(manager.socket, 2000, 16, require=True, reconnect_interval_s=0.0, on_connect=on_connect)
    refusals.append("cannot read engine process 1 at 0x1000: Operation not permitted")
    link.failed(orbitkv.ManagerUnavailable("gone"), link.current)
    with caplog.at_level("DEBUG", logger="orbitkv.vllm"):
        deadline = time.monotonic() + 10
        while link.reconnect_failures < 3:  # the watcher keeps a session ready; each call's replay is refused
            assert link.client() is None
            assert time.monotonic() < deadline, "the link never tried again"
            time.sleep(0.01)
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "refused" in r.getMessage()]
    assert len(warnings) == 1 and "Operation not permitted" in warnings[0].getMessage()
    refusals.clear()
    deadline = time.monotonic() + 10
    while link.client() is None:
        assert time.monotonic() < deadline, "the link never reconnected"
        time.sleep(0.01)
    link.close()


def test_page_views_pass_gpu_tensors_through_once_the_client_registers_them(monkeypatch):
    """When register_group accepts a device's memory (the GPU path), the connector hands it torch views of the
    layer's own memory on that device instead of refusing (a meta tensor stands in for a CUDA one here)."""
    from orbitkv import client

    seen = []
    monkeypatch.setattr(client, "_layout", lambda view: seen.append(view) or (0,) * 7)
    layer = torch.empty(4, 2, 16, 16, dtype=torch.bfloat16, device="meta").permute(0, 2, 1, 3)  # NHD strides
    views = layout.page_views("l0", layer, 4)
    assert len(views) == 1 and isinstance(views[0], torch.Tensor) and views[0].device.type == "meta"
    assert views[0].dtype == torch.uint8 and tuple(views[0].shape) == (4, 2 * 16 * 16 * 2)
    assert views[0].stride() == (2 * 16 * 16 * 2, 1) and seen == views
    assert layout.view_key(views[0])[0] == "meta"


def test_block_sizes_and_per_layer_specs_name_exactly_the_pages(manager):
    from vllm_harness.config import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                     SlidingWindowSpec, UniformTypeKVCacheSpecs)
    from vllm_harness.models import layer_name

    names = [layer_name(0), layer_name(1)]
    small, large = FullAttentionSpec(16, 2, 8, torch.bfloat16), FullAttentionSpec(16, 4, 8, torch.bfloat16)
    tensors = [KVCacheTensor(small.page_size_bytes * 8, [names[0]]), KVCacheTensor(large.page_size_bytes * 8,
                                                                                     [names[1]])]
    worker_kv = KVCacheConfig(8, tensors, [KVCacheGroupSpec(names, UniformTypeKVCacheSpecs(
        16, {names[0]: small, names[1]: large}))])
    scheduler_kv = KVCacheConfig(8, tensors, [KVCacheGroupSpec(names, small)])  # the first layer's spec
    worker_cfg = OrbitKVConfig.from_vllm(vllm_config(manager.socket), worker_kv)
    scheduler_cfg = OrbitKVConfig.from_vllm(vllm_config(manager.socket), scheduler_kv)
    assert worker_cfg.namespace(0, 1, 0, 1) == scheduler_cfg.namespace(0, 1, 0, 1)
    # The worker checks each layer against its own spec (before: both against the summed page size).
    worker = create_connector(vllm_config(manager.socket), _compat.KVConnectorRole.WORKER, worker_kv)
    caches = {names[0]: torch.zeros(8, 16, 2, 16, dtype=torch.bfloat16),
              names[1]: torch.zeros(8, 16, 4, 16, dtype=torch.bfloat16)}
    worker.register_kv_caches(caches)
    assert worker._worker.block_bytes == {0: small.page_size_bytes + large.page_size_bytes}
    worker.shutdown()
    with pytest.raises(ValueError, match="bytes per block"):
        wrong = create_connector(vllm_config(manager.socket), _compat.KVConnectorRole.WORKER, worker_kv)
        wrong.register_kv_caches({names[0]: caches[names[1]], names[1]: caches[names[0]]})

    # Groups on different block sizes cannot share one key per block: refused, saying why.
    mixed = KVCacheConfig(8, tensors, [KVCacheGroupSpec([names[0]], FullAttentionSpec(16, 2, 8, torch.bfloat16)),
                                       KVCacheGroupSpec([names[1]], SlidingWindowSpec(32, 2, 8, torch.bfloat16,
                                                                                      sliding_window=64))])
    with pytest.raises(NotImplementedError, match="different block sizes"):
        OrbitKVConfig.from_vllm(vllm_config(manager.socket), mixed)
