"""Loading a checkpoint into the model, tensor by tensor, with verification and statistics.

Sources (safetensors directories, GGUF files) yield `SourceTensor`s under transformers'
names; the model maps each name to a parameter (or a slice of a packed one). The model is
built on the meta device and materialised empty, so peak memory is the model plus one
tensor in flight. After loading, every parameter slice must have been filled exactly once
and no checkpoint tensor may be left unused; errors name the file, tensor and shapes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import xxhash
from tqdm import tqdm

from engine.distributed.parallel import SINGLE, ParallelContext
from engine.loading.safetensors_file import (
    CheckpointError,
    TensorEntry,
    checkpoint_files,
    map_tensor,
    read_header,
    read_tensor,
    read_tensor_part,
)
from engine.model.config import ModelConfig
from engine.model.layers import OTHER_RANK, ShardIndex
from engine.model.linear import convert_module, convert_tied_head
from engine.model.model import CausalLM
from engine.model.moe import SparseMoE
from engine.model.quant import NONE, Int4Blocks, Int4Coder, QuantConfig, int4_group, int8_scales
from engine.model.tp import SourceSlice

if TYPE_CHECKING:
    from engine.loading.calibrate import Calibration

log = logging.getLogger("longctx.weights")

# Called with each checkpoint tensor and the value read for it (this rank's part, in the
# source's dtype, before the cast to the model's dtype): the doctor's statistics hook.
TensorCallback = Callable[["SourceTensor", torch.Tensor], None]

# Tensors some checkpoints carry that no model here needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class SourceTensor:
    name: str  # transformers' parameter name
    shape: tuple[int, ...]
    nbytes: int  # bytes read from storage
    file: str
    read: Callable[[], torch.Tensor]
    # Reads only a part (a tensor-parallel rank's slice): (tensor, bytes read). None: read whole, then slice.
    read_part: Callable[[SourceSlice], tuple[torch.Tensor, int]] | None = None
    # The whole tensor as 4-bit codes per group of 32 (GGUF Q4_0 / Q4_1), for int4 at group 32 to
    # take as they are. None: no such blocks (the float `read` is quantized instead).
    read_int4: Callable[[], Int4Blocks] | None = None
    # `read` returns a tensor of its own (a file mapping) that may become the parameter as it is.
    keep: bool = False


class TensorSource(Protocol):
    description: str

    def tensors(self) -> Iterator[SourceTensor]: ...


class SafetensorsSource:
    """A directory with `config.json` and one or more `*.safetensors` files.

    mapped: tensors are mapped from the files (`map_tensor`), not read; those already in the
    model's dtype become its parameters without a copy (for files no one rewrites in place,
    such as the GGUF conversion cache)."""

    def __init__(self, directory: Path, mapped: bool = False):
        self.directory = directory
        self.description = str(directory)
        self.files = checkpoint_files(directory)
        self.entries = [e for f in self.files for e in read_header(f)]
        self.mapped = mapped

    def tensors(self) -> Iterator[SourceTensor]:
        read = map_tensor if self.mapped else read_tensor
        for e in self.entries:
            part = partial(_read_part, e)
            yield SourceTensor(e.name, e.shape, e.nbytes, str(e.file), partial(read, e), part, keep=self.mapped)


def _read_part(entry: TensorEntry, part: SourceSlice) -> tuple[torch.Tensor, int]:
    return read_tensor_part(entry, part.dim, part.ranges)


@dataclass
class LoadStats:
    bytes_read: int = 0
    num_tensors: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    fingerprint: str = ""  # xxh3-128 over every tensor's name and bytes, order-independent

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())
        return (
            f"loaded {self.num_tensors} tensors, {self.bytes_read / 1e6:.1f} MB in {self.seconds:.2f}s "
            f"({self.gb_per_s:.2f} GB/s; {phases})"
        )


def build_empty(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str, parallel: ParallelContext = SINGLE
) -> CausalLM:
    """The model (this rank's shard of it) with uninitialised parameters of `dtype` on `device`."""
    with torch.device("meta"):
        model = CausalLM(config, parallel)
    _materialize_empty(model, dtype, torch.device(device))
    model.init_buffers()
    if config.vision is not None:  # transformers' modules, built in place (their buffers computed)
        from engine.model.vision.encoder import build_encoder

        model.vision = build_encoder(config.vision, dtype, device)
    return model


def _materialize_empty(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """`model.to(dtype).to_empty(device=device)`, without the meta-tensor `empty_like` path that
    took most of a second (its first use imports torch's symbolic-shape machinery). Floating
    tensors take `dtype`; a tensor shared by several modules stays shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            kind = dtype if t.is_floating_point() else t.dtype
            new = torch.empty(t.shape, dtype=kind, device=device)
            made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = empty(p)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b)


def load_weights(
    model: CausalLM,
    source: TensorSource,
    *,
    progress: bool | None = None,
    stats: LoadStats | None = None,
    on_tensor: TensorCallback | None = None,
    convert: QuantConfig | None = None,
    calibration: Calibration | None = None,
    int4_coder: Int4Coder | None = None,
) -> LoadStats:
    """Fill `model`'s parameters from `source`. Raises CheckpointError on any mismatch.

    A sharded model reads only its slice of each split tensor and skips tensors of other ranks;
    `stats.bytes_read` counts the bytes actually read. `on_tensor` sees every tensor loaded, as
    read, so that statistics need no second pass over the files.

    convert: when given, each linear (and MoE expert stack) is replaced by its packed or
    quantized module as soon as its last tensor is in, and its float weights dropped, so peak
    memory is the converted model plus the parameter being assembled (`engine/model/linear.py`).
    The fingerprint then includes the quantization. calibration: int4's statistics of each
    linear's inputs (`engine/loading/calibrate.py`); without it int4 rounds every weight alike.
    int4_coder: what chooses a float weight's int4 codes (default `int4_codes`; a cache of them,
    `engine/loading/int4_cache.py`)."""
    stats = stats or LoadStats()
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    mapping = model.checkpoint_name_map()
    shard_specs = model.shard_specs()
    slices = model.source_slices()
    loaded: dict[str, set[object]] = {name: set() for name in params}
    digests: list[bytes] = []
    unexpected: list[str] = []
    tensors = list(source.tensors())
    total = sum(t.nbytes for t in tensors)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading weights",
        disable=None if progress is None else not progress,
    )
    tied = model.config.tie_word_embeddings
    read_s = 0.0
    converter = None if convert is None else _Converter(model, convert, shard_specs, slices, calibration, int4_coder)
    for t in tensors:
        target = mapping(t.name)
        if target == OTHER_RANK:
            bar.update(t.nbytes)
            continue
        if target is None:
            if t.name.endswith(IGNORED_SUFFIXES) or (tied and t.name.endswith("lm_head.weight")):
                bar.update(t.nbytes)
                continue
            unexpected.append(f"{t.name} (in {t.file})")
            continue
        pname, shard = target
        if pname not in params:  # its module was converted: every part of it was loaded already
            raise CheckpointError(f"{t.file}: tensor {t.name!r} overlaps tensors already loaded whole into {pname}")
        param = params[pname]
        specs = shard_specs.get(pname)
        if shard is not None and (specs is None or shard not in specs):
            raise CheckpointError(f"{t.file}: tensor {t.name!r} maps to unknown part {shard!r} of {pname}")
        dest = param.data[specs[shard]] if specs is not None and shard is not None else param.data
        part = slices.get(pname, {}).get(shard)
        if part is not None and not part.fits(t.shape):
            raise CheckpointError(f"{t.file}: tensor {t.name!r} of shape {list(t.shape)} has no part {part}")
        shape = t.shape if part is None else part.shape(t.shape)
        if tuple(dest.shape) != tuple(shape):
            what = "" if part is None else f" (this rank's part {list(shape)})"
            raise CheckpointError(
                f"{t.file}: tensor {t.name!r} has shape {list(t.shape)}{what}, the model expects {list(dest.shape)}"
            )
        if shard in loaded[pname]:
            raise CheckpointError(f"{t.file}: tensor {t.name!r} appears twice in the checkpoint")
        if loaded[pname] and (shard is None or None in loaded[pname]):
            # A packed parameter comes whole (fused checkpoint tensor) or in parts, never both.
            raise CheckpointError(f"{t.file}: tensor {t.name!r} overlaps another tensor loaded into {pname}")
        r0 = time.perf_counter()
        if part is None:
            value, nbytes = t.read(), t.nbytes
        elif t.read_part is not None:
            value, nbytes = t.read_part(part)
        else:
            value, nbytes = part.take(t.read()), t.nbytes
        read_s += time.perf_counter() - r0
        digests.append(_digest(t.name, value))
        if on_tensor is not None:
            on_tensor(t, value)
        whole = part is None and (specs is None or shard is None)
        if t.keep and whole and value.dtype == dest.dtype and value.device == dest.device:
            param.data = value  # the mapping is the parameter: no copy
        else:
            dest.copy_(value.to(dest.dtype))
        if converter is not None and part is None and t.read_int4 is not None and converter.takes_blocks(param):
            converter.add_blocks(pname, param, specs[shard] if specs is not None and shard is not None else None, t)
        loaded[pname].add(shard)
        stats.bytes_read += nbytes
        stats.num_tensors += 1
        bar.update(t.nbytes)
        del value, dest, param
        if converter is not None and converter.ready(pname, loaded):
            for name in converter.params_of(pname):
                params.pop(name)  # the float weights go with the module they belonged to
    bar.close()
    if unexpected:
        raise CheckpointError(
            f"{source.description}: {len(unexpected)} unexpected tensor(s) the model has no parameter for: "
            + ", ".join(unexpected[:5])
        )
    missing = []
    for name in loaded:
        expected = set(shard_specs.get(name, {None: ()}).keys())
        if None in loaded[name]:
            continue  # loaded whole: covers every part
        for shard in sorted(expected - loaded[name], key=str):
            missing.append(name if shard is None else f"{name} (part {shard})")
    if missing:
        raise CheckpointError(
            f"{source.description}: {len(missing)} tensor(s) missing from the checkpoint: " + ", ".join(missing[:5])
        )
    h = xxhash.xxh3_128()
    for d in sorted(digests):
        h.update(d)
    if convert is not None:
        assert converter is not None
        converter.finish()
        if convert.enabled:
            h.update(convert.fingerprint_tag.encode())
        if calibration is not None and convert.mode == "int4":
            h.update(calibration.tag.encode())
    stats.fingerprint = h.hexdigest()
    elapsed = time.perf_counter() - t0
    stats.phases["read"] = stats.phases.get("read", 0.0) + read_s
    stats.phases["copy"] = stats.phases.get("copy", 0.0) + elapsed - read_s
    stats.seconds += elapsed
    return stats


class _Converter:
    """Converts modules while their weights stream in (see `load_weights`)."""

    def __init__(
        self,
        model: CausalLM,
        quant: QuantConfig,
        shard_specs: dict[str, dict[object, ShardIndex]],
        slices: dict[str, dict[object, SourceSlice]],
        calibration: Calibration | None = None,
        coder: Int4Coder | None = None,
    ):
        self.model, self.quant, self.shard_specs, self.slices = model, quant, shard_specs, slices
        self.calibration, self.coder = calibration, coder
        # The image encoder's linears (transformers' modules) stay as they are.
        self.modules = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, SparseMoE)) and name and not name.startswith("vision.")
        }
        self.deferred: list[str] = []
        self.done: set[str] = set()
        # Per weight, its 4-bit codes assembled from the checkpoint's blocks, and the rows filled.
        self.blocks: dict[str, tuple[Int4Blocks, int]] = {}

    def takes_blocks(self, param: torch.Tensor) -> bool:
        """Would int4 take this weight's codes as they are (int4 at the blocks' group of 32)?"""
        return (
            self.quant.mode == "int4"
            and self.quant.group_size == Int4Blocks.GROUP
            and param.dim() == 2
            and not self.model.parallel.sharded
        )

    def add_blocks(self, pname: str, param: torch.Tensor, index: ShardIndex | None, t: SourceTensor) -> None:
        assert t.read_int4 is not None
        part = t.read_int4()
        N, K = param.shape
        if pname not in self.blocks:
            empty = Int4Blocks(
                torch.zeros(N, K, dtype=torch.uint8),
                torch.zeros(N, K // Int4Blocks.GROUP),
                torch.zeros(N, K // Int4Blocks.GROUP),
            )
            self.blocks[pname] = (empty, 0)
        whole, rows = self.blocks[pname]
        at = index if index is not None else (slice(None),)
        whole.codes[at] = part.codes
        whole.scale[at] = part.scale
        whole.zero[at] = part.zero
        self.blocks[pname] = (whole, rows + part.codes.shape[0])

    def complete_blocks(self, pname: str, param: torch.Tensor | None) -> Int4Blocks | None:
        """The weight's codes if every row of it came as blocks (then forgotten), else None."""
        entry = self.blocks.pop(pname, None)
        if entry is None or param is None or entry[1] != param.shape[0]:
            return None
        return entry[0]

    def hessian(self, pname: str, n: int, k: int) -> torch.Tensor | None:
        """int4's calibration blocks for the input columns of `pname` ([n, k] here) this rank holds."""
        group = int4_group(n, k, self.quant.group_size)
        if self.calibration is None or group is None:
            return None
        column_dim = 2 if pname.endswith((".w13", ".w2")) else 1
        ranges = next((s.ranges for s in self.slices.get(pname, {}).values() if s.dim == column_dim), None)
        return self.calibration.columns(pname, ranges, group)

    def params_of(self, pname: str) -> list[str]:
        owner = pname.rpartition(".")[0]
        return [f"{owner}.{n}" for n, _ in self.modules[owner].named_parameters(recurse=False)]

    def _row_split(self, pname: str) -> bool:
        """Does this rank hold only some input columns of the weight (a row-parallel split)?"""
        return any(s.dim == 2 if pname.endswith(".w2") else s.dim == 1 for s in self.slices.get(pname, {}).values())

    def ready(self, pname: str, loaded: dict[str, set[object]]) -> bool:
        """Called after each tensor: converts the owning module once all its parameters are
        complete. Returns whether it did (now or deferred) so the caller drops its references."""
        owner = pname.rpartition(".")[0]
        if owner not in self.modules or owner in self.done:
            return False
        for name in self.params_of(pname):
            expected = set(self.shard_specs.get(name, {None: ()}).keys())
            if None not in loaded[name] and not expected <= loaded[name]:
                return False
        self.done.add(owner)
        if (
            self.quant.mode == "int8"
            and self.model.parallel.sharded
            and any(map(self._row_split, self.params_of(pname)))
        ):
            self.deferred.append(owner)  # needs the whole rows' maxima: collectives, in one order on all ranks
            return False
        weight = f"{owner}.weight"
        blocks = self.complete_blocks(weight, self.model.get_parameter(weight) if weight in loaded else None)
        return convert_module(self.model, owner, self.quant, blocks=blocks, hessians=self.hessian, coder=self.coder)

    def finish(self) -> None:
        """Row-parallel int8 linears (every rank, sorted), then the tied head."""
        parallel = self.model.parallel
        for owner in sorted(self.deferred):
            absmax = {}
            for name, p in self.modules[owner].named_parameters(recurse=False):
                if self._row_split(name := f"{owner}.{name}"):
                    local = torch.stack([int8_scales(w) for w in p.detach().reshape(-1, *p.shape[-2:])])  # [E, N]
                    sizes = [local.shape[-1]] * parallel.world_size
                    gathered = parallel.all_gather(local, sizes, dim=-1)  # [E, world * N]
                    full = gathered.view(local.shape[0], parallel.world_size, -1).amax(dim=1)
                    absmax[name] = full if p.dim() == 3 else full[0]
            convert_module(self.model, owner, self.quant, absmax)
        embed = "model.embed_tokens.weight"
        blocks = self.complete_blocks(embed, self.model.get_parameter(embed) if self.blocks.get(embed) else None)
        convert_tied_head(self.model, self.quant, blocks)


