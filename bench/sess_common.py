"""Shared parts of `bench/sessions.py`: servers, timed streamed responses, filler text, percentiles."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

SENSOR = {"type": "function", "name": "sensor", "description": "Read a sensor by number.",
          "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}  # fmt: skip
WORDS = [
    "the",
    "river",
    "under",
    "old",
    "stone",
    "bridge",
    "carries",
    "light",
    "rain",
    "toward",
    "small",
    "town",
    "where",
    "people",
    "walk",
    "slowly",
    "past",
    "shops",
    "bakery",
    "market",
    "garden",
    "library",
    "station",
    "tower",
    "clock",
    "window",
    "door",
    "table",
    "chair",
    "paper",
    "letter",
    "story",
    "song",
    "winter",
    "summer",
    "morning",
    "evening",
    "north",
    "south",
    "green",
    "blue",
    "quiet",
    "bright",
    "careful",
    "patient",
    "friend",
    "teacher",
    "worker",
    "builds",
    "reads",
    "writes",
    "opens",
    "closes",
    "finds",
    "keeps",
    "moves",
    "holds",
    "turns",
    "counts",
    "measures",
    "watches",
    "follows",
    "answers",
]


def serve_args(dtype: str, threads: int, *extra: str) -> tuple[str, ...]:
    return ("--dtype", dtype, "--threads", str(threads), "--background-workers", "0", "--served-model-name", "demo",
            *extra)  # fmt: skip


def client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)


# The first event carrying generated text. Not `output_item.added`: a call's item opens as soon as
# its name is known, and a required call's marker and name are forced by the grammar and prefilled
# with the prompt, so its item opens before the model has produced a token.
FIRST_TOKEN = ("response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta")


def ttft_only(c: Any, **kwargs: Any) -> dict[str, Any]:
    """TTFT (to the first delta) of a streamed response left right then: the server aborts the
    rest, so the benchmark does not wait for decoding it does not measure."""
    t0 = time.perf_counter()
    stream = c.responses.create(stream=True, **kwargs)
    try:
        for event in stream:
            if event.type in FIRST_TOKEN:
                return {"ttft_s": time.perf_counter() - t0}
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                return {"ttft_s": time.perf_counter() - t0}
    finally:
        stream.close()
    raise RuntimeError("stream ended without a delta")


def timed(c: Any, **kwargs: Any) -> dict[str, Any]:
    """One streamed response: TTFT (to the first delta), planning (to `response.created`), tail
    (last output event to the terminal event), the final response."""
    t0 = time.perf_counter()
    created = first = last = done = None
    final = None
    for event in c.responses.create(stream=True, **kwargs):
        t = time.perf_counter() - t0
        if event.type == "response.created":
            created = t
        elif event.type in FIRST_TOKEN and first is None:
            first = t
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            done, final = t, event.response
        elif event.type != "response.in_progress":
            last = t
    assert final is not None and created is not None and done is not None, "stream ended without a response"
    if final.status == "failed":
        raise RuntimeError(f"response failed: {final.error}")
    return {"ttft_s": first if first is not None else done, "plan_s": created, "tail_s": done - (last or done),
            "response": final}  # fmt: skip


def filler(seed: int, words: int) -> str:
    """Deterministic text of `words` common words (about one token each), unique per seed."""
    rng = random.Random(seed)
    out = [f"Record {seed}."]
    for i in range(words):
        out.append(rng.choice(WORDS) + ("." if i % 12 == 11 else ""))
    return " ".join(out)


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
