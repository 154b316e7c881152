"""One TP rank of SGLang driving OrbitKVLinker through the pinned wrapper's flow, in its own process with a real
torch.distributed gloo group (the CPU group SGLang gives the cache), for test_sglang_linker's TP=2 cases.

    python linker_tp_rank.py RANK WORLD STORE_FILE SOCKET FAIL_RANK [pinned|verdicts]

Each rank offloads its own shard of 4 pages, matches them (the ranks' MIN intersects the hit), loads them, and
runs one forward pass of layer waits; FAIL_RANK's restores fail (injected: a Manager error on that rank alone).
Prints "COMPLETED" when the forward pass returned (with verdicts: "COMPLETED <the batch's success>"), "RAISED: ..."
when a layer wait raised."""

import datetime
import os
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import orbitkv  # noqa: E402
from orbitkv.sglang import OrbitKVLinker, _compat  # noqa: E402
from orbitkv.sglang._compat import PoolTransfer  # noqa: E402
from sglang_harness.hashing import page_hashes  # noqa: E402
from sglang_harness.linker_wrapper import PINNED, VERDICTS, Wrapper  # noqa: E402
from sglang_harness.pools import MHATokenToKVPool  # noqa: E402

P, LAYERS = 16, 2


def main() -> int:
    rank, world, store, socket, fail_rank = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                            int(sys.argv[5]))
    interface = VERDICTS if len(sys.argv) > 6 and sys.argv[6] == "verdicts" else PINNED
    _compat.set_linker_interface(interface)
    # A file store: no port to pick (a picked free port can be taken before the store binds it).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    pool = MHATokenToKVPool(size=32 * P, page_size=P, layer_num=LAYERS, head_num=1, head_dim=8, shared=True)
    for t in pool.k_buffer + pool.v_buffer:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    params = types.SimpleNamespace(page_size=P, pp_rank=0, pp_size=1, tp_cache_group=dist.group.WORLD,
                                   token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: pool))
    server_args = types.SimpleNamespace(model_path="test/linker-tp", served_model_name=None)
    linker = OrbitKVLinker(server_args, params, extra_config={"socket": socket, "tp_rank": rank, "tp_size": world})
    keys = page_hashes(list(range(4 * P)), P, "ab" * 32)
    slots = torch.arange(0, 4 * P)
    assert linker.offload([PoolTransfer(name="kv", keys=keys, device_indices=slots)])
    deadline = time.monotonic() + 30
    while linker.num_completed_offloads() < 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert linker.pop_completed_offload() is True

    def intersect(mask):
        dist.all_reduce(mask, op=dist.ReduceOp.MIN)
        return mask

    wrapper = Wrapper(linker, interface, page_size=P, intersect=intersect)
    assert wrapper.match("r", keys) == 4, "the ranks should agree on all 4 pages"
    wrapper.load_back("r", 10)
    if rank == fail_rank:
        def failing_restore(*args, **kwargs):
            raise orbitkv.OrbitKVError("injected: this rank's restore failed")

        linker._link.restore = failing_restore
    index = wrapper.start_layer_wise_loading()
    try:
        wrapper.forward(index, LAYERS)
        if interface.verdicts:
            deadline = time.monotonic() + 30
            while linker.num_completed_loads() < 1:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            rids, ok = linker.pop_completed_load()
            print(f"COMPLETED {ok}", flush=True)
        else:
            print("COMPLETED", flush=True)
    except RuntimeError as e:
        print(f"RAISED: {e}", flush=True)
    dist.barrier()
    linker.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
