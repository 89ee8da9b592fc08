"""Replay the grammar benchmark's greedy outputs through the engine, without the model.

Greedy output does not depend on drafting, so once the constrained outputs of the extraction
workload (``bench_grammar.py``) are known, the engine's decisions while producing them (forced
tokens, drafts, draft lengths, acceptance) can be replayed exactly with a scripted model
(``loadtests/scripted.py``). Each pass is charged with a forward cost curve measured on this
machine at the workload's context length, so changes to the drafter or the draft-length policy
can be compared in seconds and without timing noise. The benchmark stays the measurement: this is
an estimate of its decode speedup (it leaves out grammar masks and engine bookkeeping, a few %).

Rows:
- ``engine``: the engine as configured (fast-forward + n-gram drafts, adaptive draft length);
- ``oracle sizing``: every draft cut exactly where the model departs from it, an upper bound for
  any draft-length policy with this drafter.

    python -m loadtests.replay_grammar [--articles 30] [--context 900]

The first run decodes the articles with the model (greedy, constrained) and caches the outputs
in ``~/.cache/parrot/replay_grammar_outputs.json``. Prints a markdown table, writes
``loadtests/results/replay_grammar.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parrot.drafting import DraftSizer, DraftSlot
from loadtests.bench_engine import RESULTS, machine
from loadtests.bench_grammar import CONFIGS, SCHEMA, extraction_prompts
from loadtests.scripted import ScriptedForward
from parrot.config import DraftingConfig, load_config
from parrot.engine.costmodel import measure_cost_curve
from parrot.engine.engine import Engine, GenerationRequest
from parrot.engine.loader import load_model
from parrot.engine.sampling import SamplingParams
from parrot.constrain.grammar import GrammarCompiler

CACHE = Path.home() / ".cache" / "parrot" / "replay_grammar_outputs.json"


class OracleSizer:
    """A ``DraftSizer`` that cuts every draft where the script departs from it (it knows the
    model's output in advance)."""

    def __init__(self, script: Sequence[int]) -> None:
        self.script = script

    def __call__(self, slots: Sequence[DraftSlot]) -> list[int]:
        lengths = []
        for slot in slots:
            keep = 0
            while (keep < len(slot.draft) and slot.position + keep < len(self.script)
                   and slot.draft[keep] == self.script[slot.position + keep]):
                keep += 1
            lengths.append(keep)
        return lengths


def _greedy_outputs(loaded: Any, compiler: GrammarCompiler, grammar: str, prompts: list[tuple[str, list[int]]],
                    max_tokens: int) -> list[list[int]]:
    """The constrained greedy outputs, from the cache when it has them for this model and schema."""
    key = hashlib.sha256(json.dumps([loaded.name, SCHEMA, max_tokens]).encode()).hexdigest()[:16]
    cached = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    entries = cached.get(key, {})
    missing = [(i, pid, ids) for i, (pid, ids) in enumerate(prompts) if pid not in entries]
    if missing:
        engine = Engine(loaded.forward, loaded.tokenizer, DraftingConfig(enabled=False))
        for n, (_, pid, ids) in enumerate(missing, 1):
            request = GenerationRequest(ids, SamplingParams(max_tokens=max_tokens), CONFIGS["constrained"],
                                        grammar=compiler.new_state(grammar, False))
            entries[pid] = engine.generate(request).token_ids
            print(f"decoded {n}/{len(missing)} ({pid}, {len(entries[pid])} tokens)", file=sys.stderr)
        cached[key] = entries
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(cached))
    return [entries[pid] for pid, _ in prompts]


def replay(oracle: bool, tokenizer: Any, compiler: GrammarCompiler, grammar: str,
           prompts: list[tuple[str, list[int]]], outputs: list[list[int]], cost: list[float],
           max_tokens: int) -> dict[str, float]:
    """Replay every output; ``oracle``: size drafts with ``OracleSizer`` instead of the policy."""
    tokens = passes = drafted = accepted = 0
    plain = spec = 0.0
    eos = min(tokenizer.eos_token_ids)
    for (_, ids), output in zip(prompts, outputs):
        forward = ScriptedForward(ids + output, tokenizer.vocab_size, eos)
        sizer: DraftSizer | None = OracleSizer(forward.script) if oracle else None
        engine = Engine(forward, tokenizer, DraftingConfig(), cost, sizer=sizer)
        request = GenerationRequest(ids, SamplingParams(max_tokens=max_tokens), CONFIGS["+fast_forward+ngram"],
                                    grammar=compiler.new_state(grammar, True))
        result = engine.generate(request)
        if result.token_ids != output:  # the replay is exact or it is nothing
            raise AssertionError("replayed output differs from the greedy output")
        decode = [fed for fed, logits in forward.passes if logits][1:]  # after the first token
        spec += sum(cost[min(fed, len(cost) - 1)] for fed in decode)
        plain += (len(output) - 1) * cost[1]
        tokens += len(output)
        passes += result.stats.forward_passes
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return {"passes_per_token": passes / tokens, "drafted_per_token": drafted / tokens,
            "accepted_per_token": accepted / tokens, "estimated_decode_speedup": plain / spec}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--articles", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--context", type=int, default=900, help="context length the cost curve is measured at")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    loaded = load_model(load_config().model)
    tokenizer = loaded.tokenizer
    compiler = GrammarCompiler(tokenizer)
    grammar = compiler.compile("json_schema", SCHEMA)
    prompts = extraction_prompts(tokenizer, args.articles)
    outputs = _greedy_outputs(loaded, compiler, grammar, prompts, args.max_tokens)
    cost = measure_cost_curve(loaded.forward, DraftingConfig().max_draft + 1, context=args.context)
    rows = {name: replay(oracle, tokenizer, compiler, grammar, prompts, outputs, cost, args.max_tokens)
            for name, oracle in (("engine", False), ("oracle sizing", True))}

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = (f"Grammar replay, {stamp}, {machine()}; model {loaded.name}; greedy outputs of {len(prompts)} "
              f"extraction articles ({sum(map(len, outputs))} tokens), cost curve at {args.context} tokens of context")
    lines = ["| sizing | passes/token | drafted/token | accepted/token | estimated decode speedup |",
             "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['passes_per_token']:.3f} | {r['drafted_per_token']:.3f} | "
                     f"{r['accepted_per_token']:.3f} | {r['estimated_decode_speedup']:.2f}x |")
    curve_line = "Cost curve (x one token, 1.." + str(len(cost) - 1) + " tokens): " + " ".join(
        f"{c / cost[1]:.2f}" for c in cost[1:])
    table = "\n".join(lines)
    print(header)
    print(table)
    print(curve_line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_grammar.md").write_text(header + "\n\n" + table + "\n\n" + curve_line + "\n")
    (args.out / "replay_grammar.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "articles": [pid for pid, _ in prompts], "context": args.context,
         "cost_curve_s": cost[1:], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
