"""Grammar benchmark: JSON extraction from news articles, constrained decoding three ways.

Workload: the first N articles of ../shared/data/summarization.jsonl; the model extracts a
title, the people, places and numbers mentioned and a one-sentence summary under a JSON schema
(greedy, max_tokens 300). For each article, back to back:

- ``constrained``: grammar-masked decoding, one token per forward pass;
- ``+fast_forward``: tokens the grammar forces go into the pass without verification;
- ``+fast_forward+ngram``: forced tokens followed by n-gram drafts, all verified in one pass.

Per row: decode tokens/s (output tokens after the first / seconds after the first token: the
part that fast-forward and drafts change; the prompt's prefill is the same in all three), end-to-end
tokens/s (prefill included), forward passes per output token, share of forced tokens, share of
outputs that parse and validate, share identical to the ``constrained`` output.

With ``--sdpa``, two more rows run the ``constrained`` and ``+fast_forward+ngram`` configurations
with torch's SDPA in place of the attention kernel (csrc/attention.h), each with a cost curve
measured that way, and are compared with their own ``constrained`` row.

    python -m loadtests.bench_grammar [--articles 10] [--sdpa]

Prints a markdown table, writes ``loadtests/results/bench_grammar.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema

from loadtests.bench_engine import DATA, RESULTS, machine
from parrot.config import load_config
from parrot.engine.build import build_engine
from parrot.engine.costmodel import measure_cost_curve
from parrot.engine.engine import Engine, GenerationRequest, SpeculationParams
from parrot.engine.sampling import SamplingParams
from parrot.constrain.grammar import GrammarCompiler

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 100},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        "places": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5},
        # Bounded numbers: an unbounded one lets a small model write digits until max_tokens.
        "numbers": {"type": "array", "items": {"type": "number", "minimum": -1e9, "maximum": 1e9, "multipleOf": 0.01},
                    "maxItems": 5},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["title", "people", "places", "numbers", "summary"],
    "additionalProperties": False,
}
INSTRUCTION = (
    "Extract from the news article below, as JSON: the title, the people and the places mentioned, "
    "the numbers mentioned, and a one-sentence summary.\n\n"
)
CONFIGS = {
    "constrained": SpeculationParams(enabled=False, fast_forward=False),
    "+fast_forward": SpeculationParams(enabled=False, fast_forward=True),
    "+fast_forward+ngram": SpeculationParams(enabled=True, fast_forward=True),
}


def extraction_prompts(tokenizer: Any, articles: int) -> list[tuple[str, list[int]]]:
    """(id, chat prompt token ids) of the first ``articles`` articles with the extraction instruction."""
    prompts = []
    with open(DATA / "summarization.jsonl") as f:
        for line in f:
            row = json.loads(line)
            article = row["prompt"].split("\n\n", 1)[1]
            prompts.append((row["id"], tokenizer.encode_chat([{"role": "user", "content": INSTRUCTION + article}])))
            if len(prompts) == articles:
                break
    return prompts


@contextlib.contextmanager
def _sdpa_attention(forward: Any) -> Iterator[None]:
    """Run ``forward`` with torch's SDPA instead of its attention kernel for a while."""
    kernel, forward.attention_kernel = forward.attention_kernel, None
    try:
        yield
    finally:
        forward.attention_kernel = kernel


