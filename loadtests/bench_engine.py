"""Engine benchmark: Parrot against transformers on ../shared/data, side by side in one run.

For every prompt (the first N of each task file, greedy, max_tokens 256) four systems run back
to back, so machine noise hits them alike:

- ``hf_greedy``: transformers ``generate(do_sample=False)``, the baseline (1.0);
- ``hf_prompt_lookup``: transformers ``generate(prompt_lookup_num_tokens=10)``;
- ``parrot_off``: Parrot with drafting off;
- ``parrot_on``: Parrot with drafting on (adaptive draft length).

Per task: tokens/s (all output tokens / all seconds), the ratio to the baseline, mean tokens per
forward pass, and the share of prompts whose tokens equal the baseline's. A prompt that differs
is checked for a near tie: at the first differing position, the baseline model's top two logits
must be within ``--near-tie`` of each other.

    python -m loadtests.bench_engine [--prompts 10] [--max-tokens 256] [--tasks a,b]

Prints a markdown table, writes ``loadtests/results/bench_engine.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from parrot.config import load_config
from parrot.engine.costmodel import measure_cost_curve
from parrot.engine.engine import Engine, GenerationRequest, SpeculationParams
from parrot.engine.hf_loading import gguf_blocks, load_transformers
from parrot.engine.loader import prepare
from parrot.engine.sampling import SamplingParams

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ["summarization", "context_qa", "grammar", "code_edit", "open_chat"]
SYSTEMS = ["hf_greedy", "hf_prompt_lookup", "parrot_off", "parrot_on"]


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def load_prompts(task: str, n: int, data_dir: Path) -> list[dict[str, Any]]:
    rows = []
    with open(data_dir / f"{task}.jsonl") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


class HFRunner:
    """transformers generate over the same weights, counting forward passes with a hook."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0
        self.model.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def generate(self, ids: list[int], max_tokens: int, lookup: bool) -> tuple[list[int], float, int]:
        inputs = torch.tensor([ids])
        extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
        self.calls = 0
        begin = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_tokens, do_sample=False, **extra
            )
        seconds = time.perf_counter() - begin
        return out[0, len(ids) :].tolist(), seconds, self.calls

    @torch.inference_mode()
    def pass_cost(self, context: list[int], tokens: int, repeats: int = 5) -> float:
        """Least seconds of one transformers forward over ``tokens`` after ``context`` cached ones."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model(torch.tensor([context]), past_key_values=cache, use_cache=True)
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            self.model(torch.tensor([context[:tokens]]), past_key_values=cache, use_cache=True)
            best = min(best, time.perf_counter() - begin)
            cache.crop(-tokens)
        return best

    @torch.inference_mode()
    def top_gap(self, ids: list[int], a: int, b: int) -> float:
        """|logit(a) - logit(b)| of the baseline model after ``ids``."""
        logits = self.model(torch.tensor([ids])).logits[0, -1].float()
        return abs(float(logits[a] - logits[b]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per task file (default 10)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--near-tie", type=float, default=1e-3, help="largest top-2 logit gap counted as a near tie")
    parser.add_argument("--dtype", default="auto", help="model dtype for every system (auto = float32)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]

    config = load_config(overrides={"model": {"dtype": args.dtype}})
    print("loading models...", file=sys.stderr)
    source, tokenizer, hf_model = load_transformers(config.model)
    # The forward `parrot serve` builds (with GGUF block kernels where the CPU has them); the
    # transformers model it was built from stays the baseline.
    loaded = prepare(hf_model, tokenizer, source.display_name, config.model.backend, gguf_blocks(source, hf_model))
    cost = measure_cost_curve(loaded.forward, config.drafting.max_draft + 1)
    engine = Engine(loaded.forward, loaded.tokenizer, config.drafting, cost, config.server.prefill_chunk)
    hf = HFRunner(hf_model)
    print("cost curve (ms): " + " ".join(f"{c * 1e3:.0f}" for c in cost[1:]), file=sys.stderr)
    context = list(range(1000, 1512))
    pass_costs = {t: {"parrot_ms": cost[t] * 1e3, "transformers_ms": hf.pass_cost(context, t) * 1e3}
                  for t in (1, 8, 16) if t < len(cost)}

    per_prompt: list[dict[str, Any]] = []
    for task in tasks:
        prompts = load_prompts(task, args.prompts, args.data)
        for i, row in enumerate(prompts):
            ids = loaded.tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
            record: dict[str, Any] = {"task": task, "id": row["id"], "prompt_tokens": len(ids)}
            base_ids, seconds, calls = hf.generate(ids, args.max_tokens, lookup=False)
            record["hf_greedy"] = {"tokens": len(base_ids), "seconds": seconds, "passes": calls, "identical": True}
            look_ids, seconds, calls = hf.generate(ids, args.max_tokens, lookup=True)
            record["hf_prompt_lookup"] = {
                "tokens": len(look_ids), "seconds": seconds, "passes": calls, "identical": look_ids == base_ids,
            }
            for name, enabled in (("parrot_off", False), ("parrot_on", True)):
                request = GenerationRequest(ids, SamplingParams(max_tokens=args.max_tokens), SpeculationParams(enabled=enabled))
                begin = time.perf_counter()
                result = engine.generate(request)
                seconds = time.perf_counter() - begin
                out = result.token_ids
                entry = {
                    "tokens": len(out), "seconds": seconds, "passes": result.stats.forward_passes,
                    "drafted": result.stats.drafted_tokens, "accepted": result.stats.accepted_tokens,
                    "identical": out == base_ids,
                }
                if out != base_ids:
                    at = next((j for j, (x, y) in enumerate(zip(out, base_ids)) if x != y), min(len(out), len(base_ids)))
                    entry["first_divergence"] = at
                    if at < min(len(out), len(base_ids)):
                        gap = hf.top_gap(ids + base_ids[:at], base_ids[at], out[at])
                        entry["divergence_gap"] = gap
                        entry["near_tie"] = gap <= args.near_tie
                    else:
                        entry["near_tie"] = False  # one is a prefix of the other: not a tie
                record[name] = entry
            per_prompt.append(record)
            speed = {s: record[s]["tokens"] / record[s]["seconds"] for s in SYSTEMS}
            print(
                f"[{task} {i + 1}/{len(prompts)}] {row['id']}: "
                + ", ".join(f"{s} {speed[s]:.1f} tok/s" for s in SYSTEMS)
                + f", on/base {speed['parrot_on'] / speed['hf_greedy']:.2f}x",
                file=sys.stderr,
            )

    summary = summarize(per_prompt, tasks)
    table = render_table(summary)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = (
        f"Engine benchmark, {stamp}, {machine()}; model {loaded.name} ({loaded.backend}, "
        f"{str(loaded.dtype).removeprefix('torch.')}), {args.prompts} prompts per task, greedy, "
        f"max_tokens {args.max_tokens}"
    )
    cost_table = "\n".join(
        ["| tokens in the pass (512 cached) | Parrot forward (ms) | transformers forward (ms) |", "|---:|---:|---:|"]
        + [f"| {t} | {c['parrot_ms']:.0f} | {c['transformers_ms']:.0f} |" for t, c in pass_costs.items()]
    )
    table = table + "\n\n" + cost_table
    print(header)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_engine" if args.dtype == "auto" else f"bench_engine_{args.dtype}"
    (args.out / f"{stem}.md").write_text(header + "\n\n" + table + "\n")
    (args.out / f"{stem}.json").write_text(
        json.dumps(
            {"date": stamp, "machine": machine(), "model": loaded.name, "cost_curve_s": cost, "pass_costs": pass_costs,
             "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "prompts": per_prompt},
            indent=1,
        )
    )
    return 0


def summarize(per_prompt: list[dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for task in tasks:
        rows = [r for r in per_prompt if r["task"] == task]
        if not rows:
            continue
        task_summary = {}
        base_speed = sum(r["hf_greedy"]["tokens"] for r in rows) / sum(r["hf_greedy"]["seconds"] for r in rows)
        for system in SYSTEMS:
            tokens = sum(r[system]["tokens"] for r in rows)
            seconds = sum(r[system]["seconds"] for r in rows)
            passes = sum(r[system]["passes"] for r in rows)
            diverged = [r[system] for r in rows if not r[system]["identical"]]
            task_summary[system] = {
                "tokens_per_s": tokens / seconds,
                "ratio": tokens / seconds / base_speed,
                "tokens_per_pass": tokens / max(passes, 1),
                "identical_share": sum(r[system]["identical"] for r in rows) / len(rows),
                "divergences": len(diverged),
                "near_ties": sum(bool(d.get("near_tie")) for d in diverged),
            }
        summary[task] = task_summary
    return summary


def render_table(summary: dict[str, Any]) -> str:
    lines = [
        "| task | system | tokens/s | vs greedy | tokens/pass | identical to greedy | divergences (near ties) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for task, systems in summary.items():
        for system, s in systems.items():
            lines.append(
                f"| {task} | {system} | {s['tokens_per_s']:.1f} | {s['ratio']:.2f}x | {s['tokens_per_pass']:.2f} | "
                f"{s['identical_share']:.0%} | {s['divergences']} ({s['near_ties']}) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
