"""Per-turn TTFT of conversations kept by the server, against history re-sent whole, over HTTP.

(a)-(d), `bench/sess_agent.py`: a `--turns`-turn agent conversation with tool calls on the demo
model: (a) by `conversation`, (b) the whole history re-sent (`store: false`) to a server run with
`--no-prefix-cache`, (c) the same to the caching server, (d) turn `--restart-at` of (a) just after
its server restarted (its KV pages come back from the Redis tier). Session overhead of (a):
planning (to `response.created`: Redis reads, rendering, tokenizing, grammar, engine admission) and
tail (last output event to the terminal event: the commit, plus decoding the call's end marker or
the end-of-sequence token). Redis bytes per conversation: state keys and KV pages.

(f), `bench/sess_codex.py`: a Codex-shaped session (the CLI's recorded first request, ~10k tokens
of instructions and tools, then `--codex-turns` turns each re-sending the whole history with
`store: false`), on a server with the YaRN override: per turn the cached share of the prompt and
TTFT against a cold prefill of the same prompt (targets: >= 95% cached, TTFT <= 0.2x cold).

(e), `bench/sess_spill.py`: `--convs` conversations of `--conv-tokens` tokens interleaved
round-robin, with a device pool sized for `--device-convs` of them and a host tier for
`--host-convs` (fewer than all), so the rest come back from Redis: TTFT p50/p95 per round against
round 0, the full prefill of each conversation's opening.

Both run on their own `redis-server` (unix socket, removed afterwards) and `longctx serve`
subprocesses from this checkout. Prints tables with the load average and writes JSON to
bench/results/sessions.json.

    python bench/sessions.py [--quick] [--only agent|spill|codex] [--turns 20] [--convs 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"

from sess_agent import print_agent, run_agent  # noqa: E402
from sess_codex import print_codex, run_codex  # noqa: E402
from sess_common import loadavg  # noqa: E402
from sess_spill import print_spill, run_spill, summarize_spill  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run: 6 turns; 8 conversations of 1k, 2 on device")
    ap.add_argument("--only", choices=["agent", "spill", "codex"], default=None)
    ap.add_argument("--codex-turns", type=int, default=10, help="turns of (f)")
    ap.add_argument("--codex-cold", default="2,3,4,5,6,7,8,9,10", help="turns of (f) also prefilled cold")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--restart-at", type=int, default=11, help="the turn (d) runs on a restarted server")
    ap.add_argument("--max-output-tokens", type=int, default=48, help="per agent turn (a call takes about 30)")
    ap.add_argument("--kv-cache-bytes", default="256MiB", help="device pool of the agent servers")
    ap.add_argument("--convs", type=int, default=100)
    ap.add_argument("--conv-tokens", type=int, default=2000)
    ap.add_argument("--device-convs", type=int, default=20)
    ap.add_argument("--host-convs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (e) after the opening one")
    ap.add_argument("--spill-output-tokens", type=int, default=8)
    ap.add_argument("--spill-kv-dtype", default="int8", choices=["auto", "int8"], help="host and Redis tier storage")
    a = ap.parse_args()
    if a.quick:
        a.turns, a.restart_at = 6, 5
        a.convs, a.conv_tokens, a.device_convs, a.host_convs, a.rounds = 8, 1000, 2, 3, 1
        a.spill_output_tokens = 4
        a.codex_turns, a.codex_cold = 4, "2,4"
    a.codex_cold = sorted({int(t) for t in str(a.codex_cold).split(",") if t})
    return a


def main() -> None:
    from engine.loading.model_source import pull_demo
    from tests.redis_server import private_redis

    a = parse()
    gguf, logs = pull_demo(), Path(tempfile.mkdtemp(prefix="sessions-bench-"))
    out: dict[str, object] = {"args": vars(a), "loadavg_start": loadavg()}
    print(f"load average {out['loadavg_start']}; server logs in {logs}", flush=True)
    with private_redis() as url:
        if a.only in (None, "agent"):
            out["agent"] = agent = run_agent(gguf, url, logs, a)
            out["loadavg_agent"] = loadavg()
        if a.only in (None, "codex"):
            out["codex"] = run_codex(gguf, url, logs, a)
            out["loadavg_codex"] = loadavg()
        if a.only in (None, "spill"):
            spill = run_spill(gguf, url, logs, a)
            out["spill"] = {**spill, "summary": summarize_spill(spill)}
            out["loadavg_spill"] = loadavg()
    if "agent" in out:
        print_agent(agent)
        print(f"load average after: {out['loadavg_agent']}")
    if "codex" in out:
        print_codex(out["codex"])  # type: ignore[arg-type]
        print(f"load average after: {out['loadavg_codex']}")
    if "spill" in out:
        print_spill(out["spill"]["summary"])  # type: ignore[index]
        print(f"load average after: {out['loadavg_spill']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "sessions-quick.json" if a.quick else "sessions.json"
    if a.only is not None:
        name = name.replace(".json", f"-{a.only}.json")
    (RESULTS / name).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
