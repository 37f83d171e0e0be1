"""The Codex CLI, unchanged, against `longctx serve` on the demo model: one `codex exec` turn and one
`codex exec resume --last` turn, with the server's prompt and cached-prompt token counters read
from `/metrics` around each. Run on demand (not part of `make test`):

    .venv/bin/python bench/agents/codex.py [--port 8011] [--keep]

It installs `@openai/codex@0.169.0` with npm under `bench/agents/.npm/` when no such `codex` is
found, starts the server with the YaRN override at 32k (Codex's first prompt is about 10k
tokens, more than the demo model's 8,192), writes the `config.toml` a user would write into a
temporary `CODEX_HOME`, gives requests that send no temperature (Codex sends none) the server
default `--temperature` (greedy unless told: the demo model sampled at 1.0 rambles past any
output cap, which Codex reports as an error), and checks: both turns exit 0 with no ERROR line, and the resumed turn
has >= 80% of its prompt cached. Prints a table, writes `bench/results/codex.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODEX_VERSION = "0.169.0"
NPM_DIR = Path(__file__).resolve().parent / ".npm"
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 32768}  # fmt: skip
CONFIG = """model = "demo"
model_provider = "longctx"

[model_providers.longctx]
name = "longctx"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "LONGCTX_API_KEY"
"""


def codex_binary() -> Path:
    """`codex` at the pinned version: on PATH, or installed under NPM_DIR."""
    local = NPM_DIR / "node_modules" / ".bin" / "codex"
    for candidate in (shutil.which("codex"), str(local)):
        if candidate and Path(candidate).exists():
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True)
            if CODEX_VERSION in out.stdout:
                return Path(candidate)
    NPM_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--prefix", str(NPM_DIR), f"@openai/codex@{CODEX_VERSION}"], check=True)
    return local


def tokens(port: int) -> tuple[float, float]:
    """(prompt, cached prompt) tokens the server has counted so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(kind: str) -> float:
        return sum(float(v) for v in re.findall(rf"^longctx:{kind}_tokens_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prompt"), total("cached_prompt")


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server was not ready in time")


def turn(codex: Path, args: list[str], env: dict[str, str], cwd: Path, port: int) -> dict[str, object]:
    before = tokens(port)
    t0 = time.perf_counter()
    out = subprocess.run([str(codex), "exec", "--skip-git-repo-check", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    seconds = time.perf_counter() - t0
    after = tokens(port)
    prompt, cached = after[0] - before[0], after[1] - before[1]
    lines = (out.stdout + out.stderr).splitlines()
    errors = [line for line in lines if "ERROR" in line]
    share = round(cached / prompt, 3) if prompt else 0
    return {"args": args, "exit": out.returncode, "errors": errors, "seconds": round(seconds, 1),
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": share, "tail": lines[-12:]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--max-output-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="the server's default (Codex sends none)")
    ap.add_argument("--serve-args", default="", help="more `serve` flags, e.g. --serve-args='--dtype float32'")
    args = ap.parse_args()
    codex = codex_binary()
    work = Path(tempfile.mkdtemp(prefix="codex-work-"))
    (work / "hello.py").write_text('print("hello from longctx")\n')
    home = Path(tempfile.mkdtemp(prefix="codex-home-"))
    (home / "config.toml").write_text(CONFIG.format(port=args.port))
    env = {**os.environ, "CODEX_HOME": str(home), "LONGCTX_API_KEY": "none"}
    serve = [str(ROOT / ".venv" / "bin" / "longctx"), "serve", "--model", "smollm2-135m-instruct", "--port",
             str(args.port), "--served-model-name", "demo", "--hf-overrides", json.dumps(YARN), "--max-model-len",
             "32768", "--max-output-tokens", str(args.max_output_tokens), "--kv-cache-bytes", "2GiB",
             "--override-generation-config", json.dumps({"temperature": args.temperature}),
             *shlex.split(args.serve_args)]  # fmt: skip
    log = open(work / "serve.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(args.port, server)
        first = turn(codex, ["What does hello.py print?"], env, work, args.port)
        second = turn(codex, ["resume", "--last", "And what would it print twice?"], env, work, args.port)
    finally:
        server.terminate()
        server.wait(timeout=60)
    load = os.getloadavg()
    print(f"{'turn':<8}{'exit':>5}{'errors':>8}{'seconds':>9}{'prompt':>9}{'cached':>9}{'share':>7}")
    for name, t in (("exec", first), ("resume", second)):
        print(f"{name:<8}{t['exit']:>5}{len(t['errors']):>8}{t['seconds']:>9}{t['prompt_tokens']:>9.0f}"  # type: ignore[arg-type]
              f"{t['cached_tokens']:>9.0f}{t['cached_share']:>7}")  # fmt: skip
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; config.toml:\n{CONFIG.format(port=args.port)}")
    ok = first["exit"] == 0 == second["exit"] and not first["errors"] and not second["errors"]
    ok = ok and float(second["cached_share"]) >= 0.8  # type: ignore[arg-type]
    result = {"codex": CODEX_VERSION, "exec": first, "resume": second, "load_average": load, "ok": ok}
    out = ROOT / "bench" / "results" / "codex.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("targets met" if ok else "targets NOT met", f"({out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
