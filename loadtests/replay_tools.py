"""Drafting inside tool-call arguments that copy a file, replayed with a model that does the task.

    python -m loadtests.replay_tools [--rows 20] [--context 900]

An agent's ``write_file(path, content)`` call whose ``content`` is the edited file is the best
case for drafting, but the embedded 135M model does not make such calls (``bench_tools.py``: it
answers with empty arguments). So the call is scripted: for rows of
../shared/data/code_edit.jsonl, the chat request is the row's edit request with the tool, rendered
as the API renders it, and the "model" (``loadtests/scripted.py``) writes
``write_file({"path": "main.py", "content": <the row's reference edit>})`` in the tool-call
format, through the real tool grammar, drafter and draft-length policy. Greedy output does not
depend on drafting, so the replay is exact; each pass is charged with the cost curve measured on
this machine's forward at ``--context`` tokens (as ``replay_grammar.py`` does).

Rows: drafting off; drafting on with the prompt as sent; drafting on with the JSON-escaped view of
the prompt the API adds to the draft context of JSON and tool outputs (``escaped_context``: the
file inside a JSON string has ``\\n`` and ``\\"`` where the prompt has newlines and quotes). Prints
a table and writes loadtests/results/replay_tools.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from loadtests.bench_engine import DATA, RESULTS, machine
from loadtests.bench_tools import WRITE_FILE
from loadtests.scripted import ScriptedForward
from parrot.config import DraftingConfig, load_config
from parrot.engine.costmodel import measure_cost_curve
from parrot.engine.engine import Engine, GenerationRequest, SpeculationParams
from parrot.engine.loader import load_model
from parrot.engine.sampling import SamplingParams
from parrot.server.routes.generation import escaped_context
from parrot.constrain.grammar import GrammarCompiler
from parrot.constrain.tools import call_text, tool_grammar

MODES = {"off": (False, False), "on, prompt as sent": (True, False), "on, + escaped view": (True, True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--context", type=int, default=900, help="context length the cost curve is measured at")
    parser.add_argument("--out", default=str(RESULTS / "replay_tools.json"))
    args = parser.parse_args(argv)

    loaded = load_model(load_config().model)
    tokenizer = loaded.tokenizer
    compiler = GrammarCompiler(tokenizer)
    function: dict[str, Any] = WRITE_FILE["function"]  # type: ignore[assignment]
    grammar = compiler.compile("lark", tool_grammar([function], required=True, parallel=False))
    cost = measure_cost_curve(loaded.forward, DraftingConfig().max_draft + 1, context=args.context)
    with open(DATA / "code_edit.jsonl") as f:
        rows = [json.loads(line) for line in f][: args.rows]
    eos = min(tokenizer.eos_token_ids)
    totals = {mode: {"tokens": 0, "passes": 0, "drafted": 0, "accepted": 0, "seconds": 0.0} for mode in MODES}
    for index, row in enumerate(rows):
        message = row["prompt"] + "\n\nSave the edited code with write_file."
        prompt = tokenizer.encode_chat([{"role": "user", "content": message}], tools=[WRITE_FILE])
        arguments = json.dumps({"path": "main.py", "content": row["reference"]}, ensure_ascii=False, separators=(",", ":"))
        output = tokenizer.encode(call_text("write_file", arguments)) + [eos]
        line = []
        for mode, (drafting, view) in MODES.items():
            forward = ScriptedForward(prompt + output, tokenizer.vocab_size, eos)
            engine = Engine(forward, tokenizer, DraftingConfig(), cost)
            context = escaped_context(tokenizer, [message]) if view else []
            result = engine.generate(GenerationRequest(prompt, SamplingParams(max_tokens=len(output) + 8),
                                                       SpeculationParams(enabled=drafting), context,
                                                       compiler.new_state(grammar)))
            if result.token_ids != output[:-1]:  # the replay is exact or it is nothing
                raise AssertionError(f"{row['id']}: replayed output differs from the script ({mode})")
            t = totals[mode]
            t["tokens"] += len(result.token_ids)
            t["passes"] += result.stats.forward_passes
            t["drafted"] += result.stats.drafted_tokens
            t["accepted"] += result.stats.accepted_tokens
            t["seconds"] += sum(cost[min(fed, len(cost) - 1)] for fed, logits in forward.passes[1:] if logits)
            line.append(f"{mode}: {result.stats.forward_passes} passes")
        print(f"[{index + 1}/{len(rows)}] {row['id']} ({len(output) - 1} tokens): " + "; ".join(line), flush=True)

    off = totals["off"]["seconds"]
    summary = {mode: {**t, "passes_per_token": t["passes"] / t["tokens"], "estimated_speedup": off / t["seconds"]}
               for mode, t in totals.items()}
    report: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "model": loaded.name,
                              "rows": len(rows), "context": args.context, "cost_curve_s": cost[1:], "summary": summary}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwrite_file calls copying the edited file, scripted, {len(rows)} code-edit rows "
          f"({sum(t['tokens'] for t in totals.values()) // len(MODES)} argument tokens), {report['date']}, "
          f"{report['machine']}, cost curve at {args.context} tokens of context\n")
    print("| drafting | passes/token | drafts accepted / made | estimated decode speedup vs off |")
    print("|---|---:|---:|---:|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['passes_per_token']:.3f} | {s['accepted']} / {s['drafted']} | {s['estimated_speedup']:.2f}x |")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
