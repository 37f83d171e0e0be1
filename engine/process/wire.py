"""The messages between the API process and the engine process (`engine/process/main.py`).

msgspec-encoded (msgpack), tagged unions, one frame each over `channel.Channel` (a Unix socket pair).
The engine batches outputs per step: one `Outputs` message carries every request's increment of
that step, never one message per token per request. Startup results that only cross once (the
loaded model's tokenizer and config, the compile report) travel pickled inside `Started`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot
from engine.stats import StatsSnapshot

if TYPE_CHECKING:
    from engine.model.vision.inputs import ImageInput


class GrammarSpec(msgspec.Struct, array_like=True):
    """A request's output grammar as the engine process rebuilds it: the compiler's cache key
    (`tools.grammar.GrammarCompiler.from_key`) and the tokens already accepted into the caller's
    matcher (a forced prefix sent with the prompt)."""

    key: str
    accepted: list[int] = []


class WireTensor(msgspec.Struct, array_like=True):
    """A tensor's raw bytes (C order) with its dtype name and shape."""

    name: str
    dtype: str
    shape: list[int]
    data: bytes


class WireImage(msgspec.Struct, array_like=True):
    """An `ImageInput` (`engine/model/vision/inputs.py`): the processor's tensors travel as bytes."""

    content_hash: bytes
    tensors: list[WireTensor]
    num_tokens: int
    grid: list[int] | None = None


def encode_images(images: list[ImageInput]) -> list[WireImage]:
    import torch

    out = []
    for im in images:
        tensors = []
        for name, t in im.tensors.items():
            t = t.detach().cpu().contiguous()
            data = t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
            tensors.append(WireTensor(name, str(t.dtype).replace("torch.", ""), list(t.shape), data))
        out.append(WireImage(im.content_hash, tensors, im.num_tokens, list(im.grid) if im.grid else None))
    return out


def decode_images(images: list[WireImage]) -> list[ImageInput]:
    import torch

    from engine.model.vision.inputs import ImageInput

    out = []
    for im in images:
        tensors = {}
        for t in im.tensors:
            dtype = getattr(torch, t.dtype)
            raw = (
                torch.frombuffer(bytearray(t.data), dtype=torch.uint8) if t.data else torch.empty(0, dtype=torch.uint8)
            )
            tensors[t.name] = raw.view(dtype).reshape(t.shape)
        grid = (im.grid[0], im.grid[1], im.grid[2]) if im.grid else None
        out.append(ImageInput(im.content_hash, tensors, im.num_tokens, grid))
    return out


# ---- API -> engine ----


class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    grammar: GrammarSpec | None = None
    images: list[WireImage] = []  # a vision-language model's images, in prompt order


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Build(msgspec.Struct, tag="build", array_like=True):
    """Build the engine now (the loaded weights wait for the settings known after the Redis phase)."""

    kv_redis_url: str | None = None
    kv_redis_prefix: str = "lc:kv"
    enable_prefix_caching: bool = True
    check_buckets: list[int] | None = None  # the compiled step's buckets to check (None: every one)
    background: bool = False  # compile them in the background while serving (else before `compiled`)


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class CommitWait(msgspec.Struct, tag="commit_wait", array_like=True):
    """Wait up to `timeout_s` for the KV pages queued for Redis so far (`Engine.kv_commit_wait`);
    answered by `CommitDone` with the same `id`."""

    id: int
    timeout_s: float


ToEngine = Add | Abort | Build | Shutdown | CommitWait


# ---- engine -> API ----


class Outputs(msgspec.Struct, tag="out", array_like=True):
    """One step's outputs; `started`: requests that stopped counting against `max_queued`;
    `sent_at`: `time.monotonic()` in the engine process (one clock for both processes on Linux)."""

    outputs: list[RequestOutput]
    started: list[str]
    snapshot: EngineSnapshot
    sent_at: float


class Metrics(msgspec.Struct, tag="metrics", array_like=True):
    stats: StatsSnapshot
    kv: dict[str, dict[str, int]]
    host_bytes: int = 0  # KV pages held in the host tier
    prefetch_bytes: int = 0  # KV pages read ahead from Redis for waiting requests, not yet taken


class Started(msgspec.Struct, tag="started", array_like=True):
    """A startup phase ended in the engine process: `loaded`, `engine`, `compiled`; `payload` is
    that phase's result, pickled; `error` when it failed (the process then exits)."""

    phase: str
    payload: bytes = b""
    error: str | None = None
    bad_input: bool = False  # the error is the model or its options (not found, unsupported), not a crash


class Compiled(msgspec.Struct, tag="compiled", array_like=True):
    """A bucket compiled in the background was switched in (or left eager): the compiled step's
    `CompileReport` as it is now, pickled."""

    payload: bytes


class Stopped(msgspec.Struct, tag="stopped", array_like=True):
    """The engine process ended every request and is exiting."""


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The engine process is about to exit on a fault it can name (a rank of a sharded model died)."""

    reason: str


class CommitDone(msgspec.Struct, tag="commit_done", array_like=True):
    id: int
    written: bool  # every page queued before the wait reached Redis (False: the rest are marked pending)


FromEngine = Outputs | Metrics | Started | Stopped | CommitDone | Compiled | Failed

encoder = msgspec.msgpack.Encoder()
to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)
