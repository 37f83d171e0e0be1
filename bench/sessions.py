"""Per-turn TTFT of an agent conversation over HTTP: kept by the server versus re-sent whole.

A `--turns`-turn agent conversation with tool calls on the demo model (`longctx serve`,
float32, the shared test Redis under a fresh prefix): odd turns ask for the `sensor` tool
(`tool_choice: required`), even turns answer the call and ask the next question. Per turn:
(a) the turn by `conversation`; (b) the whole history re-sent (`store: false`) to a server run
with `--no-prefix-cache`; (c) the same on the caching server; then (d) one more turn of (a)'s
conversation after a restart of its server (its KV pages come back from the Redis tier).
TTFT: from sending to the first `output_item.added`. Session overhead of (a): the time to
`response.created` plus from the last output event to `response.completed` (planning, Redis
reads, rendering, the commit). Redis bytes: `MEMORY USAGE` of the prefix's state keys (KV pages
not counted). Prints a table and writes JSON to bench/results/sessions.json.

    python bench/sessions.py [--turns 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
ARGS = (
    "--dtype",
    "float32",
    "--threads",
    "2",
    "--kv-cache-bytes",
    "256MiB",
    "--background-workers",
    "0",
    "--served-model-name",
    "demo",
)
SENSOR = {"type": "function", "name": "sensor", "description": "Read a sensor by number.",
          "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}  # fmt: skip


def timed(client: Any, **kwargs: Any) -> dict[str, Any]:
    """One streamed response: TTFT, overhead, the final response."""
    t0 = time.perf_counter()
    created = first = last = done = None
    final = None
    for event in client.responses.create(stream=True, **kwargs):
        t = time.perf_counter() - t0
        if event.type == "response.created":
            created = t
        elif event.type == "response.output_item.added" and first is None:
            first = t
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            done, final = t, event.response
        else:
            last = t
    assert final is not None and created is not None and done is not None
    return {"ttft_s": first if first is not None else done, "overhead_s": created + done - (last or done),
            "response": final}  # fmt: skip


def turn_input(k: int, last: Any) -> list[dict[str, Any]]:
    """Turn k's input: the answer to the previous turn's call (if any) and a question."""
    items: list[dict[str, Any]] = []
    calls = [o for o in (last.output if last is not None else []) if o.type == "function_call"]
    for c in calls:
        items.append({"type": "function_call_output", "call_id": c.call_id, "output": f"sensor reads {17 + k} C"})
    items.append({"role": "user", "content": f"Step {k}: read sensor {k} and tell me whether it is above 20 C."})
    return items


def redis_bytes(url: str, prefix: str) -> int:
    import redis

    r = redis.Redis.from_url(url)
    total = sum(r.memory_usage(k) or 0 for k in r.scan_iter(f"{prefix}:*", count=1000) if b":kv:" not in k)
    r.close()
    return int(total)


def main() -> None:
    import openai

    from engine.loading.model_source import pull_demo
    from tests.redis_server import delete_prefix, shared_redis, unique_prefix
    from tests.server import start_server

    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=20)
    a = ap.parse_args()
    gguf, logs = pull_demo(), Path(tempfile.mkdtemp())
    rows: list[dict[str, Any]] = []
    with shared_redis() as (url, _):
        prefix, cold_prefix = unique_prefix(), unique_prefix()
        server = start_server(gguf, "--redis-url", url, *ARGS, log=logs / "a.log", prefix=prefix)
        cold = start_server(gguf, "--redis-url", url, "--no-prefix-cache", *ARGS, log=logs / "b.log",
                            prefix=cold_prefix)  # fmt: skip
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
            cc = openai.OpenAI(base_url=cold.url + "/v1", api_key="x", max_retries=0, timeout=600)
            conv = c.conversations.create(items=[])
            history: list[dict[str, Any]] = []
            last = None
            common = {"model": "demo", "tools": [SENSOR], "temperature": 0, "max_output_tokens": 24}
            for k in range(1, a.turns + 1):
                new = turn_input(k, last)
                choice = "required" if k % 2 else "auto"
                ra = timed(c, conversation=conv.id, input=new, tool_choice=choice, **common)
                rb = timed(cc, input=[*history, *new], store=False, tool_choice=choice, **common)
                rc = timed(c, input=[*history, *new], store=False, tool_choice=choice, **common)
                last = ra["response"]
                history += [*new, *(o.model_dump(exclude_none=True) for o in last.output)]
                u = last.usage
                rows.append({"turn": k, "prompt_tokens": u.input_tokens, "cached_tokens":
                             u.input_tokens_details.cached_tokens, "a_ttft_s": ra["ttft_s"], "b_ttft_s": rb["ttft_s"],
                             "c_ttft_s": rc["ttft_s"], "a_overhead_s": ra["overhead_s"]})  # fmt: skip
                print(rows[-1], flush=True)
            state_bytes = redis_bytes(url, prefix)
            server.stop()
            server = start_server(gguf, "--redis-url", url, *ARGS, log=logs / "a2.log", prefix=prefix)
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
            rd = timed(c, conversation=conv.id, input=turn_input(a.turns + 1, last), tool_choice="auto", **common)
            d = {"turn": a.turns + 1, "d_ttft_s": rd["ttft_s"], "prompt_tokens": rd["response"].usage.input_tokens,
                 "cached_tokens": rd["response"].usage.input_tokens_details.cached_tokens}  # fmt: skip
        finally:
            for s in (server, cold):
                if s.proc.poll() is None:
                    s.stop()
            delete_prefix(url, prefix)
            delete_prefix(url, cold_prefix)
    print(
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {'(a) conv':>9} {'(b) whole':>9} {'(c) cached':>10} {'overhead':>8}"
    )
    for r in rows:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['a_ttft_s']:>9.3f} "
              f"{r['b_ttft_s']:>9.3f} {r['c_ttft_s']:>10.3f} {r['a_overhead_s']:>8.3f}")  # fmt: skip
    print(f"(d) turn {d['turn']} after a restart: TTFT {d['d_ttft_s']:.3f} s, "
          f"{d['cached_tokens']}/{d['prompt_tokens']} "
          f"cached; Redis state bytes for the conversation: {state_bytes}")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"turns": rows, "after_restart": d, "redis_state_bytes": state_bytes}
    (RESULTS / "sessions.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
