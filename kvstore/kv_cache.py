"""The KV tensors: one paged tensor per layer, sized from a byte budget."""

from __future__ import annotations

import math
import mmap

import torch

from kvstore.spec import KVSpec


class KVCache:
    """Per layer a tensor `[num_pages, 2, page_size, num_kv_heads, head_dim]`.

    Args:
        spec: layout (layers, heads, head dim, page size, dtype).
        num_pages: pages per layer; use `KVCache.from_budget` to derive it from bytes.
        device: where the tensors live.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError(f"the KV budget holds no page: one page of this model takes {spec.bytes_per_page} bytes")
        self.spec = spec
        self.num_pages = num_pages
        dtype = getattr(torch, spec.dtype)
        shape = (num_pages, 2, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [_zeros(shape, dtype, torch.device(device)) for _ in range(spec.num_layers)]

    @classmethod
    def from_budget(cls, spec: KVSpec, num_bytes: int, device: torch.device | str = "cpu") -> KVCache:
        return cls(spec, spec.pages_in_budget(num_bytes), device)

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.spec.bytes_per_page

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of these pages over all layers: [N, L, 2, page_size, num_kv_heads, head_dim]."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.layers[0].device)
        return torch.stack([layer.index_select(0, idx) for layer in self.layers], dim=1).cpu()

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Fill these pages from `data` [N, L, 2, page_size, num_kv_heads, head_dim]."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.layers[0].device)
        data = data.to(self.layers[0].device)
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, idx, data[:, i])


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on CPU in anonymous memory that the kernel zero-fills page by page on first write.
    `torch.zeros` writes every page at once: for a 1 GB pool that took seconds of page faults
    at start-up (on a VM); here they are spread over the pages' first use. Private, not shared
    (mmap's default): a first write of 16 MB took ~3.3 ms of faults against ~5.2 for shared
    memory. No huge pages asked for: where the kernel compacts memory to find them, a first
    write took 3-6x as long (a 512-token prefill's K/V writes 266 -> 899 us a layer), and the
    decode kernel read 2 MB pages no faster."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
