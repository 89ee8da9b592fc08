"""Replay a model's greedy chat answers through the engine to study the drafting policy.

Greedy output does not depend on drafting, so once a model's answers to the evaluation prompts
are known, the engine's drafting decisions while producing them can be replayed exactly with a
scripted model (``loadtests/scripted.py``), each pass charged with a cost curve measured on this
model and machine at the prompts' context length. Variants of the drafter and the draft-length
policy are then compared in seconds, per task, without timing noise (an estimate: engine
bookkeeping is left out; the benchmarks stay the measurement).

Rows (each per task: summaries, context QA, grammar corrections, code edits, open chat):

- ``engine``: drafting as configured (suffix drafter, adaptive draft length up to 16);
- ``max_draft 8`` / ``max_draft 32``: shorter or longer drafts allowed;
- ``min_n 2``: no drafts from 1-token matches; ``max_n 16``: matches up to 16 tokens long;
- ``oracle sizing``: every draft cut where the model departs from it, the bound of any
  draft-length policy with this drafter;
- ``ideal copy``: a drafter that always proposes the longest run of the answer's next tokens that
  occurs anywhere in the prompt or the answer so far (it knows the answer), sized by the policy:
  the bound of any drafter that copies from the sequence, whatever source or match it picks.

It also prints, per task, how the answers copy: the share of answer tokens in copied runs of
at least 4 and 16 tokens (runs as ``ideal copy`` finds them) and the mean run length.

    python -m loadtests.replay_drafting --model qwen2.5-coder-1.5b [--per-task 6] [--max-tokens 256]

The first run decodes the prompts with the model (greedy, drafting on: the same tokens) and caches
the answers in ``~/.cache/parrot/replay_drafting_outputs.json``. Prompts are the first rows of
each task's file (``bench_peers`` measures on the last ones). Prints markdown tables, writes
``loadtests/results/replay_drafting.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtests.bench_engine import DATA, RESULTS, machine
from loadtests.bench_peers import TASKS
from loadtests.replay_grammar import OracleSizer
from loadtests.scripted import ScriptedForward
from parrot.config import DraftingConfig, ModelConfig
from parrot.drafting import Draft, register_drafter
from parrot.drafting.drafter import TokenId
from parrot.drafting.registry import DrafterSettings, drafter_methods
from parrot.engine.costmodel import measure_cost_curve
from parrot.engine.engine import Engine, GenerationRequest
from parrot.engine.loader import load_model
from parrot.engine.sampling import SamplingParams

CACHE = Path.home() / ".cache" / "parrot" / "replay_drafting_outputs.json"


class IdealCopy:
    """A drafter that knows the answer (``script``: prompt + answer) and proposes the longest run
    of its next tokens found anywhere in the live sequence."""

    script: list[TokenId] = []  # set before each replay

    def __init__(self, stop_token_ids: Iterable[TokenId]) -> None:
        self.live: list[TokenId] = []
        self.stop_token_ids = frozenset(stop_token_ids)

    def extend(self, tokens: Iterable[TokenId]) -> None:
        self.live.extend(tokens)

    def add_context(self, tokens: Sequence[TokenId]) -> None:
        pass

    def propose(self, max_len: int, after: Sequence[TokenId] = ()) -> Draft:
        start = len(self.live) + len(after)
        target = self.script[start : start + max_len]
        return Draft(target[: longest_run(self.live, target)], 1)


@register_drafter("ideal_copy")
def _ideal(settings: DrafterSettings) -> IdealCopy:
    return IdealCopy(settings.stop_token_ids)


def longest_run(source: Sequence[TokenId], target: Sequence[TokenId]) -> int:
    """The longest k such that target[:k] occurs in ``source``."""
    best = 0
    if not target:
        return 0
    for i, token in enumerate(source):
        if token != target[0]:
            continue
        k = 1
        while k < len(target) and i + k < len(source) and source[i + k] == target[k]:
            k += 1
        best = max(best, k)
        if best == len(target):
            break
    return best


def copy_runs(prompt: list[TokenId], answer: list[TokenId]) -> list[int]:
    """The answer cut greedily into runs copied from what precedes them (1 for a token that is not)."""
    runs, at = [], 0
    while at < len(answer):
        k = longest_run(prompt + answer[:at], answer[at:])
        runs.append(max(k, 1))
        at += max(k, 1)
    return runs


def prompts_of(tokenizer: Any, per_task: int) -> list[tuple[str, str, list[int]]]:
    """(task, id, chat prompt ids) of the first ``per_task`` rows of each task."""
    out = []
    for task in TASKS:
        with open(DATA / f"{task}.jsonl") as f:
            rows = [json.loads(line) for line in f][:per_task]
        for n, row in enumerate(rows):
            ids = tokenizer.encode_chat([{"role": "user", "content": row["prompt"]}])
            out.append((task, str(row.get("id", f"{task}-{n}")), ids))
    return out


def greedy_answers(loaded: Any, prompts: list[tuple[str, str, list[int]]], cost: list[float],
                   max_tokens: int) -> list[list[int]]:
    key = hashlib.sha256(json.dumps([loaded.name, max_tokens]).encode()).hexdigest()[:16]
    cached = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    entries = cached.get(key, {})
    missing = [(pid, ids) for _, pid, ids in prompts if pid not in entries]
    if missing:
        engine = Engine(loaded.forward, loaded.tokenizer, DraftingConfig(), cost)
        for n, (pid, ids) in enumerate(missing, 1):
            entries[pid] = engine.generate(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens))).token_ids
            print(f"decoded {n}/{len(missing)} ({pid}, {len(entries[pid])} tokens)", file=sys.stderr, flush=True)
            cached[key] = entries
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            CACHE.write_text(json.dumps(cached))
    return [entries[pid] for _, pid, _ in prompts]


def replay(tokenizer: Any, prompts: list[tuple[str, str, list[int]]], answers: list[list[int]], cost: list[float],
           drafting: DraftingConfig, oracle: bool, max_tokens: int) -> dict[str, dict[str, float]]:
    """Per task: passes and drafts per answer token, and the decode speedup the cost curve gives."""
    eos = min(tokenizer.eos_token_ids)
    sums: dict[str, dict[str, float]] = {}
    for (task, _, ids), answer in zip(prompts, answers):
        forward = ScriptedForward(ids + answer, tokenizer.vocab_size, eos)
        IdealCopy.script = forward.script
        engine = Engine(forward, tokenizer, drafting, cost, sizer=OracleSizer(forward.script) if oracle else None)
        result = engine.generate(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens)))
        if result.token_ids != answer:  # the replay is exact or it is nothing
            raise AssertionError("replayed answer differs from the greedy answer")
        decode = [fed for fed, logits in forward.passes if logits][1:]  # after the first token
        s = sums.setdefault(task, dict.fromkeys(("tokens", "passes", "drafted", "accepted", "plain", "spec"), 0.0))
        s["spec"] += sum(cost[min(fed, len(cost) - 1)] for fed in decode)
        s["plain"] += (len(answer) - 1) * cost[1]
        s["tokens"] += len(answer) - 1
        s["passes"] += len(decode)
        s["drafted"] += result.stats.drafted_tokens
        s["accepted"] += result.stats.accepted_tokens
    return {task: {"tokens_per_pass": s["tokens"] / max(s["passes"], 1),
                   "accepted_of_drafted": s["accepted"] / max(s["drafted"], 1),
                   "drafted_per_token": s["drafted"] / max(s["tokens"], 1),
                   "estimated_decode_speedup": s["plain"] / max(s["spec"], 1e-12)}
            for task, s in sums.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a GGUF path or a loadtests.real_models name (default: the embedded model)")
    parser.add_argument("--per-task", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from loadtests.real_models import resolve

    loaded = load_model(ModelConfig(source=resolve(args.model)) if args.model else ModelConfig())
    tokenizer = loaded.tokenizer
    prompts = prompts_of(tokenizer, args.per_task)
    context = int(statistics.median(len(ids) for _, _, ids in prompts))
    print(f"measuring the cost curve at {context} tokens of context", file=sys.stderr, flush=True)
    cost = measure_cost_curve(loaded.forward, 33, context=context)
    answers = greedy_answers(loaded, prompts, cost, args.max_tokens)

    base = DraftingConfig()
    assert "ideal_copy" in drafter_methods()
    variants = {
        "engine": (base, False),
        "max_draft 8": (replace(base, max_draft=8), False),
        "max_draft 32": (replace(base, max_draft=32), False),
        "min_n 2": (replace(base, min_n=2), False),
        "max_n 16": (replace(base, max_n=16), False),
        "oracle sizing": (base, True),
        "ideal copy": (replace(base, method="ideal_copy"), False),
        "ideal copy, max_draft 32": (replace(base, method="ideal_copy", max_draft=32), False),
    }
    rows = {name: replay(tokenizer, prompts, answers, cost, drafting, oracle, args.max_tokens)
            for name, (drafting, oracle) in variants.items()}

    copying: dict[str, dict[str, float]] = {}
    for task in TASKS:
        runs = [r for (t, _, ids), answer in zip(prompts, answers) if t == task for r in copy_runs(ids, answer)]
        total = sum(runs)
        copying[task] = {"answer_tokens": total, "in_runs_4": sum(r for r in runs if r >= 4) / total,
                         "in_runs_16": sum(r for r in runs if r >= 16) / total,
                         "mean_run": statistics.mean(r for r in runs if r > 1) if any(r > 1 for r in runs) else 0.0}

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = (f"Drafting replay, {stamp}, {machine()}; model {loaded.name}; greedy answers to {args.per_task} "
              f"prompts per task (max_tokens {args.max_tokens}), cost curve at {context} tokens of context")
    lines = ["Estimated decode speedup over plain decoding (tokens per pass):", "",
             "| variant | " + " | ".join(TASKS) + " |", "|---|" + "---:|" * len(TASKS)]
    for name, by_task in rows.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{by_task[t]['estimated_decode_speedup']:.2f}x ({by_task[t]['tokens_per_pass']:.2f})" for t in TASKS) + " |")
    lines += ["", "How the answers copy (runs found in the prompt or the answer so far):", "",
              "| task | answer tokens | in runs >= 4 | in runs >= 16 | mean run (> 1) | engine: accepted / drafted |",
              "|---|---:|---:|---:|---:|---:|"]
    for task in TASKS:
        c = copying[task]
        lines.append(f"| {task} | {c['answer_tokens']} | {c['in_runs_4']:.0%} | {c['in_runs_16']:.0%} | "
                     f"{c['mean_run']:.1f} | {rows['engine'][task]['accepted_of_drafted']:.0%} |")
    curve = "Cost curve (x one token, 1..33 tokens): " + " ".join(f"{c / cost[1]:.2f}" for c in cost[1:])
    text = "\n".join([header, "", *lines, "", curve])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_drafting.md").write_text(text + "\n")
    (args.out / "replay_drafting.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "model": loaded.name, "per_task": args.per_task,
         "max_tokens": args.max_tokens, "context": context, "cost_curve_s": cost[1:], "rows": rows,
         "copying": copying}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
