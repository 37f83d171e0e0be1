"""Parts (a)-(d) of `bench/sessions.py`: a tool-calling agent conversation, turn by turn.

Odd turns ask for the `sensor` tool (`tool_choice: required`), even turns answer the call and ask
the next question (`auto`). Per turn: (a) the turn by `conversation` on server A; (b) the whole
history re-sent (`store: false`) to server B (`--no-prefix-cache`, no KV tiers); (c) the same to
server A ((b) and (c) are left at their first delta). Turn `restart_at` is (d): server A is
restarted (SIGTERM, a new process on the same Redis) just before its (a), so its pages come from
the Redis KV tier alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sess_common import SENSOR, client, serve_args, timed, ttft_only


def turn_input(k: int, last: Any) -> list[dict[str, Any]]:
    """Turn k's input: the answer to the previous turn's call (if any) and a question."""
    items: list[dict[str, Any]] = []
    calls = [o for o in (last.output if last is not None else []) if o.type == "function_call"]
    for c in calls:
        items.append({"type": "function_call_output", "call_id": c.call_id, "output": f"sensor reads {17 + k} C"})
    items.append({"role": "user", "content": f"Step {k}: read sensor {k} and tell me whether it is above 20 C."})
    return items


def redis_bytes(url: str, prefix: str) -> tuple[int, int]:
    """(state bytes, KV page bytes) under `prefix`, by `MEMORY USAGE`."""
    import redis

    r = redis.Redis.from_url(url)
    state = kv = 0
    for k in r.scan_iter(f"{prefix}:*", count=1000):
        n = r.memory_usage(k) or 0
        if b":kv:" in k:
            kv += n
        else:
            state += n
    r.close()
    return state, kv


def run_agent(gguf: Path, url: str, logs: Path, a: Any) -> dict[str, Any]:
    from tests.redis_server import unique_prefix
    from tests.server import start_server

    args = serve_args(a.dtype, a.threads, "--kv-cache-bytes", a.kv_cache_bytes)
    prefix = unique_prefix()
    server = start_server(gguf, "--redis-url", url, *args, log=logs / "a.log", prefix=prefix)
    cold = start_server(gguf, "--redis-url", url, "--no-prefix-cache", "--kv-redis-url", "none", *args,
                        log=logs / "b.log")  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        c, cc = client(server.url), client(cold.url)
        conv = c.conversations.create(items=[])
        history: list[dict[str, Any]] = []
        last = None
        common = {
            "model": "demo",
            "tools": [SENSOR],
            "temperature": 0,
            "max_output_tokens": a.max_output_tokens,
            "parallel_tool_calls": False,
        }
        for k in range(1, a.turns + 1):
            new = turn_input(k, last)
            choice = "required" if k % 2 else "auto"
            if k == a.restart_at:
                server.stop()
                server = start_server(gguf, "--redis-url", url, *args, log=logs / "a2.log", prefix=prefix)
                c = client(server.url)
            ra = timed(c, conversation=conv.id, input=new, tool_choice=choice, **common)
            rb = ttft_only(cc, input=[*history, *new], store=False, tool_choice=choice, **common)
            rc = ttft_only(c, input=[*history, *new], store=False, tool_choice=choice, **common)
            last = ra["response"]
            history += [*new, *(o.model_dump(exclude_none=True) for o in last.output)]
            u = last.usage
            rows.append({
                "turn": k, "tool_choice": choice, "restarted": k == a.restart_at, "prompt_tokens": u.input_tokens,
                "cached_tokens": u.input_tokens_details.cached_tokens, "output_tokens": u.output_tokens,
                "status": last.status, "a_ttft_s": ra["ttft_s"], "b_ttft_s": rb["ttft_s"], "c_ttft_s": rc["ttft_s"],
                "a_plan_s": ra["plan_s"], "a_tail_s": ra["tail_s"],
            })  # fmt: skip
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
        state, kv = redis_bytes(url, prefix)
    finally:
        for s in (server, cold):
            if s.proc.poll() is None:
                s.stop()
    return {"turns": rows, "redis_state_bytes": state, "redis_kv_bytes": kv}


def print_agent(res: dict[str, Any]) -> None:
    print(f"{'turn':>4} {'choice':>8} {'prompt':>6} {'cached':>6} {'(a) conv':>9} {'(b) whole':>9} {'(c) cached':>10} "
          f"{'a/b':>5} {'plan':>6} {'tail':>6}")  # fmt: skip
    for r in res["turns"]:
        tag = " (d)" if r["restarted"] else ""
        print(f"{r['turn']:>4} {r['tool_choice']:>8} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} "
              f"{r['a_ttft_s']:>9.3f} {r['b_ttft_s']:>9.3f} {r['c_ttft_s']:>10.3f} "
              f"{r['a_ttft_s'] / r['b_ttft_s']:>5.2f} "
              f"{r['a_plan_s']:>6.3f} {r['a_tail_s']:>6.3f}{tag}")  # fmt: skip
    print(f"Redis per conversation: state {res['redis_state_bytes']} bytes, KV pages {res['redis_kv_bytes']} bytes")
