"""The KV tensors: one paged tensor per layer, sized from a byte budget."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from kvstore.codec import Payload
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
        # On CPU, each layer's pages as rows of bytes ([num_pages, bytes of a page in a layer],
        # numpy views of the same memory): a page image is copied in or out with one numpy copy
        # per layer and no tensor allocated.
        self._rows = [_rows(layer) for layer in self.layers] if self.layers[0].device.type == "cpu" else None

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

    @property
    def has_images(self) -> bool:
        """Whether `read_images` / `write_images` can be used (a CPU cache)."""
        return self._rows is not None

    def read_images(self, pages: list[int]) -> list[bytearray]:
        """(CPU) Each page over all layers as bytes, laid out as one row of `read_pages`
        ([L, 2, page_size, num_kv_heads, head_dim] in the model dtype): one copy straight from the
        cache into the returned buffers. 47 MB (128 pages of the demo model) took ~11 ms against
        ~49 ms for `read_pages` and a `tobytes` per page, whose temporaries were fresh memory."""
        assert self._rows is not None
        rows = self._rows
        out = []
        for page in pages:
            image = bytearray(self.spec.bytes_per_page)
            view = np.frombuffer(image, dtype=np.uint8).reshape(len(rows), -1)
            for layer, row in enumerate(rows):
                view[layer] = row[page]
            out.append(image)
        return out

    def write_images(self, pages: list[int], images: list[Payload]) -> None:
        """(CPU) Fill these pages from page images (as `read_images` returns them), one numpy
        copy per page and layer straight into the cache: no joined buffer, no tensor (47 MB:
        ~9 ms against ~48 ms joining them and `write_pages`)."""
        assert self._rows is not None
        rows = self._rows
        for page, image in zip(pages, images, strict=True):
            view = np.frombuffer(image, dtype=np.uint8).reshape(len(rows), -1)
            for layer, row in enumerate(rows):
                row[page] = view[layer]

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Fill these pages from `data` [N, L, 2, page_size, num_kv_heads, head_dim]."""
        idx = torch.tensor(pages, dtype=torch.int64, device=self.layers[0].device)
        data = data.to(self.layers[0].device)
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, idx, data[:, i])


def _rows(layer: torch.Tensor) -> np.ndarray:
    """A CPU layer [num_pages, ...] as a writable uint8 array [num_pages, bytes per page]."""
    return layer.view(torch.uint8).numpy().reshape(layer.shape[0], -1)


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
