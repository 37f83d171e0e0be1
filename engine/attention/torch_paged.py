"""Paged attention in plain torch: the CPU path and the oracle every other backend is checked against.

Decoding sequences (one new token each) are batched into a single SDPA call over their
pages, padded to the longest; prefilling sequences run one SDPA call each (new tokens
attend to the cached pages plus themselves), never with a mask as large as chunk x context
(`long_prefill`: split at the cached prefix, or masked in bounded query blocks). No step
copies the whole context more than once: K and V are each read with one `index_select` on
the cache viewed as `[pages * 2, page_size, KVH, D]` (page p's K at row 2p, its V at
2p + 1), sliding-window layers read only the pages their window reaches, a whole prompt in
one chunk runs as plain causal attention without a mask, and a single decoding sequence
slices its keys instead of masking them.

On CPU with the kernels built (`cpu_kernel`), decoding sequences run `paged_decode.cpp` and,
where the build has a path for the dtype and head dim (`cpu_kernel.prefill`), each prefill
chunk runs `paged_prefill.cpp`: both read K and V where they are in the cache, with no
gathered copy and no mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel
from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv
from engine.attention.long_prefill import (
    SPLIT_FROM,
    attend_after_prefix,
    attend_blocked,
    has_lse_attention,
    split_decode,
)


@dataclass
class _Seq:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor  # int32, the sequence's live pages: logical pages first_page .. (enough for kv_len)
    first_page: int  # logical pages released before `pages` (a sliding window left them behind)


@dataclass
class _Read:
    """What one attention call reads for one window: K/V rows of the flat page view, and how
    to trim or mask them. For the decode group: pages padded to the longest, [B * n]."""

    k_rows: torch.Tensor  # [B * n] int64, 2 * page
    v_rows: torch.Tensor  # [B * n] int64, 2 * page + 1
    n_pages: int  # per sequence (padded)
    start: int  # tokens to drop from the front of the read (B = 1 only)
    length: int  # tokens kept after `start` (B = 1 only; padded reads keep all)
    mask: torch.Tensor | None  # bool, True = attend: decode [B, 1, 1, L]; a gathered prefill's [q, L] once built
    causal: bool  # plain causal attention (prefill of a whole prompt within its window)


def _first_token(q_start_pos: int, window: int | None) -> int:
    """First context position a query at `q_start_pos` (the earliest of its chunk) can see."""
    return 0 if window is None else max(0, q_start_pos - window + 1)


@dataclass
class _KernelRead:
    """The decode group's read for `paged_decode.cpp`: per sequence its pages from the first one
    read (padded to the longest), and the keys' first token in them and count."""

    pages: torch.Tensor  # [B, n] int32
    starts: torch.Tensor  # [B] int64
    lengths: torch.Tensor  # [B] int64
    chunk: int  # keys per kernel task


@dataclass
class _PrefillKernelRead:
    """A prefill chunk's read for `paged_prefill.cpp`: its pages from the first one it reads,
    and its first query's position counted from that page's first token."""

    pages: torch.Tensor  # [n] int32
    q0: int


# The kernel's tasks: (sequence, chunk of keys); enough per thread to balance, none shorter
# than this many keys.
TASKS_PER_THREAD = 4
MIN_CHUNK = 256

# bf16 prefill chunks of at least GATHER_MIN_QUERIES queries and GATHER_FROM query x key pairs
# (at most GATHER_MAX: the mask's bytes) run as one masked SDPA over their gathered keys instead
# of `paged_prefill.cpp`, on CPUs with AMX: torch's flash kernel runs its products on the AMX
# tiles, 1.5-3x the kernel's VDPBF16PS from 32 queries over 2k keys up (docs/benchmarks.md,
# "Prefill attention on AMX"); the kernel stays ahead below 16 queries. None: never (CPUs
# without AMX, where it was not measured faster). `engine.verify.paths.forced` sets these.
GATHER_FROM: int | None = 16384 if "amx_bf16" in cpu_kernel.cpu_flag_set() else None
GATHER_MIN_QUERIES = 16
GATHER_MAX = 1 << 25


