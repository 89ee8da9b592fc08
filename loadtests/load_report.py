"""Summaries, the markdown table and the PNG plots of a load test (``loadtests/load.py``).

Definitions (times in seconds, from the client's side):
- TTFT: request sent -> first streamed chunk with text (streaming runs only);
- ITL: gap between consecutive streamed chunks with text. A verification pass can put several
  tokens into one chunk, so with speculation the gaps are fewer and longer; TPOT, the time per
  output token after the first, ``(e2e - ttft) / (completion_tokens - 1)`` per request, is the
  comparable per-token figure;
- e2e: request sent -> response complete;
- throughput: successful requests and their output tokens over the run's wall time (first
  request sent -> last response complete).
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from typing import Any

LATENCIES = ("ttft_s", "itl_s", "tpot_s", "e2e_s")


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolation quantile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def samples(records: list[dict[str, Any]], key: str) -> list[float]:
    """All values of one latency over the successful requests (ITL: every gap of every request)."""
    ok = [r for r in records if r["status"] == "ok"]
    if key == "itl_s":
        return [gap for r in ok for gap in r["itl_s"]]
    return [r[key] for r in ok if r.get(key) is not None]


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    records = run["requests"]
    ok = [r for r in records if r["status"] == "ok"]
    wall = max(run["wall_s"], 1e-9)
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    passes = sum((r["speculation"] or {}).get("forward_passes", 0) for r in ok)
    drafted = sum((r["speculation"] or {}).get("drafted_tokens", 0) for r in ok)
    accepted = sum((r["speculation"] or {}).get("accepted_tokens", 0) for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(r["status"] == "error" for r in records),
        "timeouts": sum(r["status"] == "timeout" for r in records),
        "error_statuses": sorted({str(r["http_status"] or r["error"]) for r in records if r["status"] != "ok"}),
        "wall_s": run["wall_s"],
        "requests_per_s": len(ok) / wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "forward_passes": passes,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "tokens_per_pass": out_tokens / passes if passes else None,
        "acceptance_rate": accepted / drafted if drafted else None,
    }
    for key in LATENCIES:
        values = samples(records, key)
        summary[key] = {f"p{q}": quantile(values, q) for q in (50, 90, 99)} | {"mean": sum(values) / len(values) if values else None, "count": len(values)}
    return summary


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per run, latencies as p50 / p90 / p99; "load avg" is the machine's 1-minute
    load average as the run started (other work on a shared machine shows there)."""
    head = ("| speculation | load | ok | err | timeout | req/s | out tok/s | TTFT s p50 / p90 / p99 | ITL ms p50 / p90 / p99 "
            "| TPOT ms p50 / p90 / p99 | e2e s p50 / p90 / p99 | tok/pass | load avg |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        s = run["summary"]
        lines.append(
            f"| {run['speculation_label']} | {run['load_label']} | {s['ok']} | {s['errors']} | {s['timeouts']} "
            f"| {s['requests_per_s']:.3f} | {s['output_tokens_per_s']:.1f} "
            f"| {' / '.join(_s(s['ttft_s'][p]) for p in ('p50', 'p90', 'p99'))} "
            f"| {' / '.join(_ms(s['itl_s'][p]) for p in ('p50', 'p90', 'p99'))} "
            f"| {' / '.join(_ms(s['tpot_s'][p]) for p in ('p50', 'p90', 'p99'))} "
            f"| {' / '.join(_s(s['e2e_s'][p]) for p in ('p50', 'p90', 'p99'))} "
            f"| {'-' if s['tokens_per_pass'] is None else format(s['tokens_per_pass'], '.2f')} "
            f"| {'-' if run.get('loadavg_before') is None else format(run['loadavg_before'], '.2f')} |"
        )
    return "\n".join(lines)


def failures(runs: list[dict[str, Any]]) -> str:
    """One line per run with failed requests: how many, by HTTP status (or timeout), with a sample message."""
    lines = []
    for run in runs:
        by_kind: dict[str, list[str]] = {}
        for r in run["requests"]:
            if r["status"] != "ok":
                kind = "timeout" if r["status"] == "timeout" else f"HTTP {r['http_status']}" if r["http_status"] else "transport"
                by_kind.setdefault(kind, []).append(r["error"] or "")
        if by_kind:
            parts = [f"{len(v)} x {k} ({v[0][:120]})" for k, v in by_kind.items()]
            lines.append(f"- {run['load_label']}, speculation {run['speculation_label']}: " + "; ".join(parts))
    return "\n".join(lines)


def compare_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: speculation on against off at each load level (ratios > 1 favour speculation)."""
    by_level: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_level.setdefault(run["load_label"], {})[run["speculation_label"]] = run["summary"]
    lines = ["| load | out tok/s on / off | speed-up | TTFT p50 s on / off | TTFT p99 s on / off | e2e p50 s on / off |",
             "|---|---|---|---|---|---|"]
    for level, pair in by_level.items():
        on, off = pair.get("on"), pair.get("off")
        if on is None or off is None:
            continue
        ratio = on["output_tokens_per_s"] / off["output_tokens_per_s"] if off["output_tokens_per_s"] else None
        lines.append(
            f"| {level} | {on['output_tokens_per_s']:.1f} / {off['output_tokens_per_s']:.1f} "
            f"| {'-' if ratio is None else format(ratio, '.2f') + 'x'} "
            f"| {_s(on['ttft_s']['p50'])} / {_s(off['ttft_s']['p50'])} | {_s(on['ttft_s']['p99'])} / {_s(off['ttft_s']['p99'])} "
            f"| {_s(on['e2e_s']['p50'])} / {_s(off['e2e_s']['p50'])} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def _style(run: dict[str, Any], levels: list[str]) -> dict[str, Any]:
    import matplotlib

    colors = matplotlib.colormaps["viridis"]
    i = levels.index(run["load_label"])
    return {
        "color": colors(0.85 * i / max(1, len(levels) - 1)),
        "linestyle": "--" if run["speculation_label"] == "off" else "-",
        "label": f"{run['load_label']}, speculation {run['speculation_label']}",
    }


def plot_cdfs(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """Latency CDFs (TTFT, ITL, e2e), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(dict.fromkeys(r["load_label"] for r in runs))
    panels = [("ttft_s", "time to first token (s)", 1.0), ("itl_s", "inter-chunk latency (ms)", 1000.0),
              ("tpot_s", "time per output token (ms)", 1000.0), ("e2e_s", "end-to-end latency (s)", 1.0)]
    fig, grid = plt.subplots(2, 2, figsize=(11, 8.4), constrained_layout=True)
    axes = list(grid.flat)
    for ax, (key, xlabel, scale) in zip(axes, panels):
        for run in runs:
            values = sorted(v * scale for v in samples(run["requests"], key))
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", linewidth=1.6, **_style(run, levels))
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if key == "itl_s":  # chunk gaps span decades: one token in 100 ms to a draft in one pass
            ax.set_xscale("log")
    handles, labels = axes[-1].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(runs: list[dict[str, Any]], path: str, title: str, x_label: str) -> None:
    """Output tokens/s and TTFT p99 (p50 dotted) against the load level, one line per speculation setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colors = {"on": "#2f6fdb", "off": "#e0533d", "server default": "#2a9d5b"}
    for setting in dict.fromkeys(r["speculation_label"] for r in runs):
        mine = sorted((r for r in runs if r["speculation_label"] == setting), key=lambda r: r["level"])
        xs = [r["level"] for r in mine]
        color = colors.get(setting, "#555")
        ax_tps.plot(xs, [r["summary"]["output_tokens_per_s"] for r in mine], "o-", color=color, label=f"speculation {setting}")
        ax_ttft.plot(xs, [r["summary"]["ttft_s"]["p99"] for r in mine], "o-", color=color, label=f"p99, speculation {setting}")
        ax_ttft.plot(xs, [r["summary"]["ttft_s"]["p50"] for r in mine], "o:", color=color, alpha=0.7, label=f"p50, speculation {setting}")
    for ax, ylabel in ((ax_tps, "output tokens/s"), (ax_ttft, "time to first token (s)")):
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["level"] for r in runs}), [f"{v:g}" for v in sorted({r["level"] for r in runs})])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
