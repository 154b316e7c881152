"""An SGLang-style MHA host KV pool (HiCache L2) for one rank, in the page_first or page_first_direct layout.

page_first: ``kv_buffer`` is (2, size, L, H, D) with size = num_pages * page tokens; page p owns token slots
[p*P, (p+1)*P), so its K bytes are one contiguous run ``kv_buffer[0, p*P:(p+1)*P]`` (inner order token, layer,
head, dim) and its V bytes another. page_first_direct: (2, num_pages, L, P, H, D), inner order layer, token, head,
dim. The two layouts hold the same values in different byte orders, so a page saved under one cannot be restored
under the other.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from orbitkv.demo.refengine.config import ModelConfig
from orbitkv.demo.refengine.kvcache import PagedKVCache

HOST_LAYOUTS = ("page_first", "page_first_direct")


class HostKVPool:
    def __init__(self, config: ModelConfig, num_pages: int, layout: str = "page_first",
                 allocator: Optional[Callable] = None):
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {HOST_LAYOUTS}, got {layout!r}")
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.config = config
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = config.block_size
        c = config
        if layout == "page_first":
            shape = (2, num_pages * self.page_size, c.num_layers, c.num_kv_heads, c.head_dim)
        else:
            shape = (2, num_pages, c.num_layers, self.page_size, c.num_kv_heads, c.head_dim)
        make = allocator or (lambda s, dt: torch.zeros(s, dtype=dt))
        self.kv_buffer = make(shape, c.torch_dtype)
        if tuple(self.kv_buffer.shape) != shape or self.kv_buffer.dtype != c.torch_dtype \
                or not self.kv_buffer.is_contiguous():
            raise ValueError(f"the allocator returned {tuple(self.kv_buffer.shape)} {self.kv_buffer.dtype}; "
                             f"need a contiguous {shape} {c.torch_dtype}")

    # ---- the HostKVCache attributes an SGLang storage backend reads (MHA) --------------------------------------
    @property
    def page_num(self) -> int:
        return self.num_pages

    @property
    def size(self) -> int:
        """Token slots in the pool (page p owns slots [p*P, (p+1)*P))."""
        return self.num_pages * self.page_size

    @property
    def layer_num(self) -> int:
        return self.config.num_layers

    @property
    def head_num(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self) -> list:
        """The tensors a zero-copy backend registers: K and V."""
        return [self.k_buffer, self.v_buffer]

    def get_ksize_per_token(self) -> int:
        return self.config.num_layers * self.config.num_kv_heads * self.config.head_dim * self.config.itemsize

    def get_size_per_token(self) -> int:
        return 2 * self.get_ksize_per_token()

    def get_page_buffer_meta(self, host_indices) -> tuple:
        """(ptr_list, size_list), K and V interleaved per page, for the pages whose first slots are
        ``host_indices[0], host_indices[P], ...`` (a whole number of pages of token slots)."""
        indices = [int(i) for i in host_indices]
        P = self.page_size
        if len(indices) % P:
            raise ValueError(f"host_indices must cover whole {P}-token pages, got {len(indices)} slots")
        pages = []
        for first in indices[::P]:
            if first % P:
                raise ValueError(f"slot {first} does not start a page")
            pages.append(first // P)
        ptrs, sizes = [], []
        for p in self._check_pages(pages):
            k, v = self.page_blobs(p)
            ptrs += [k.data_ptr(), v.data_ptr()]
            sizes += [self.blob_bytes, self.blob_bytes]
        return ptrs, sizes

    @property
    def blob_bytes(self) -> int:
        """Bytes of one page's K (or V) run: L * P * H * D * itemsize."""
        c = self.config
        return c.num_layers * self.page_size * c.num_kv_heads * c.head_dim * c.itemsize

    def _check_pages(self, page_ids) -> list:
        page_ids = [int(p) for p in page_ids]
        for p in page_ids:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page id {p} out of range [0, {self.num_pages})")
        return page_ids

    def page_blobs(self, page_id: int):
        """(k, v): uint8 views of the page's two contiguous byte runs in ``kv_buffer``."""
        (p,) = self._check_pages([page_id])
        if self.layout == "page_first":
            k, v = (self.kv_buffer[i, p * self.page_size:(p + 1) * self.page_size] for i in (0, 1))
        else:
            k, v = self.kv_buffer[0, p], self.kv_buffer[1, p]
        return k.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)

    def _io(self, cache: PagedKVCache, block_ids: Sequence[int], page_ids: Sequence[int], to_host: bool) -> None:
        if cache.config.block_size != self.page_size or cache.config.num_layers != self.config.num_layers \
                or cache.config.page_bytes != self.config.page_bytes:
            raise ValueError("the engine cache and the host pool differ in page size or geometry")
        page_ids = self._check_pages(page_ids)
        block_ids = cache._check_ids(block_ids).tolist()
        if len(block_ids) != len(page_ids):
            raise ValueError(f"{len(block_ids)} blocks but {len(page_ids)} pages")
        n, P = len(page_ids), self.page_size
        if n == 0:
            return
        dev = cache.layers[0].device
        table = torch.tensor(block_ids, dtype=torch.long, device=dev)
        positions = torch.arange(n * P, device=dev)
        pages = torch.tensor(page_ids, dtype=torch.long)
        slots = (pages[:, None] * P + torch.arange(P)[None, :]).reshape(-1)
        c = self.config
        for layer in range(c.num_layers):
            if to_host:
                k, v = cache.read_tokens(layer, table, positions)
                for i, x in enumerate((k, v)):
                    x = x.to("cpu")
                    if self.layout == "page_first":
                        self.kv_buffer[i, slots, layer] = x
                    else:
                        self.kv_buffer[i, pages, layer] = x.reshape(n, P, c.num_kv_heads, c.head_dim)
            else:
                if self.layout == "page_first":
                    k, v = (self.kv_buffer[i, slots, layer] for i in (0, 1))
                else:
                    k, v = (self.kv_buffer[i, pages, layer].reshape(n * P, c.num_kv_heads, c.head_dim)
                            for i in (0, 1))
                cache.write_tokens(layer, table, positions, k.to(dev), v.to(dev))

    def backup(self, cache: PagedKVCache, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        """Copies engine blocks (all layers) into host pages: block_ids[i] -> page_ids[i]."""
        self._io(cache, block_ids, page_ids, to_host=True)

    def load_back(self, cache: PagedKVCache, page_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copies host pages into engine blocks: page_ids[i] -> block_ids[i]."""
        self._io(cache, block_ids, page_ids, to_host=False)
