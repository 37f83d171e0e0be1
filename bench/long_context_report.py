"""The long-context benchmark's output: a table on stdout, JSON and an SVG plot in bench/results/.

The plot (decode step CPU time against context, log-log, one line per model) is drawn by hand:
matplotlib is not a dependency of the project.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

COLORS = {"windowed": "#1f77b4", "full": "#d62728", "demo": "#2ca02c", "full (runner, random KV)": "#ff7f0e"}


def _k(n: int) -> str:
    return f"{round(n / 1048576)}M" if n >= 1048576 else f"{round(n / 1024)}k"


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'model':<10} {'context':>8} {'prefill s':>9} {'prefill tok/s':>13} {'step ms':>8} {'cpu ms':>7} "
        f"{'attn ms':>8} {'rest cpu ms':>11} {'pages held':>10} {'RSS MB':>7}"
    ]
    for part in ("windowed", "full", "demo"):
        r = results.get(part)
        if not r:
            continue
        if "error" in r:
            lines.append(f"{part:<10} failed: {r['error']}")
            continue
        for row in r["rows"]:
            rate = row["prefill_tokens"] / row["prefill_s"] if row["prefill_s"] else 0.0
            lines.append(
                f"{part:<10} {_k(row['context']):>8} {row['prefill_s']:>9.1f} {rate:>13.0f} {row['step_ms']:>8.2f} "
                f"{row['step_cpu_ms']:>7.2f} {row['attention_cpu_ms']:>8.2f} {row['rest_cpu_ms']:>11.2f} "
                f"{row['pages_held']:>10} {row['rss_mb']:>7.0f}"
            )
        for row in r.get("runner_decode", []):
            lines.append(
                f"{'full/rnr':<10} {_k(row['context']):>8} {'-':>9} {'-':>13} {row['step_ms']:>8.2f} "
                f"{row['step_cpu_ms']:>7.2f} {row['attention_cpu_ms']:>8.2f} {row['rest_cpu_ms']:>11.2f} "
                f"{'-':>10} {'-':>7}"
            )
    for part in ("windowed", "full"):
        r = results.get(part)
        if not r or "error" in r:
            continue
        rows = r["rows"]
        ratio = rows[-1]["rest_cpu_ms"] / rows[0]["rest_cpu_ms"]
        lines.append(
            f"{part}: {r['tokens']} tokens in {r['wall_s']:.0f} s ({r['tokens_per_s']:.0f} tokens/s), peak RSS "
            f"{r['peak_rss_mb']:.0f} MB (after load {r['rss_after_load_mb']:.0f} MB, "
            f"KV pool {r['kv_pool_mb']:.0f} MB), "
            f"CPU outside attention per decode step {_k(rows[-1]['context'])} / {_k(rows[0]['context'])} = {ratio:.2f}x"
        )
        if r.get("window_pages_bound"):
            lines.append(
                f"  device pages held at {_k(rows[-1]['context'])}: {rows[-1]['pages_held']} "
                f"(window bound {r['window_pages_bound']})"
            )
        if "redis_bytes_written" in r:
            lines.append(
                f"  Redis: {r['redis_pages_written']} pages, {r['redis_bytes_written'] / 2**20:.0f} MB written "
                f"({r['redis_pages_dropped']} dropped)"
            )
    for m in results.get("memory", {}).get("rows", []):
        lines.append(
            f"prefill chunk {m['chunk']} at {_k(m['context'])}, {m['path']:>7}: peak RSS +{m['peak_growth_mb']:.0f} MB "
            f"beyond the gathered K/V (a dense mask alone: {m['dense_mask_mb']:.0f} MB), {m['seconds']:.2f} s"
        )
    serve = results.get("serve")
    if serve:
        from bench.long_context_serve import lines as serve_lines

        lines += [f"serve failed: {serve['error']}"] if "error" in serve else serve_lines(serve)
    lines.append(f"load average before {results['loadavg_before']}, after {results['loadavg_after']}")
    return "\n".join(lines)


def svg(series: dict[str, list[tuple[int, float]]]) -> str:
    """Log-log lines of (context, step ms)."""
    W, H, L, B = 640, 400, 70, 50
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    if not xs:
        return ""
    x0, x1 = math.log10(min(xs)) - 0.1, math.log10(max(xs)) + 0.1
    y0, y1 = math.log10(min(ys)) - 0.2, math.log10(max(ys)) + 0.2

    def px(x: float, y: float) -> tuple[float, float]:
        return (
            L + (math.log10(x) - x0) / (x1 - x0) * (W - L - 20),
            H - B - (math.log10(y) - y0) / (y1 - y0) * (H - B - 20),
        )

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">']
    out.append(f'<rect width="{W}" height="{H}" fill="white"/>')
    out.append(f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>')
    out.append(f'<line x1="{L}" y1="20" x2="{L}" y2="{H - B}" stroke="black"/>')
    for e in range(math.ceil(x0), math.floor(x1) + 1):
        x, _ = px(10**e, 10**y0)
        out.append(f'<text x="{x:.0f}" y="{H - B + 16}" text-anchor="middle">1e{e}</text>')
    for e in range(math.ceil(y0), math.floor(y1) + 1):
        _, y = px(10**x0, 10**e)
        out.append(f'<text x="{L - 6}" y="{y + 4:.0f}" text-anchor="end">{10**e:g}</text>')
        out.append(f'<line x1="{L}" y1="{y:.0f}" x2="{W - 20}" y2="{y:.0f}" stroke="#ddd"/>')
    out.append(f'<text x="{(W + L) / 2:.0f}" y="{H - 10}" text-anchor="middle">context (tokens)</text>')
    out.append(f'<text x="16" y="{H / 2:.0f}" transform="rotate(-90 16 {H / 2:.0f})">decode step CPU (ms)</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS.get(name, "black")
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (px(a, b) for a, b in pts))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for a, b in pts:
            x, y = px(a, b)
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
        out.append(f'<text x="{L + 10}" y="{30 + 16 * i}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def report(results: dict[str, Any], results_dir: Path, quick: bool) -> None:
    print(table(results))
    series: dict[str, list[tuple[int, float]]] = {}
    for part in ("windowed", "full", "demo"):
        r = results.get(part)
        if r and "error" not in r:
            series[part] = [(row["context"], row["step_cpu_ms"]) for row in r["rows"]]
            if r.get("runner_decode"):
                series["full (runner, random KV)"] = [(x["context"], x["step_cpu_ms"]) for x in r["runner_decode"]]
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"long_context{'_quick' if quick else ''}_{time.strftime('%Y%m%d-%H%M%S')}"
    (results_dir / f"{stem}.json").write_text(json.dumps(results, indent=2))
    if not series:  # a run of the serve or memory part alone leaves the plot as it is
        print(f"wrote {results_dir / stem}.json")
        return
    plot = results_dir / f"long_context{'_quick' if quick else ''}.svg"  # the latest run's, under one name
    plot.write_text(svg(series))
    print(f"wrote {results_dir / stem}.json and {plot}")
