"""Drafter benchmark: proposal and update costs on long contexts (no model involved).

Contexts are real token sequences (the evaluation prompts, tokenized and concatenated) cut to
1k, 2k, 4k and 8k tokens. For each drafter (suffix match, N-gram Parrot model) and length:

- ``build_ms``: indexing the whole context once (what a prefill costs the drafter);
- ``propose_us``: one ``propose(16)`` at the end of the context (median of many);
- ``extend_us_per_token``: appending generated tokens, per token (incremental, never a rebuild).

The suffix drafter's proposal cost must stay flat in the context length (hash lookups of the
last max_n tokens) and well under 1 ms at 8k tokens.

    python -m loadtests.bench_drafter

Prints a markdown table, writes ``loadtests/results/bench_drafter.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from parrot.drafting import Drafter, NGramDrafter, SuffixDrafter
from loadtests.bench_engine import DATA, RESULTS, machine


def corpus_tokens(n: int) -> list[int]:
    from parrot.config import ModelConfig
    from parrot.engine.hf_loading import load_transformers

    _, tokenizer, _ = load_transformers(ModelConfig())
    tokens: list[int] = []
    for task in ("summarization", "code_edit", "context_qa"):
        with open(DATA / f"{task}.jsonl") as f:
            for line in f:
                tokens.extend(tokenizer.encode(json.loads(line)["prompt"]))
                if len(tokens) >= 2 * n:
                    return tokens
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    tokens = corpus_tokens(8192)
    makers: dict[str, Callable[[list[int]], Drafter]] = {
        "suffix (min_n=1, max_n=8)": lambda ctx: SuffixDrafter(ctx, min_n=1, max_n=8),
        "ngram (n=8, threshold 0.1)": lambda ctx: NGramDrafter(ctx, n=8, threshold=0.1),
    }
    rows = []
    for name, make in makers.items():
        for length in (1024, 2048, 4096, 8192):
            context, tail = tokens[:length], tokens[length : length + 512]
            begin = time.perf_counter()
            drafter = make(context)
            build = time.perf_counter() - begin
            proposes = []
            for _ in range(200):
                begin = time.perf_counter()
                drafter.propose(16)
                proposes.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            for i in range(0, len(tail), 4):  # accepted tokens arrive a few at a time
                drafter.extend(tail[i : i + 4])
            extend = (time.perf_counter() - begin) / len(tail)
            rows.append({"drafter": name, "context_tokens": length, "build_ms": build * 1e3,
                         "propose_us": statistics.median(proposes) * 1e6, "extend_us_per_token": extend * 1e6})
            print(f"{name} {length}: propose {rows[-1]['propose_us']:.1f} us", file=sys.stderr)
    lines = ["| drafter | context tokens | build (ms) | propose (µs, median) | extend (µs/token) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['context_tokens']} | {r['build_ms']:.1f} | {r['propose_us']:.1f} | "
                     f"{r['extend_us_per_token']:.1f} |")
    table = "\n".join(lines)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    header = f"Drafter benchmark, {stamp}, {machine()}"
    print(header)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_drafter.md").write_text(header + "\n\n" + table + "\n")
    (args.out / "bench_drafter.json").write_text(json.dumps({"date": stamp, "machine": machine(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
