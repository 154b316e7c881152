"""Streamed remote restore: `CacheManagerClient.query_restore` on Manager b restores a chain that an engine saved
on Manager a (another host: its own peer endpoint and UCX port on loopback) while b's Loading operation still
fetches it, part by part as batches arrive, byte-exact into shuffled, poisoned pages."""

import random

import orbitkv
from cluster_procs import distributed_managers, wait_catalogs_hold_every_block, wait_for
from orbitkv.demo.workload import Engine as KvEngine
from sglang_harness.manager import ManagerProcess

BLOCKS = 24  # 2.25 MiB each: 54 MiB, several 16 MiB fetch batches


def metric(stats: dict, key: str) -> int:
    return int(stats.get(key, 0))


def test_a_remote_chain_is_restored_while_it_arrives(build_dir):
    with distributed_managers(lambda flags: ManagerProcess(build_dir, dram="512MiB", slab="16MiB",
                                                           extra=flags)) as (a, b):
        writer = KvEngine(orbitkv.CacheManagerClient(a.socket), 1, BLOCKS)
        keys = writer.keys(7, BLOCKS, 0, 0)
        for page, key in enumerate(keys):
            writer.compute(key, page)
        written, _ = writer.client.save(writer.instance, [(key, page) for page, key in enumerate(keys)])
        assert written == BLOCKS
        wait_catalogs_hold_every_block([a, b])

        reader = KvEngine(orbitkv.CacheManagerClient(b.socket), 2, BLOCKS + 8)
        pages = random.Random(5).sample(range(BLOCKS + 8), BLOCKS)
        for view in reader.views:
            view[:] = 0xFFFF  # poisoned: a page nobody restored can never pass the check
        restored = reader.client.query_restore(reader.instance, keys, pages, wait=30.0)
        assert restored == BLOCKS
        wrong = [i for i in range(BLOCKS) if not reader.check(keys[i], pages[i])]
        assert wrong == []
        unused = sorted(set(range(BLOCKS + 8)) - set(pages))
        assert all((view[unused] == 0xFFFF).all() for view in reader.views), "a page outside `pages` was written"

        stats = b.stats()
        assert metric(stats, "remote_fetched_blocks") == BLOCKS
        # The first parts were leased and restored while the op still ran: at least one partial answer.
        assert metric(stats, "query_partial_answers") > 0
        assert stats["leases_active"] == 0 and stats["pinned_blocks"] == 0 and stats["operations_active"] == 0
        wait_for(lambda: metric(b.stats(), "remote_staging_bytes") == 0, what="b's staging budget to drain")
        wait_for(lambda: a.stats()["source_sessions"] == 0, what="a to release the grant")

        # The chain is resident on b now: the same call answers from DRAM at once, with no new fetch.
        for view in reader.views:
            view[:] = 0xFFFF
        assert reader.client.query_restore(reader.instance, keys, pages, wait=30.0) == BLOCKS
        assert [i for i in range(BLOCKS) if not reader.check(keys[i], pages[i])] == []
        assert metric(b.stats(), "remote_fetched_blocks") == BLOCKS


def test_query_restore_of_an_unknown_chain_restores_nothing_and_writes_nothing(build_dir):
    with distributed_managers(lambda flags: ManagerProcess(build_dir, dram="256MiB", slab="16MiB",
                                                           extra=flags)) as (a, b):
        wait_for(lambda: all(m.stats()["catalog_streams_streaming"] == 16 * m.stats()["catalog_replicas"]
                             for m in (a, b)),
                 what="the catalog streams")
        reader = KvEngine(orbitkv.CacheManagerClient(b.socket), 2, 4)
        for view in reader.views:
            view[:] = 0xFFFF
        assert reader.client.query_restore(reader.instance, reader.keys(9, 4, 0, 0), [0, 1, 2, 3], wait=2.0) == 0
        assert all((view == 0xFFFF).all() for view in reader.views)