class TorchPagedBackend(AttentionBackend):
    name = "torch_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # The decode kernel when it is built in this process (`cpu_kernel.load`); None: SDPA.
        self.kernel = cpu_kernel.loaded()

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self.page_size = meta.page_size
        kv_indptr = meta.kv_indptr.tolist()  # B + 1 entries: no per-page Python work
        qo = meta.qo_indptr.tolist()
        self.device = meta.kv_indices.device
        self.prefills: list[_Seq] = []
        self.decodes: list[_Seq] = []
        for b, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens, strict=True)):
            pages = meta.kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
            seq = _Seq(qo[b], q_len, kv_len, pages, meta.first_pages[b])
            (self.decodes if q_len == 1 else self.prefills).append(seq)
        # Every row decodes: q is the decode group's queries as is, no gather or scatter.
        self.all_decode = not self.prefills
        self.decode_rows = (
            None
            if self.all_decode or not self.decodes
            else torch.tensor([s.q_start for s in self.decodes], dtype=torch.int64, device=self.device)
        )
        # Per window (layers share them): the decode group's read, each prefill's (for SDPA or
        # for the prefill kernel).
        self._decode_reads: dict[int | None, _Read | _KernelRead | None] = {}
        self._prefill_reads: dict[int | None, list[_Read]] = {}
        self._kernel_prefills: dict[int | None, list[_PrefillKernelRead]] = {}
        self.use_kernel = self.kernel is not None and self.device.type == "cpu"

    @staticmethod
    def _rows(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = pages.to(torch.int64) * 2
        return k, k + 1

    def _first_page(self, s: _Seq, q_start_pos: int, window: int | None) -> int:
        """The first logical page a read of `s` needs; it must not have been released."""
        first = _first_token(q_start_pos, window) // self.page_size
        if first < s.first_page:
            raise RuntimeError(
                f"attention (window {window}) needs page {first} of a sequence whose pages before "
                f"{s.first_page} were released"
            )
        return first

    def _decode_pages(self, window: int | None) -> tuple[list[int], torch.Tensor]:
        """Per decoding sequence the first logical page its query reads, and those pages on:
        [B, n] int32, padded with page 0 to the longest (a lone sequence's table as a view)."""
        firsts = [self._first_page(s, s.kv_len - 1, window) for s in self.decodes]
        if len(self.decodes) == 1:
            s, first = self.decodes[0], firsts[0]
            return firsts, s.pages[first - s.first_page :].view(1, -1)
        counts = [len(s.pages) - (f - s.first_page) for s, f in zip(self.decodes, firsts, strict=True)]
        padded = torch.zeros(len(self.decodes), max(counts), dtype=torch.int32, device=self.device)
        for i, (s, f, c) in enumerate(zip(self.decodes, firsts, counts, strict=True)):
            padded[i, :c] = s.pages[f - s.first_page :]
        return firsts, padded

    def _kernel_read(self, window: int | None) -> _KernelRead:
        S = self.page_size
        firsts, pages = self._decode_pages(window)
        tokens = [_first_token(s.kv_len - 1, window) for s in self.decodes]
        lengths = [s.kv_len - t for s, t in zip(self.decodes, tokens, strict=True)]
        spans = torch.tensor([[t - f * S for t, f in zip(tokens, firsts, strict=True)], lengths], dtype=torch.int64)
        tasks = -(-TASKS_PER_THREAD * torch.get_num_threads() // len(self.decodes))  # chunks per sequence
        chunk = max(MIN_CHUNK, -(-max(lengths) // tasks))
        return _KernelRead(pages.contiguous(), spans[0], spans[1], chunk)

    def _decode_read(self, window: int | None) -> _Read:
        S = self.page_size
        firsts, pages = self._decode_pages(window)
        n = pages.shape[1]
        k, v = self._rows(pages.reshape(-1))
        if len(self.decodes) == 1:
            s, first = self.decodes[0], firsts[0]
            start = _first_token(s.kv_len - 1, window) - first * S
            return _Read(k, v, n, start, s.kv_len - first * S - start, None, False)
        offs = torch.tensor([f * S for f in firsts], device=self.device)[:, None]  # [B, 1]
        kv_pos = offs + torch.arange(n * S, device=self.device)[None, :]  # [B, L]
        q_pos = torch.tensor([s.kv_len - 1 for s in self.decodes], device=self.device)[:, None]
        mask = kv_pos <= q_pos
        if window is not None:
            mask &= kv_pos > q_pos - window
        return _Read(k, v, n, 0, n * S, mask[:, None, None, :], False)

    def _prefill_read(self, s: _Seq, window: int | None) -> _Read:
        """The pages a prefill chunk reads; no mask here (see `long_prefill`): a whole prompt
        within its window is plain causal attention, anything else is masked block by block
        or, for full attention, split at the cached prefix."""
        S = self.page_size
        first = self._first_page(s, s.kv_len - s.q_len, window)
        k, v = self._rows(s.pages[first - s.first_page :])
        length = s.kv_len - first * S
        causal = s.q_len == s.kv_len and (window is None or s.kv_len <= window)
        return _Read(k, v, len(s.pages) - (first - s.first_page), 0, length, None, causal)

    def _prefill_kernel_reads(self, window: int | None) -> list[_PrefillKernelRead]:
        if window not in self._kernel_prefills:
            reads = []
            for s in self.prefills:
                first = self._first_page(s, s.kv_len - s.q_len, window)
                q0 = s.kv_len - s.q_len - first * self.page_size
                reads.append(_PrefillKernelRead(s.pages[first - s.first_page :].contiguous(), q0))
            self._kernel_prefills[window] = reads
        return self._kernel_prefills[window]

    def _decode_for(self, window: int | None) -> _Read | _KernelRead | None:
        if window not in self._decode_reads:
            decode: _Read | _KernelRead | None = None
            if self.decodes:
                decode = self._kernel_read(window) if self.use_kernel else self._decode_read(window)
            self._decode_reads[window] = decode
        return self._decode_reads[window]

    def _gathers(self, s: _Seq, dtype: torch.dtype, window: int | None) -> bool:
        """Whether this prefill chunk takes the gathered, masked SDPA instead of the kernel."""
        if GATHER_FROM is None or dtype != torch.bfloat16 or self.device.type != "cpu" or s.q_len < GATHER_MIN_QUERIES:
            return False
        pairs = s.q_len * (s.kv_len - _first_token(s.kv_len - s.q_len, window))
        return GATHER_FROM <= pairs <= GATHER_MAX

    def _prefills_for(self, window: int | None) -> list[_Read]:
        if window not in self._prefill_reads:
            self._prefill_reads[window] = [self._prefill_read(s, window) for s in self.prefills]
        return self._prefill_reads[window]

    def fast_decode(
        self, window: int | None, dtype: torch.dtype
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """For a planned step in which every row decodes through the kernel: a layer's attention
        as `attend(q, k, v, cache)` (its K/V rows written in, then the kernel's read), what
        `forward` does for such a step without its per-call dispatch; None for any other step
        (or a dtype the kernel lacks)."""
        store = cpu_kernel.store_kv()
        if not (self.all_decode and self.use_kernel and dtype in cpu_kernel.DTYPES and store is not None):
            return None
        read = self._decode_for(window)
        assert isinstance(read, _KernelRead) and self.kernel is not None
        kernel, slots, scale = self.kernel, self.meta.kv_slots, self.scale
        pages, starts, lengths, chunk = read.pages, read.starts, read.lengths, read.chunk

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            store(cache, k, v, slots)
            return kernel(q, cache, pages, starts, lengths, scale, chunk)

        return attend

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        write_kv(cache, k, v, self.meta)
        P, _, S, KVH, D = cache.shape
        pages = cache.view(P * 2, S, KVH, D)
        decode = self._decode_for(window)

        def gather(r: _Read, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Keys and values [batch, KVH, L, D], one index_select each."""
            kv = []
            for rows in (r.k_rows, r.v_rows):
                x = pages.index_select(0, rows).view(batch, r.n_pages * S, KVH, D)
                if batch == 1 and (r.start or r.length != r.n_pages * S):
                    x = x[:, r.start : r.start + r.length]
                kv.append(x.transpose(1, 2).to(q.dtype))
            return kv[0], kv[1]

        def decode_group(queries: torch.Tensor) -> torch.Tensor:
            """The decoding sequences' attention, [B, H, D] -> [B, H, D]."""
            if isinstance(decode, _KernelRead) and queries.dtype == cache.dtype in cpu_kernel.DTYPES:
                assert self.kernel is not None
                r = decode
                if queries.stride(-1) != 1 or queries.stride(-2) != queries.shape[-1]:
                    queries = queries.contiguous()
                return self.kernel(queries, cache, r.pages, r.starts, r.lengths, self.scale, r.chunk)
            read = decode
            if not isinstance(read, _Read):  # a dtype the kernel lacks: SDPA's read, kept for the other layers
                read = self._decode_read(window)
                self._decode_reads[window] = read
            keys, values = gather(read, len(self.decodes))
            return self._decode(queries, keys, values, read.mask)

        if self.all_decode and decode is not None:
            return decode_group(q)
        prefill = cpu_kernel.prefill(q.dtype, D) if self.use_kernel and q.dtype == cache.dtype else None
        reads = self._prefill_kernel_reads(window) if prefill is not None else []
        gathers = [self._gathers(s, q.dtype, window) for s in self.prefills]
        if prefill is not None and decode is None and len(self.prefills) == 1 and not gathers[0]:  # one chunk
            return prefill(q, cache, reads[0].pages, reads[0].q0, window or 0, self.scale)
        out = torch.empty_like(q)  # [T, H, D]
        if decode is not None and self.decode_rows is not None:
            out[self.decode_rows] = decode_group(q[self.decode_rows])
        for i, s in enumerate(self.prefills):
            rows = slice(s.q_start, s.q_start + s.q_len)
            if prefill is not None and not gathers[i]:
                out[rows] = prefill(q[rows], cache, reads[i].pages, reads[i].q0, window or 0, self.scale)
                continue
            r = self._prefills_for(window)[i]
            keys, values = gather(r, 1)
            queries = q[rows].transpose(0, 1)  # [H, q, D]
            attend = self._gathered if gathers[i] else self._prefill
            out[rows] = attend(queries, keys[0], values[0], s, r, window).transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, H, D] (one query per sequence); keys, values [B, KVH, L, D]; mask [B, 1, 1, L] or
        None. The G query heads sharing a KV head are folded into the query length ([B, KVH, G, D]):
        no K/V repeat, and the CPU flash kernel runs G rows per key block instead of one (its
        single-row GQA path is ~10x slower over 1M keys). Heads h = kvh * G + g, as with
        `enable_gqa`. Returns [B, H, D]."""
        B, H, D = q.shape
        KVH = keys.shape[1]
        if B == 1 and mask is None and keys.shape[2] >= SPLIT_FROM and has_lse_attention(q.device):
            return split_decode(q, keys, values, self.scale)
        o = F.scaled_dot_product_attention(
            q.reshape(B, KVH, H // KVH, D), keys, values, attn_mask=mask, scale=self.scale
        )  # [B, KVH, G, D]
        return o.reshape(B, H, D)

    def _gathered(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: _Seq, r: _Read, window: int | None
    ) -> torch.Tensor:
        """One bf16 SDPA call over the chunk's gathered keys (`_gathers`), masked unless the
        chunk is a whole prompt: one softmax over all of them, no partial outputs merged (so
        no float32 copies, unlike `attend_after_prefix`). queries [H, q, D]; keys, values
        [KVH, L, D] from the read's first page. Returns [H, q, D]. The mask is built by the first
        layer and kept on the read (the step's reads are per window), not once per layer."""
        if not r.causal and r.mask is None:
            q_pos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=self.device)[:, None]  # [q, 1]
            kv_pos = torch.arange(s.kv_len - r.length, s.kv_len, device=self.device)[None, :]  # [1, L]
            r.mask = kv_pos <= q_pos
            if window is not None:
                r.mask &= kv_pos > q_pos - window
        return F.scaled_dot_product_attention(
            queries[None],
            keys[None],
            values[None],
            attn_mask=r.mask,
            is_causal=r.causal,
            scale=self.scale,
            enable_gqa=True,
        )[0]

    def _prefill(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: _Seq, r: _Read, window: int | None
    ) -> torch.Tensor:
        """queries [H, q, D]; keys, values [KVH, L, D] from the read's first page. Returns [H, q, D]."""
        if r.causal:
            # 4-D inputs: with 3-D ones torch takes its slow math path on CPU (~9x slower here).
            # A whole prompt in one chunk is plain causal attention: the kernel skips masked blocks.
            return F.scaled_dot_product_attention(
                queries[None], keys[None], values[None], is_causal=True, scale=self.scale, enable_gqa=True
            )[0]
        if window is None and has_lse_attention(queries.device):
            return attend_after_prefix(queries, keys, values, s.kv_len - s.q_len, self.scale)
        first_pos = s.kv_len - r.length  # position of the read's first key
        return attend_blocked(queries, keys, values, s.kv_len - s.q_len, first_pos, window, self.scale)
