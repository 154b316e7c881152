"""SGLang's ``UnifiedCacheLinkerWrapper`` as it drives a linker, for the linker tests (no SGLang here).

Pinned: the newest wrapper the search index holds (``python/sglang/srt/mem_cache/unified_cache/unified_cache_linker.py``
with ``LinkerCancelOutcome``, the key codec and ``_rollback_pending_load``; index file 60657039290, repository and
commit not given by the index). What it does with the linker, method by method:
- ``match``: a request matched again first gets ``release_request`` (a waiting request is probed for priority and
  again for admission); ``lookup`` returns the restorable prefix lengths, ``_sync_restorable_prefix`` intersects
  them across ranks (MIN over a 0/1 mask); an empty intersection calls ``cancel_request``; otherwise a hit marker
  holds the lookup until ``load_back`` or ``release_request``, across scheduling passes.
- ``load_back``: the tree inserts the pages (their slots) before ``_queue_load`` calls ``load``; a False or an
  exception calls ``cancel_request``, rolls the insert back and raises RuntimeError.
- ``start_layer_wise_loading``: queued loads become submitted.
- ``drain_loads``: ``pop_completed_load() -> list[str]``, each rid's pending load popped (KeyError on a stranger).
- ``release_request``: ``cancel_request`` and its outcome: QUEUED_LOAD_CANCELLED rolls the insert back (a
  submitted one is an error), SUBMITTED_LOAD_RETAINED keeps it, LOOKUP_RELEASED / NOT_FOUND with a pending load are
  errors (the linker lost state).
- ``reset``: ``linker.reset()``, then the markers and pending loads are forgotten.

Verdicts (``VERDICTS``, sgl-project/sglang 2c62dc66 and 63308e79): ``pop_completed_load() -> (rids, success)``; the
scheduler MIN-reduces success across ranks after the forward pass and aborts the failed requests; a request is
released through ``cancel_queued_load`` with no rollback (as in 03205d15). These wrappers too keep a lookup's hit
until ``load_back`` (a request matched in one pass may be admitted in a later one), and ``_queue_load`` raises
RuntimeError when ``load`` returns False.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from orbitkv.sglang._compat import LinkerCancelOutcome, LinkerInterface, PoolTransfer

PINNED = LinkerInterface(verdicts=False, cancel_outcomes=True)
VERDICTS = LinkerInterface(verdicts=True, cancel_outcomes=False)


@dataclass
class _Pending:
    hashes: List[str]
    phase: str = "queued"


@dataclass
class Wrapper:
    """One rank's wrapper over ``linker``; ``tree`` maps a page hash to the device page SGLang's tree holds for it
    (what a request sharing the prefix then reads as a device hit); ``intersect`` is the ranks' MIN (identity at one
    rank)."""

    linker: object
    interface: LinkerInterface = PINNED
    page_size: int = 16
    intersect: Callable[[torch.Tensor], torch.Tensor] = lambda mask: mask
    tree: Dict[str, int] = field(default_factory=dict)
    hit_markers: Dict[str, List[str]] = field(default_factory=dict)
    pending_loads: Dict[str, _Pending] = field(default_factory=dict)
    failed: List[str] = field(default_factory=list)  # verdicts mode: requests the scheduler aborted

    def match(self, rid: str, hashes: List[str]) -> int:
        """Pages of ``hashes`` (after those the tree holds) the external store will restore for ``rid``."""
        if rid in self.hit_markers and self.interface.cancel_outcomes:
            self.release_request(rid)
        device = 0
        while device < len(hashes) and hashes[device] in self.tree:
            device += 1
        tail = hashes[device:]
        if not tail:
            return 0
        local = self.linker.lookup(rid, [PoolTransfer(name="kv", keys=tail)])
        mask = torch.zeros(len(tail) + 1, dtype=torch.int)
        for pages in local:
            if 0 < pages <= len(tail):
                mask[pages] = 1
        common = self.intersect(mask).nonzero()
        hit = int(common[-1].item()) if common.numel() else 0
        if hit == 0:
            if self.interface.cancel_outcomes:
                self.linker.cancel_request(rid)
            return 0
        self.hit_markers[rid] = tail[:hit]
        return hit

    def load_back(self, rid: str, first_page: int) -> List[int]:
        """Inserts the hit's pages at device pages first_page.. and queues their load; returns those pages."""
        hashes = self.hit_markers.pop(rid, None)
        if hashes is None:
            return []
        pages = list(range(first_page, first_page + len(hashes)))
        for h, page in zip(hashes, pages):
            self.tree[h] = page
        slots = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])
        try:
            queued = self.linker.load(rid, [PoolTransfer(name="kv", keys=list(hashes), device_indices=slots)])
        except BaseException:
            self._cancel_and_roll_back(rid, hashes)
            raise
        if not queued:
            self._cancel_and_roll_back(rid, hashes)
            raise RuntimeError(f"Failed to queue the linker load for rid={rid!r}.")
        self.pending_loads[rid] = _Pending(list(hashes))
        return pages

    def _cancel_and_roll_back(self, rid, hashes):
        if self.interface.cancel_outcomes:
            self.linker.cancel_request(rid)
            self._roll_back(hashes)

    def _roll_back(self, hashes):
        for h in hashes:
            self.tree.pop(h, None)

    def start_layer_wise_loading(self) -> int:
        index = self.linker.start_layer_wise_loading()
        if index >= 0:
            for pending in self.pending_loads.values():
                pending.phase = "submitted"
        return index

    def forward(self, index: int, num_layers: int) -> None:
        """The model's layer waits of one forward pass (raises where the linker's wait does)."""
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        for layer in range(num_layers):
            counter.wait_until(layer)

    def drain_loads(self, finish_count: Optional[int] = None) -> List[str]:
        """Consumes completed load batches; returns their rids (verdicts mode: failed ones are aborted, their
        pages leave the tree as SGLang's abort frees them)."""
        done = []
        for _ in range(self.linker.num_completed_loads() if finish_count is None else finish_count):
            popped = self.linker.pop_completed_load()
            rids, ok = popped if self.interface.verdicts else (popped, True)
            for rid in rids:
                pending = self.pending_loads.pop(rid)
                if not ok:
                    self.failed.append(rid)
                    self._roll_back(pending.hashes)
                done.append(rid)
        return done

    def release_request(self, rid: str) -> None:
        self.hit_markers.pop(rid, None)
        if not self.interface.cancel_outcomes:
            if self.linker.cancel_queued_load(rid):  # no rollback in these versions (their TODO)
                self.pending_loads.pop(rid)
            return
        outcome = self.linker.cancel_request(rid)
        if outcome is LinkerCancelOutcome.QUEUED_LOAD_CANCELLED:
            pending = self.pending_loads.pop(rid)
            if pending.phase != "queued":
                raise RuntimeError(f"Linker cancelled submitted load for rid={rid!r}.")
            self._roll_back(pending.hashes)
        elif outcome is LinkerCancelOutcome.SUBMITTED_LOAD_RETAINED:
            pending = self.pending_loads.get(rid)
            if pending is None or pending.phase != "submitted":
                raise RuntimeError(f"Linker retained unknown submitted load for rid={rid!r}.")
        elif outcome is LinkerCancelOutcome.LOOKUP_RELEASED and rid in self.pending_loads:
            raise RuntimeError(f"Linker lost queued load state for rid={rid!r}.")
        elif outcome is LinkerCancelOutcome.NOT_FOUND and rid in self.pending_loads:
            raise RuntimeError(f"Linker lost pending load state for rid={rid!r}.")
        # Any other answer (a bool from a linker written for older wrappers) matches no branch: the wrapper keeps
        # its pending load and the tree keeps the pages, as SGLang's does.

    def reset(self) -> None:
        """UnifiedRadixCache.reset: the tree is emptied and the wrapper resets the linker, then forgets its side."""
        self.tree.clear()
        self.linker.reset()
        self.hit_markers.clear()
        self.pending_loads.clear()
