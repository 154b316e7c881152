"""Leasing a run of consecutive pages of one group from the Manager, across several queries when needed.

A query carries at most ``max_query_keys`` hashes and answers with the longest resident prefix, leased. A run is
asked in chunks: the next chunk is asked only if the previous one hit completely, and each hit chunk is one
*segment* ``(lease, first_block, count)``. The Manager may answer ``QueryLoading`` (blocks being staged from SSD or a
peer): the run then stays pending and ``advance`` asks again on the next call. Leases not restored must be released
(``release``); a pending operation that nobody will ask for again is cancelled.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import orbitkv

log = logging.getLogger("orbitkv.vllm")


def loading_type():
    """The client's QueryLoading type, or None while the Manager cannot answer Loading."""
    return getattr(orbitkv, "QueryLoading", None)


def release_lease(client, link, instance: int, lease: int) -> None:
    """Gives back one lease (best effort). While ``link`` is stalled, or once the release times out (which stalls
    it), the lease goes to the link, which releases it when the Manager answers."""
    if client is None or (link is not None and link.stalled):
        if link is not None:
            link.release_later(instance, lease, client)
        return
    try:
        client.release(instance, lease)
    except orbitkv.OrbitKVTimeout as error:
        if link is not None:
            link.failed(error, client)
            link.release_later(instance, lease, client)
    except orbitkv.OrbitKVError as error:
        log.debug("orbitkv: releasing lease %d: %s", lease, error)


class PageRun:
    """Pages [first_block, first_block + len(hashes)) of ``group``, leased segment by segment."""

    __slots__ = ("instance", "group", "first_block", "hashes", "segments", "hits", "op", "done")

    def __init__(self, instance: int, group: int, first_block: int, hashes: Sequence[bytes]):
        self.instance = instance
        self.group = group
        self.first_block = first_block
        self.hashes = list(hashes)
        self.segments: list[tuple[int, int, int]] = []  # (lease, first_block, count)
        self.hits = 0
        self.op: Optional[int] = None  # a Loading operation the Manager is working on
        self.done = not self.hashes

    @property
    def pending(self) -> bool:
        return not self.done

    def advance(self, client, page_tokens: int, max_keys: int) -> None:
        """Asks for the rest of the run; raises OrbitKVError if the Manager fails (leases so far stay owned)."""
        loading = loading_type()
        while not self.done:
            chunk = self.hashes[self.hits:self.hits + max_keys]
            first = self.first_block + self.hits
            answer = client.query_hashes(self.instance, chunk, first_token=first * page_tokens,
                                         page_tokens=page_tokens, group=self.group)
            if loading is not None and isinstance(answer, loading):
                if self.op is not None and self.op != answer.op:
                    self._cancel(client, self.op)
                self.op = answer.op
                return
            self.op = None
            if answer.num_hit_blocks <= 0:
                self.done = True
                return
            count = min(answer.num_hit_blocks, len(chunk))
            self.segments.append((answer.lease, first, count))
            self.hits += count
            if count < len(chunk) or self.hits >= len(self.hashes):
                self.done = True

    def release(self, client, link=None) -> None:
        """Gives back every lease and cancels a pending operation (best effort: the Manager may be gone). While
        ``link`` is stalled (the Manager stopped answering, its session and so the leases alive), or once a release
        times out (which stalls it), the leases go to the link, which releases them when the Manager answers."""
        for lease, _, _ in self.segments:
            release_lease(client, link, self.instance, lease)
        if client is not None and self.op is not None and not (link is not None and link.stalled):
            self._cancel(client, self.op)
        self.segments = []
        self.op = None

    def _cancel(self, client, op: int) -> None:
        cancel = getattr(client, "cancel", None)
        if cancel is None:
            return
        try:
            cancel(self.instance, op)
        except orbitkv.OrbitKVError as error:
            log.debug("orbitkv: cancelling operation %d: %s", op, error)
