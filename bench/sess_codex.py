"""Part (f) of `bench/sessions.py`: a Codex-shaped session, `store: false`, the whole history re-sent.

Turn 1 is the Codex CLI's recorded first request (`tests/data/codex/first-request.json`: two
developer messages of base instructions, two user messages, its ten tools; about 10k tokens),
sent to a server with the YaRN override to 32k. Each later turn re-sends everything as the CLI
does: the earlier input, the output items as returned (answered with a `function_call_output`
when they are calls), and a new user message. Per turn: the share of the prompt served from the
prefix cache, TTFT on that server, and TTFT of the same prompt on a `--no-prefix-cache` server
(a cold prefill), side by side. Targets: every turn after the first >= 95% cached, TTFT <= 0.2x
the cold prefill.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sess_common import client, serve_args, timed, ttft_only

ROOT = Path(__file__).resolve().parents[1]
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 32768}  # fmt: skip


def first_request() -> dict[str, Any]:
    body: dict[str, Any] = json.loads((ROOT / "tests" / "data" / "codex" / "first-request.json").read_text())
    body.pop("stream", None)
    return body


def next_input(k: int, output: list[Any]) -> list[dict[str, Any]]:
    """What the client appends after turn k-1: its output, the calls' results, a new question."""
    items: list[dict[str, Any]] = [o.model_dump(exclude_none=True) for o in output]
    for o in output:
        if o.type == "function_call":
            items.append({"type": "function_call_output", "call_id": o.call_id, "output": f"exit 0; line {k}"})
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                  "text": f"Step {k}: what next?"}]})  # fmt: skip
    return items


def run_codex(gguf: Path, url: str, logs: Path, a: Any) -> dict[str, Any]:
    from tests.server import start_server

    extra = ("--hf-overrides", json.dumps(YARN), "--max-model-len", "32768", "--kv-cache-bytes", "768MiB")
    args = serve_args(a.dtype, a.threads, *extra)
    warm = start_server(gguf, "--redis-url", url, *args, log=logs / "codex-warm.log")
    cold = start_server(gguf, "--redis-url", url, "--no-prefix-cache", "--kv-redis-url", "none", *args,
                        log=logs / "codex-cold.log")  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        c, cc = client(warm.url), client(cold.url)
        body = first_request()
        extra_body = {"client_metadata": body.pop("client_metadata")}
        for k in range(1, a.codex_turns + 1):
            common = {**body, "temperature": 0, "max_output_tokens": a.max_output_tokens, "extra_body": extra_body}
            turn = timed(c, **common)
            final, ttft = turn["response"], turn["ttft_s"]
            usage = final.usage
            row: dict[str, Any] = {"turn": k, "prompt": usage.input_tokens, "ttft_s": ttft,
                                   "cached": usage.input_tokens_details.cached_tokens}  # fmt: skip
            if k == 1 or k in a.codex_cold:
                row["cold_ttft_s"] = ttft_only(cc, **common)["ttft_s"]
            rows.append(row)
            print(f"codex turn {k}: {row}", flush=True)
            body["input"] = [*body["input"], *next_input(k + 1, final.output)]
    finally:
        warm.stop()
        cold.stop()
    return {"rows": rows}


def print_codex(result: dict[str, Any]) -> None:
    print("\n(f) Codex-shaped session, store:false, whole history re-sent (YaRN 32k)")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'share':>6} {'ttft s':>7} {'cold s':>7} {'ratio':>6}")
    for r in result["rows"]:
        share = r["cached"] / r["prompt"]
        cold = r.get("cold_ttft_s")
        ratio = f"{r['ttft_s'] / cold:.3f}" if cold else "-"
        print(f"{r['turn']:>4} {r['prompt']:>7} {r['cached']:>7} {share:>6.3f} {r['ttft_s']:>7.2f} "
              f"{cold if cold is None else round(cold, 2)!s:>7} {ratio:>6}")  # fmt: skip
    later = result["rows"][1:]
    shares = [r["cached"] / r["prompt"] for r in later]
    ratios = [r["ttft_s"] / r["cold_ttft_s"] for r in later if r.get("cold_ttft_s")]
    ok = bool(later) and min(shares) >= 0.95 and bool(ratios) and max(ratios) <= 0.2
    print(
        f"turns 2+: min cached share {min(shares, default=0):.3f} (target >= 0.95), max TTFT ratio "
        f"{max(ratios, default=float('nan')):.3f} (target <= 0.2): {'met' if ok else 'NOT met'}"
    )