def _speed(runs: list[dict[str, Any]]) -> float:
    """End-to-end: all output tokens / all seconds, prefill included."""
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def _decode_speed(runs: list[dict[str, Any]]) -> float:
    """Decode: output tokens after the first / seconds after the first token."""
    return sum(r["tokens"] - 1 for r in runs) / max(sum(r["decode_seconds"] for r in runs), 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--articles", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--sdpa", action="store_true", help="also run two rows with SDPA attention")
    args = parser.parse_args(argv)

    config = load_config()
    loaded, engine = build_engine(config)
    forward: Any = loaded.forward
    # name -> (engine, speculation, the row it is compared with, attention kernel off)
    rows: dict[str, tuple[Engine, SpeculationParams, str, bool]] = {
        name: (engine, spec, "constrained", False) for name, spec in CONFIGS.items()}
    if args.sdpa:
        if getattr(forward, "attention_kernel", None) is None:
            parser.error("--sdpa: this model runs without the attention kernel here")
        with _sdpa_attention(forward):
            cost = measure_cost_curve(forward, config.drafting.max_draft + 1)
        sdpa = Engine(forward, loaded.tokenizer, config.drafting, cost, config.server.prefill_chunk,
                      config.server.prefill_chunk_busy)
        rows["constrained, SDPA"] = (sdpa, CONFIGS["constrained"], "constrained, SDPA", True)
        rows["+fast_forward+ngram, SDPA"] = (sdpa, CONFIGS["+fast_forward+ngram"], "constrained, SDPA", True)
    compiler = GrammarCompiler(loaded.tokenizer)
    grammar = compiler.compile("json_schema", SCHEMA)
    prompts = extraction_prompts(loaded.tokenizer, args.articles)
    records: list[dict[str, Any]] = []
    for i, (prompt_id, ids) in enumerate(prompts):
        record: dict[str, Any] = {"id": prompt_id}
        for name, (row_engine, spec, _, without_kernel) in rows.items():
            request = GenerationRequest(ids, SamplingParams(max_tokens=args.max_tokens), spec,
                                        grammar=compiler.new_state(grammar, spec.fast_forward))
            with _sdpa_attention(forward) if without_kernel else contextlib.nullcontext():
                begin = time.perf_counter()
                result = row_engine.generate(request)
                seconds = time.perf_counter() - begin
            try:
                jsonschema.validate(json.loads(result.text), SCHEMA)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            s = result.stats
            ttft = s.ttft_s if s.ttft_s is not None else seconds
            record[name] = {"tokens": s.output_tokens, "seconds": seconds, "ttft_s": ttft,
                            "decode_seconds": seconds - ttft, "passes": s.forward_passes,
                            "forced": s.forced_tokens, "drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
                            "valid": valid, "token_ids": result.token_ids}
        base = record["constrained"]["token_ids"]
        for name in rows:
            record[name]["identical"] = record[name]["token_ids"] == base
        records.append(record)
        print(f"[{i + 1}/{len(prompts)}] {prompt_id}: " + ", ".join(
            f"{name} {_decode_speed([record[name]]):.1f} tok/s decode" for name in rows), file=sys.stderr)

    summary: dict[str, Any] = {}
    for name, (_, _, base, _) in rows.items():
        tokens = sum(r[name]["tokens"] for r in records)
        runs = [r[name] for r in records]
        base_runs = [r[base] for r in records]
        summary[name] = {
            "decode_tokens_per_s": _decode_speed(runs),
            "decode_ratio": _decode_speed(runs) / _decode_speed(base_runs),
            "tokens_per_s": _speed(runs),
            "ratio": _speed(runs) / _speed(base_runs),
            "passes_per_token": sum(r[name]["passes"] for r in records) / tokens,
            "forced_share": sum(r[name]["forced"] for r in records) / tokens,
            "accepted_drafts_share": sum(r[name]["accepted"] for r in records) / tokens,
            "valid_share": sum(r[name]["valid"] for r in records) / len(records),
            "identical_share": sum(r[name]["identical"] for r in records) / len(records),
        }
    lines = ["| config | decode tokens/s | vs constrained | end-to-end tokens/s | vs constrained | passes/token "
             "| forced share | accepted-draft share | valid | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['decode_tokens_per_s']:.1f} | {s['decode_ratio']:.2f}x | "
                     f"{s['tokens_per_s']:.1f} | {s['ratio']:.2f}x | {s['passes_per_token']:.3f} | "
                     f"{s['forced_share']:.1%} | {s['accepted_drafts_share']:.1%} | {s['valid_share']:.0%} | "
                     f"{s['identical_share']:.0%} |")
    table = "\n".join(lines)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = (f"Grammar benchmark, {stamp}, {machine()}; model {loaded.name}; JSON extraction from "
              f"{len(records)} CNN/DailyMail articles, greedy, max_tokens {args.max_tokens}")
    # The draft-length policy sizes drafts by the cost curve measured at start-up; its shape
    # (what a second, third ... token adds to a pass) decides how much is drafted.
    curve = engine.policy.cost[1:] if engine.policy is not None else []
    curve_line = ("Forward cost curve at start-up (x one token, 1.." + str(len(curve)) + " tokens): "
                  + " ".join(f"{c / curve[0]:.2f}" for c in curve)) if curve else ""
    print(header)
    print(table)
    print(curve_line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_grammar.md").write_text(header + "\n\n" + table + "\n\n" + curve_line + "\n")
    for r in records:
        for name in rows:
            r[name].pop("token_ids")
    (args.out / "bench_grammar.json").write_text(json.dumps(
        {"date": stamp, "machine": machine(), "schema": SCHEMA, "cost_curve_s": curve, "summary": summary,
         "articles": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
