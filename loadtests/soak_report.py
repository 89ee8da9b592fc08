"""The soak's summary, goals and markdown tables (``loadtests/soak.py`` gathers the records)."""

from __future__ import annotations

from collections import Counter
from typing import Any

# Every request ends in exactly one of these (soak.py's ``send`` never raises).
OUTCOMES = ("ok", "expected_4xx", "cancelled", "unexpected_5xx", "error_event", "unexpected_status", "bad_response",
            "transport_error", "timeout")
FAULTS = ("unexpected_status", "bad_response", "transport_error", "timeout")
COLUMNS = (("complete", False, "non-streamed"), ("complete", True, "streamed"), ("cancel_stream", True, "cancelled mid-stream"),
           ("cancel_wait", False, "cancelled before the answer"), ("malformed", False, "malformed"))


def _growth(rss: dict[str, int | None]) -> float | None:
    start, end = rss.get("start"), rss.get("end")
    return None if not start or end is None else 100.0 * (end - start) / start


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    records = result["records"]
    soak = [r for r in records if r["phase"] == "soak"]
    # A 4xx for a reference candidate means the server refuses that schema: not a fault, replaced.
    refused = {item["key"] for item in result["pool_refused"]}
    others = [r for r in records if r["phase"] != "soak" and not (r["phase"] == "reference" and r["kind"] in refused)]
    outcomes = Counter(r["outcome"] for r in soak)
    ok = [r for r in soak if r["outcome"] == "ok"]
    lost = result["issued"] - len(soak)
    corrupted = [r for r in records if r["mismatch"]]
    violations = [r for r in records if r["violation"]]
    server_errors = sum(r["outcome"] in ("unexpected_5xx", "error_event") for r in records)
    faults = sum(r["outcome"] in FAULTS for r in soak) + sum(r["outcome"] != "ok" for r in others)
    growth = _growth(result["rss_kb"])
    # Single readings move by several percent with what the last requests allocated; the medians
    # of the first and last tenth of the soak's samples show a trend that one reading cannot.
    samples = [kb for at, kb in result["rss_samples"] if kb and result["phases_at"]["soak"] <= at <= result["phases_at"]["soak_end"]]
    tenth = max(1, len(samples) // 10)
    first, last = (sorted(samples[:tenth])[tenth // 2], sorted(samples[-tenth:])[tenth // 2]) if samples else (None, None)
    counted = sum(result["server_counted"].values())
    goals = {
        "0 lost": lost == 0 and not result["client_crashes"],
        "0 corrupted": not corrupted,
        "0 unexpected 5xx or error events": server_errors == 0,
        "0 other unexpected outcomes": faults == 0,
        "0 constraint violations": not violations,
        "server idle after the soak, /health 200 after the recheck": bool(result["idle_after_soak"]) and result["health_after"] == 200,
        "server counted every soak request": counted == result["issued"],
        "RSS growth under 5%": growth is not None and growth < 5.0,
    }
    if result.get("server_exit") is not None or result.get("server_log_problems") is not None:
        goals["server exit 0 after SIGTERM, no errors in its log"] = (result["server_exit"] == 0
                                                                      and not result["server_log_problems"])
    return {
        "issued": result["issued"], "recorded": len(soak), "lost": lost,
        "outcomes": {name: outcomes.get(name, 0) for name in OUTCOMES},
        "by_action": {label: {name: sum(r["outcome"] == name for r in soak if r["action"] == action and r["stream"] == stream)
                              for name in OUTCOMES} for action, stream, label in COLUMNS},
        "compared": sum(r["compared"] for r in records), "compared_soak": sum(r["compared"] for r in soak),
        "corrupted": len(corrupted), "constraint_violations": len(violations),
        "finished_constrained": sum(r["finish_reason"] == "stop" and result["pool"].get(r["kind"], {}).get("constraint", "none") != "none"
                                    for r in records if r["compared"] and r["outcome"] == "ok"),
        "unexpected_5xx_or_error_events": server_errors, "other_unexpected": faults,
        "other_phases": dict(Counter(f"{r['phase']}:{r['outcome']}" for r in others)),
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in ok),
        "drafted": sum(r["drafted"] for r in ok), "accepted": sum(r["accepted"] for r in ok),
        "server_counted": counted, "rss_growth_percent": growth, "goals": goals,
        "rss_soak_tenths_kb": [first, last], "rss_soak_range_kb": [min(samples, default=None), max(samples, default=None)],
    }


def _mb(kb: int | None) -> str:
    return "n/a" if kb is None else f"{kb / 1024:.1f} MB"


def render(result: dict[str, Any]) -> str:
    s, settings, m = result["summary"], result["settings"], result["machine"]
    rss, phases = result["rss_kb"], result["phases_s"]
    pool = result["pool"]
    lines = [f"# Soak {result['date']}: {s['issued']} requests at concurrency {settings['concurrency']} ({result['model']})", "",
             f"{m['cpu']} ({m['isa']}), {m['cores']} vCPUs; max_tokens {settings['max_tokens']}, pool of {len(pool)} distinct "
             f"valid requests ({dict(Counter(v['task'] for v in pool.values()))}; "
             f"{dict(Counter(v['constraint'] for v in pool.values()))}; {dict(Counter(v['sampling'] for v in pool.values()))}; "
             f"drafting off in {sum(not v['drafting'] for v in pool.values())}), seed {settings['seed']}.", "",
             "| outcome | " + " | ".join(label for _, _, label in COLUMNS) + " | all |",
             "|---|" + "---:|" * (len(COLUMNS) + 1)]
    for name in s["outcomes"]:
        row = [s["by_action"][label][name] for _, _, label in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(map(str, row)) + f" | {s['outcomes'][name]} |")
    totals = [sum(s["by_action"][label].values()) for _, _, label in COLUMNS]
    lines.append("| **all** | " + " | ".join(map(str, totals)) + f" | {s['recorded']} |")
    growth = "n/a" if s["rss_growth_percent"] is None else f"{s['rss_growth_percent']:+.2f}%"
    paused = sum(p["seconds"] for p in result["pauses"])
    warmed = sum(r["phase"] == "warmup" for r in result["records"])
    lines += ["",
              f"- Lost: {s['lost']} ({s['issued']} issued, {s['recorded']} recorded; the server counted {s['server_counted']}: "
              f"{result['server_counted']}).",
              f"- Compared with the sequential output: {s['compared']} answers ({s['compared_soak']} in the soak, cancelled "
              f"streams as prefixes), corrupted {s['corrupted']}; constrained outputs finished {s['finished_constrained']}, "
              f"violations {s['constraint_violations']}.",
              f"- Unexpected 5xx or error events: {s['unexpected_5xx_or_error_events']}; other unexpected outcomes: "
              f"{s['other_unexpected']}; outside the soak: {s['other_phases']}; pool candidates refused: {len(result['pool_refused'])}.",
              f"- Server RSS: loaded {_mb(rss['loaded'])}, after the references {_mb(rss['after_reference'])}, start (after "
              f"the warm-up of {warmed} requests) {_mb(rss['start'])}, end {_mb(rss['end'])}: growth {growth}. During the soak: "
              f"{_mb(s['rss_soak_range_kb'][0])} to {_mb(s['rss_soak_range_kb'][1])}, median of the first tenth of "
              f"the samples {_mb(s['rss_soak_tenths_kb'][0])}, of the last tenth {_mb(s['rss_soak_tenths_kb'][1])}.",
              f"- Time: soak {phases['soak_s']:.0f} s, references {phases['reference_s']:.0f} s, warm-up {phases['warmup_s']:.0f} s, "
              f"settle {phases['settle_s']:.0f} s, recheck {phases['recheck_s']:.0f} s; wall {result['wall_s']:.0f} s. "
              f"Pauses (this process stopped): {len(result['pauses'])}, {paused:.0f} s; server seen stopped in "
              f"{result['server_stopped_samples']} samples.",
              f"- Drafting in the soak's finished answers: {s['accepted']}/{s['drafted']} drafted tokens accepted, "
              f"{s['completion_tokens']} completion tokens.",
              "", "| goal | met |", "|---|---|"]
    lines += [f"| {goal} | {'yes' if met else '**no**'} |" for goal, met in s["goals"].items()]
    bad = [r for r in result["records"] if r["mismatch"] or r["violation"] or r["outcome"] in FAULTS + ("unexpected_5xx", "error_event")]
    if bad:
        lines += ["", "Requests that failed a check:"]
        lines += [f"- {r['phase']} #{r['index']} {r['action']} {r['kind']}: {r['outcome']} {r['http_status']} "
                  f"{r['error'] or ''} {r['mismatch'] or ''} {r['violation'] or ''}"[:600] for r in bad[:40]]
    if result.get("server_log_problems"):
        lines += ["", f"Server log problems ({len(result['server_log_problems'])}):"]
        lines += [f"    {line[:300]}" for line in result["server_log_problems"][:20]]
    return "\n".join(lines)