def _digest(name: str, value: torch.Tensor) -> bytes:
    h = xxhash.xxh3_128(name.encode())
    h.update(value.contiguous().view(torch.uint8).reshape(-1).numpy().data)
    return h.digest()


def load_model(
    config: ModelConfig,
    source: TensorSource,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    progress: bool | None = None,
    parallel: ParallelContext = SINGLE,
    on_tensor: TensorCallback | None = None,
    quantization: QuantConfig = NONE,
    calibration: Calibration | None = None,
    int4_coder: Int4Coder | None = None,
) -> tuple[CausalLM, LoadStats]:
    """Build the model (this rank's shard) and load its weights, packing (bf16) or quantizing
    linears as they complete (int4 against `calibration`'s statistics when given, its codes
    chosen by `int4_coder`: see `load_weights`). Returns (model in eval mode, statistics)."""
    stats = LoadStats()
    t0 = time.perf_counter()
    model = build_empty(config, dtype, device, parallel)
    stats.phases["build"] = time.perf_counter() - t0
    stats.seconds = stats.phases["build"]
    if quantization.enabled and torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {quantization.mode} runs on CPU only (torch's int8/int4 CPU kernels)")
    load_weights(
        model,
        source,
        progress=progress,
        stats=stats,
        on_tensor=on_tensor,
        convert=quantization,
        calibration=calibration,
        int4_coder=int4_coder,
    )
    model.eval()
    who = f"rank {parallel.global_rank} ({parallel.describe()}): " if parallel.distributed else ""
    log.info("%s%s: %s", who, source.description, stats.summary())
    return model, stats
