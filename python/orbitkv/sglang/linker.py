"""OrbitKVLinker: SGLang's UnifiedCacheLinker over the OrbitKV Manager (device pages to and from the Manager, no
SGLang host tier).

SGLang's ``UnifiedCacheLinkerWrapper`` drives it from the tree: ``lookup`` when a prefix is matched (every page
it reports is leased in the Manager until loaded or released), ``load`` + ``start_layer_wise_loading`` when the
tree inserts the hit (restores run on a worker thread; the model's layer waits go through
``layer_done_counter``), ``offload`` when a node is backed up (saves on a second worker thread). It is selected by
the ``orbitkv`` radix-cache backend that :mod:`orbitkv.sglang.plugin` registers.

The device pool may be CPU tensors (CPU engines and tests), in ordinary memory or in OrbitKV shared memory, or CUDA
tensors, which the client registers as CUDA IPC buffers and the Manager copies with its own CUDA streams; a client
that cannot register the pool's memory refuses it with NotImplementedError at construction. SGLang gives the linker
no token positions, so each page is its own query (see ``_session.py``, single mode).

CUDA ordering. The Manager copies on its own streams, so the linker orders the scheduler's current stream against
them: ``offload`` records an event on that stream (after the kernels that wrote the pages) and the save thread waits
for it before the Manager reads the pages; ``start_layer_wise_loading`` records one too and the load thread waits
for it before the Manager writes the pages (no kernel queued before the load still reads the slots it reuses).

Thread contract: SGLang calls every method from the scheduler thread. Public methods never raise after
construction; a failure is a shorter lookup, a False, or (for a load that was already promised to the tree) a
failed layer wait, which is what SGLang's own linkers do.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Dict, List, Optional, Tuple

import orbitkv
from orbitkv.link import canonical_options
from orbitkv.sglang._compat import (LinkerCancelOutcome, UnifiedCacheLinker, linker_interface, pool_name_str,
                                    sglang_version)
from orbitkv.sglang._computation import digest as computation_digest
from orbitkv.sglang._layout import describe_device_pool
from orbitkv.sglang._session import Counters, SGLangLink, RateLimitedLog, env_socket, native_key
from orbitkv.sglang.hicache import weights_revision

logger = logging.getLogger("orbitkv.sglang")

__all__ = ["OrbitKVLinker", "LayerDoneCounter"]

_DEVICE = "device"
_SUPPORTED_COMPONENTS = {"FULL"}


class LayerDoneCounter:
    """The object SGLang's KV pool waits on before each layer: ``wait_until(layer)`` returns once the consumer's
    load batch landed that layer (a CPU restore lands every layer at once). A failed batch is reported through
    ``pop_completed_load`` where SGLang takes verdicts (``raise_on_failure`` False): raising mid-forward would crash
    the scheduler at TP=1 and leave the other ranks hanging in a collective at TP>1. Where SGLang takes no verdict
    (the pinned wrapper: ``pop_completed_load() -> list[str]``), the tree has already inserted the pages, so a
    silent completion would serve whatever the GPU slots held: the wait raises instead, and ``agree`` (a MIN over
    the TP group, once per batch at its first wait) makes every rank raise alike, so none is left in a collective
    the others never reach."""

    def __init__(self, num_layers: int, raise_on_failure: bool = False,
                 agree: Optional[Callable[[bool], bool]] = None):
        self.num_layers = num_layers
        self.raise_on_failure = raise_on_failure
        self.producer_index = -1
        self.consumer_index = -1
        self._agree = agree
        self._lock = threading.Lock()
        self._events: Dict[int, threading.Event] = {}
        self._errors: Dict[int, BaseException] = {}
        self._agreed: Dict[int, bool] = {}  # batch -> whether every rank's restore of it succeeded

    def update_producer(self) -> int:
        with self._lock:
            self.producer_index += 1
            self._events[self.producer_index] = threading.Event()
            return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def complete(self, index: int) -> None:
        with self._lock:
            event = self._events.get(index)
        if event is not None:
            event.set()

    def fail(self, index: int, error: BaseException) -> None:
        with self._lock:
            self._errors[index] = error
            event = self._events.get(index)
        if event is not None:
            event.set()

    def wait_until(self, threshold: int) -> None:
        index = self.consumer_index
        with self._lock:
            event = self._events.get(index)
        if event is None:
            return
        event.wait()
        with self._lock:
            error = self._errors.get(index)
            agreed = self._agreed.get(index)
        if self.raise_on_failure and agreed is None:
            agreed = error is None
            if self._agree is not None:
                agreed = self._agree(agreed)  # every rank reaches its first wait of this batch
            with self._lock:
                self._agreed[index] = agreed
        if threshold >= self.num_layers - 1:  # a failed batch stays: each later wait raises again
            with self._lock:
                self._events.pop(index, None)
                self._errors.pop(index, None)
                self._agreed.pop(index, None)
        if self.raise_on_failure and not agreed:
            where = "on this rank" if error is not None else "on another TP rank"
            raise RuntimeError(f"OrbitKV: restoring KV pages from the Manager failed {where}; the pages SGLang "
                               "inserted for this batch were never written") from error

    def reset(self) -> None:
        with self._lock:
            self.producer_index = -1
            self.consumer_index = -1
            self._events.clear()
            self._errors.clear()
            self._agreed.clear()


class _Leased:
    """The pages ``lookup`` found for one request, each leased in the Manager until restored or released, by the
    page's key: SGLang's tree may load any subset of them (only the ranges it adopted)."""

    def __init__(self, leases: Dict[bytes, Tuple[object, int, int]]):
        self.leases = leases  # page key -> (client, instance, lease), in lookup order


def _kv_transfer(transfers):
    for transfer in transfers or []:
        if pool_name_str(transfer.name) == "kv":
            return transfer
    raise ValueError("no KV transfer in the request")


def _rank_agreement(params, ranks: int) -> Optional[Callable[[bool], bool]]:
    """A MIN over the TP cache group of whether a batch's restore succeeded (the group SGLang gives the cache for
    its own CPU all-reduces), or None at one rank or without an initialized group."""
    if ranks <= 1:
        return None
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


class OrbitKVLinker(UnifiedCacheLinker):
    """UnifiedCacheLinker backed by the OrbitKV Manager (constructed by SGLang's linker factory or our plugin)."""

    def __init__(self, server_args, params, *, components=None, extra_config: Optional[dict] = None):
        extra = canonical_options(dict(extra_config or {}))
        names = {getattr(c, "name", str(c)) for c in (components or [])}
        unsupported = sorted(names - _SUPPORTED_COMPONENTS)
        if unsupported:
            raise ValueError(f"OrbitKVLinker supports full-attention KV only; unsupported components: {unsupported}")
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.is_mla = bool(extra.get("is_mla", not hasattr(kvcache, "v_buffer")))
        tp_rank, tp_size = self._tp_shape(params, extra)
        ranks = tp_size  # the ranks that load each batch (an MLA model's replicas too)
        self.is_writer = not self.is_mla or tp_rank == 0
        geometry = describe_device_pool(kvcache, self.page_size, is_mla=self.is_mla,
                                        kv_cache_dtype=extra.get("kv_cache_dtype"))
        model_id = (extra.get("model_id") or getattr(server_args, "served_model_name", None)
                    or getattr(server_args, "model_path", None))
        if not model_id:
            raise ValueError("OrbitKVLinker: no model name; set \"model_id\" in the linker extra config")
        if self.is_mla:
            tp_rank, tp_size = 0, 1
        detail = geometry.detail
        cp_size = int(getattr(params, "attn_cp_size", 1) or 1)
        if cp_size > 1:  # each attention context-parallel rank holds a disjoint slice of every page
            detail += f"/cp{int(getattr(params, 'attn_cp_rank', 0) or 0)}of{cp_size}"
        revision = weights_revision(extra, str(model_id))
        namespace = orbitkv.derive_namespace(
            str(model_id), revision, str(extra.get("tokenizer", model_id)), "sglang",
            cache_scope=str(extra.get("cache_scope", "")), model_digest=computation_digest(server_args),
            dtype=geometry.dtype, layout=geometry.state_layout,
            layout_detail=detail, page_size_tokens=self.page_size, tp_size=tp_size, tp_rank=tp_rank,
            pp_size=int(getattr(params, "pp_size", 1) or 1), pp_rank=int(getattr(params, "pp_rank", 0) or 0))
        self.counters_ = Counters()
        self._log = RateLimitedLog()
        self._link = SGLangLink(extra.get("socket_path") or env_socket(), timeout_ms=int(extra.get("timeout_ms", 10000)),
                                 loading_wait_s=int(extra.get("loading_wait_ms", 100)) / 1000.0,
                                 reconnect_interval_s=float(extra.get("reconnect_interval_s", 1.0)),
                                 identity=f"SGLang linker {model_id}@{revision}, tp "
                                          f"{tp_rank}/{tp_size}",
                                 counters=self.counters_, log=self._log)
        self._link.register(_DEVICE, geometry, namespace)
        first = geometry.buffers[0] if geometry.buffers else None
        self._cuda = first.device if getattr(getattr(first, "device", None), "type", "cpu") == "cuda" else None
        if "lease_ttl_s" in extra:
            logger.warning("OrbitKV: the linker option lease_ttl_s is no longer used: a lookup's pages stay leased "
                           "until its load, the request's release or a reset, on every SGLang version")
        # Lookup tickets held at once, a bound against a wrapper that never loads nor releases what it looked up: over
        # it the oldest ticket is released (counted, logged), and its load, should one still come, fails once submitted.
        self._max_tickets = int(extra.get("max_lookup_tickets", 4096))
        num_layers = len(geometry.buffers) if self.is_mla else len(geometry.buffers) // 2
        interface = linker_interface()
        self._verdicts, self._outcomes = interface.verdicts, interface.cancel_outcomes
        agree = _rank_agreement(params, ranks) if not self._verdicts else None
        if not self._verdicts and ranks > 1 and agree is None:
            logger.warning("OrbitKV: %d TP ranks but no initialized TP cache group to agree on load failures: a "
                           "rank whose restore fails raises in its layer wait alone", ranks)
        self.layer_done_counter = LayerDoneCounter(num_layers, raise_on_failure=not self._verdicts, agree=agree)
        logger.info("OrbitKV: linker on %s; load failures are %s; a request is released through %s",
                    sglang_version(),
                    "reported to the scheduler after the forward pass" if self._verdicts else
                    "raised from the layer wait on every rank (this SGLang takes no verdicts)",
                    "cancel_request (outcomes, rollback)" if self._outcomes else
                    "cancel_queued_load (no rollback: a queued load is kept and lands)")
        self._leased: Dict[str, _Leased] = {}  # lookup tickets: pages leased until loaded or released
        # Loads queued for the next start_layer_wise_loading: (leases, device pages, why it must fail or None).
        self._pending: Dict[str, Tuple[_Leased, List[int], Optional[BaseException]]] = {}
        self._submitted_lock = threading.Lock()
        # Loads handed to the load thread and not yet consumed by pop_completed_load (the wrapper holds its
        # pending load until it pops the completion), by request (a count: one request may be in two batches).
        self._submitted: Dict[str, int] = {}
        self._completed_loads: "queue.Queue[Tuple[List[str], bool]]" = queue.Queue()
        self._completed_offloads: "queue.Queue[bool]" = queue.Queue()
        self._load_queue: "queue.Queue" = queue.Queue()
        self._offload_queue: "queue.Queue" = queue.Queue()
        self._threads = [threading.Thread(target=self._load_loop, daemon=True, name=f"orbitkv-load-tp{tp_rank}"),
                         threading.Thread(target=self._offload_loop, daemon=True, name=f"orbitkv-save-tp{tp_rank}")]
        for thread in self._threads:
            thread.start()
        self._closed = False

    @staticmethod
    def _tp_shape(params, extra) -> Tuple[int, int]:
        if "tp_rank" in extra and "tp_size" in extra:
            return int(extra["tp_rank"]), int(extra["tp_size"])
        try:
            import torch.distributed as dist

            group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
            if dist.is_available() and dist.is_initialized() and group is not None:
                return dist.get_rank(group=group), dist.get_world_size(group=group)
        except ImportError:
            pass
        return int(getattr(params, "tp_rank", 0) or 0), int(getattr(params, "tp_size", 1) or 1)

    # ---- lookup and load ----

    def _release(self, leased: Optional[_Leased]) -> None:
        if leased is None:
            return
        for client, instance, lease in leased.leases.values():
            self._link.release(client, instance, lease)

    def _bound_tickets(self) -> None:
        while len(self._leased) > self._max_tickets:
            rid = next(iter(self._leased))  # the oldest (dicts keep insertion order)
            self._release(self._leased.pop(rid))
            self.counters_.add("lookups_evicted")
            self._log.warning("tickets", "OrbitKV: %d lookups hold pages that no load or release took; the oldest "
                              "(request %r) is released (max_lookup_tickets)", self._max_tickets + 1, rid)

    def lookup(self, rid: str, transfers) -> list:
        leases: Dict[bytes, Tuple[object, int, int]] = {}
        try:
            self._release(self._leased.pop(rid, None))  # the request asked again: its earlier answer goes
            kv = _kv_transfer(transfers)
            # Every key is checked here, where a refusal is still a clean miss: once pages are reported, the tree
            # inserts them and load() must take them.
            natives = [native_key(key) for key in kv.keys or []]
            for native in natives:
                hits, lease, client, instance, _ = self._link.query(_DEVICE, [native])
                if hits == 0:
                    break
                if native in leases:  # the same page twice: one lease is enough
                    self._link.release(client, instance, lease)
                    continue
                leases[native] = (client, instance, lease)
            self.counters_.add("lookup_pages", len(natives))
            self.counters_.add("lookup_hits", len(leases))
            if not leases:
                return []
            self._leased[rid] = _Leased(leases)
        except Exception as e:  # noqa: BLE001
            # The pages found before the failure are leased: give them back (SGLang sees a miss, so no load will).
            self._release(_Leased(leases))
            self.counters_.add("lookup_errors")
            self._log.warning("lookup", "OrbitKV: lookup failed (%s); SGLang sees a miss", e)
            return []
        self._bound_tickets()  # the ticket is stored: what this releases is never released twice
        return list(range(1, len(leases) + 1))

    def load(self, rid: str, transfers) -> bool:
        """Queues the load of pages ``lookup`` reported. It never refuses (SGLang's wrapper treats a False as fatal
        and raises from the scheduler, and its tree already holds the pages): a load that cannot be carried out
        (no lookup ticket for the request, slots and keys that do not match, pages the lookup did not find) is
        accepted and fails after submission, loudly and on every rank, as a failed restore does."""
        leased = self._leased.pop(rid, None)
        if leased is None:
            self.counters_.add("load_errors")
            self._log.warning("load", "OrbitKV: load of request %r, which holds no lookup (never looked up, or "
                              "released); it fails once submitted", rid)
            earlier = self._pending.pop(rid, None)
            if earlier is not None:
                self._release(earlier[0])
            self._pending[rid] = (_Leased({}), [], RuntimeError(f"no lookup of request {rid!r} holds its pages"))
            return True
        earlier = self._pending.pop(rid, None)
        if earlier is not None:  # a second load of one request before the loads start: the earlier one goes
            self._release(earlier[0])
        try:  # everything is checked before any lease moves, so a refusal leaves the ticket whole
            kv = _kv_transfer(transfers)
            keys = [native_key(k) for k in kv.keys or []]
            indices = kv.device_indices
            if hasattr(indices, "device") and indices.device.type != "cpu":
                indices = indices.cpu()
            if len(indices) != len(keys) * self.page_size:
                raise ValueError(f"load of {len(keys)} pages into {len(indices)} slots")
            missing = [k for k in keys if k not in leased.leases]
            if missing:
                raise ValueError(f"load of {len(missing)} pages the lookup did not find")
            if len(set(keys)) != len(keys):
                raise ValueError("load of the same page into two slots")
            # Pair by key: the tree loads only the ranges it adopted (load_back), not always a leading prefix.
            pages = [slot // self.page_size for slot in indices[:: self.page_size].tolist()]
        except Exception as e:  # noqa: BLE001
            self.counters_.add("load_errors")
            self._log.warning("load", "OrbitKV: load of request %r cannot be carried out (%s); it fails once "
                              "submitted", rid, e)
            self._pending[rid] = (leased, [], e)  # its leases are released by the load thread
            return True
        chosen = {k: leased.leases.pop(k) for k in keys}
        self._pending[rid] = (_Leased(chosen), pages, None)
        self._release(leased)  # hits that reach no load: released now
        return True

    def start_layer_wise_loading(self) -> int:
        # A lookup no load took yet stays: every wrapper may hold a hit across scheduling passes (a waiting request
        # probed now, admitted later) and loads it then, or releases the request (cancel_request,
        # cancel_queued_load), asks again (lookup) or resets.
        if not self._pending:
            return -1
        batch, self._pending = self._pending, {}
        with self._submitted_lock:
            for rid in batch:
                self._submitted[rid] = self._submitted.get(rid, 0) + 1
        index = self.layer_done_counter.update_producer()
        self._load_queue.put((index, batch, self._stream_mark()))
        return index

    def _stream_mark(self):
        """CUDA: an event after everything queued so far on the scheduler's current stream (None on the CPU)."""
        if self._cuda is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._cuda))
        return event

    def _load_loop(self) -> None:
        while True:
            task = self._load_queue.get()
            try:
                if task is None:
                    return
                index, batch, queued_before = task
                error = None
                if queued_before is not None:
                    try:
                        queued_before.synchronize()  # no earlier kernel still uses the slots the restores write
                    except Exception as e:  # noqa: BLE001
                        error = e
                for rid, (leased, pages, doomed) in batch.items():
                    error = error or doomed
                    for (client, instance, lease), page in zip(leased.leases.values(), pages or [None] * len(
                            leased.leases)):
                        if error is not None:
                            self._link.release(client, instance, lease)
                            continue
                        try:
                            self._link.restore(client, instance, lease, [page])
                        except Exception as e:  # noqa: BLE001
                            error = e
                if error is None:
                    self.layer_done_counter.complete(index)
                    self.counters_.add("loads", len(batch))
                else:
                    self.counters_.add("load_failures", len(batch))
                    self._log.warning("load", "OrbitKV: restoring a load batch of %d requests failed (%s); %s",
                                      len(batch), error, "SGLang aborts them after the forward pass"
                                      if self._verdicts else "the layer wait raises on every rank")
                    self.layer_done_counter.fail(index, error)
                self._completed_loads.put((list(batch), error is None))
            finally:
                self._load_queue.task_done()

    def cancel_queued_load(self, rid: str) -> bool:
        """An older wrapper's release of a request: it rolls back nothing it inserted, so a queued load is kept
        (False) and lands; a wrapper that rolls back (cancel outcomes) gets it cancelled (True)."""
        if not self._outcomes:
            # The request is released: its lookup ticket goes; a queued load is kept (nothing is rolled back).
            self._release(self._leased.pop(rid, None))
            if rid in self._pending:
                self.counters_.add("cancels_kept_load")
            return False
        entry = self._pending.pop(rid, None)
        if entry is None:
            return False
        self._release(entry[0])
        return True

    def cancel_request(self, rid: str):
        """The pinned wrapper's release of everything a request holds: a lookup ticket is released, a queued load
        cancelled (the wrapper then rolls back what the tree inserted), a submitted load retained until it
        completes. Returns its LinkerCancelOutcome (a bool where the wrapper takes none)."""
        ticket = self._leased.pop(rid, None)
        self._release(ticket)
        entry = self._pending.pop(rid, None) if self._outcomes else None
        with self._submitted_lock:
            submitted = rid in self._submitted
        if entry is not None:
            self._release(entry[0])
            outcome = LinkerCancelOutcome.QUEUED_LOAD_CANCELLED
        elif submitted:
            outcome = LinkerCancelOutcome.SUBMITTED_LOAD_RETAINED
        elif ticket is not None:
            outcome = LinkerCancelOutcome.LOOKUP_RELEASED
        else:
            outcome = LinkerCancelOutcome.NOT_FOUND
        self.counters_.add(f"cancel_{outcome.value}")
        if self._outcomes:
            return outcome
        # A wrapper that takes a bool rolls back nothing: "released" only where no load of the request is kept.
        return outcome is LinkerCancelOutcome.LOOKUP_RELEASED and rid not in self._pending

    def num_completed_loads(self) -> int:
        return self._completed_loads.qsize()

    def pop_completed_load(self):
        """The next completed batch: ``(rids, success)`` where SGLang takes verdicts, else its rids."""
        try:
            rids, ok = self._completed_loads.get_nowait()
        except queue.Empty:
            rids, ok = [], True
        with self._submitted_lock:  # now the wrapper lets go of them too
            for rid in rids:
                left = self._submitted.get(rid, 0) - 1
                if left > 0:
                    self._submitted[rid] = left
                else:
                    self._submitted.pop(rid, None)
        return (rids, ok) if self._verdicts else rids

    # ---- offload ----

    def offload(self, transfers) -> bool:
        try:
            kv = _kv_transfer(transfers)
            keys = list(kv.keys or [])
            indices = kv.device_indices
            if hasattr(indices, "device") and indices.device.type != "cpu":
                indices = indices.cpu()
            if len(indices) != len(keys) * self.page_size:
                raise ValueError(f"offload of {len(keys)} pages from {len(indices)} slots")
            pages = [slot // self.page_size for slot in indices[:: self.page_size].tolist()]
            self._offload_queue.put(([native_key(k) for k in keys], pages, self._stream_mark()))
            return True
        except Exception as e:  # noqa: BLE001
            self.counters_.add("offload_errors")
            self._log.warning("offload", "OrbitKV: offload failed (%s)", e)
            return False

    def _offload_loop(self) -> None:
        while True:
            task = self._offload_queue.get()
            try:
                if task is None:
                    return
                natives, pages, pages_ready = task
                ok = True
                if self.is_writer and natives:
                    try:
                        if pages_ready is not None:
                            pages_ready.synchronize()  # the pages are complete on the GPU before the Manager copies
                        written, skipped = self._link.save(_DEVICE, natives, pages)
                        self.counters_.add("offload_written", written)
                        self.counters_.add("offload_skipped", skipped)
                    except Exception as e:  # noqa: BLE001
                        ok = False
                        self.counters_.add("offload_failures")
                        self._log.warning("offload", "OrbitKV: saving %d pages failed (%s)", len(natives), e)
                self._completed_offloads.put(ok)
            finally:
                self._offload_queue.task_done()

    def num_completed_offloads(self) -> int:
        return self._completed_offloads.qsize()

    def pop_completed_offload(self) -> bool:
        try:
            return self._completed_offloads.get_nowait()
        except queue.Empty:
            return False

    # ---- lifecycle ----

    def reset(self) -> None:
        """Waits for submitted loads and queued saves, then releases every lease and forgets all work, completed
        loads and saves included (the wrapper forgets its side too: nothing from before reaches drain_loads)."""
        self._load_queue.join()
        self._offload_queue.join()
        pending, self._pending = self._pending, {}
        for leased, _, _ in pending.values():
            self._release(leased)
        for rid in list(self._leased):
            self._release(self._leased.pop(rid))
        with self._submitted_lock:
            self._submitted.clear()
        for completed in (self._completed_loads, self._completed_offloads):
            while True:
                try:
                    completed.get_nowait()
                except queue.Empty:
                    break
        self.layer_done_counter.reset()

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self.reset()
        self._closed = True
        for q in (self._load_queue, self._offload_queue):
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._link.close()

    def counters(self) -> dict:
        return self.counters_.snapshot()
