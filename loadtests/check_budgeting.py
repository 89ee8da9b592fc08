"""Exact budgeting against the served tokenizer on real vocabularies: every held-out text of
``shared/data`` and adversarial strings, for count, range counts, truncation on both sides,
chunks and appending; then the speed of range counts against re-encoding each range.

    make check-budgeting VOCABS="qwen2.5-coder-1.5b gemma-3-270m /path/llama.cpp/models/ggml-vocab-llama-bpe.gguf"

A vocabulary is a real model's name (``loadtests.real_models``, assembled on first use), a GGUF
path (a model, or one of llama.cpp's ``models/ggml-vocab-*.gguf`` vocabulary files), or
``embedded``. The tokenizer is loaded as ``parrot serve --model`` loads it; "expected" is always
``Tokenizer.encode`` of the exact substring. Prints a table and writes
``loadtests/results/check_budgeting.json``; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import sys
import time
from typing import Any

from pathlib import Path

from loadtests.bench_tokenizer import load_vocabulary as load
from loadtests.check_vocabs import test_vectors
from parrot.tokenizer.loader import Tokenizer

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
RESULTS = os.path.join(os.path.dirname(__file__), "results")
ADVERSARIAL = [
    " " * 3000 + "x", "a" * 3000, "7" * 3000, "😀" * 1000, "e\u0301" * 1500, "\n" * 3000 + "x", " \n" * 1500,
    "ab " * 1000, "中文" * 1500, "!" * 3000, "'s" * 1500, "\t \n" * 1000, "a" * 1500 + " " * 1500 + "b" * 100,
    "👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 ok👍👍👍 " * 50, "日本語のテキスト、中文文本。한국어 텍스트 Ελληνικά ру́сский " * 30,
    "it's we'll THEY'RE '''s 1234567 3.14159 1,000,000 x=[1,2]\r\n\r\n\t\tif (a) {b;}\n" * 40,
    "\u200b\u200d\ufeff zero width \u00a0 nbsp \u3000 ideographic space " * 40,
]


def log(message: str) -> None:
    print(f"[check_budgeting] {message}", file=sys.stderr, flush=True)


def held_out_texts() -> list[str]:
    texts: list[str] = []
    for path in sorted(glob.glob(os.path.join(DATA, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                texts += [v for v in row.values() if isinstance(v, str) and len(v) >= 20]
    return texts


def check(tok: Tokenizer, texts: list[str], seed: int = 0) -> dict[str, Any]:
    budget = tok.budget
    rng = random.Random(seed)
    count = lambda s: len(tok.encode(s))  # noqa: E731
    checks = mismatches = 0
    examples: list[str] = []

    def expect(ok: bool, what: str) -> None:
        nonlocal checks, mismatches
        checks += 1
        if not ok:
            mismatches += 1
            if len(examples) < 10:
                examples.append(what)

    for n_text, text in enumerate(texts):
        if n_text % 200 == 0:
            log(f"  text {n_text}/{len(texts)}")
        whole = count(text)
        expect(budget.count(text) == whole, f"count {text[:40]!r}")
        index = budget.interval_counter(text)
        expect(index.total == whole, f"index total {text[:40]!r}")
        for _ in range(10):
            a = rng.randint(0, len(text))
            b = rng.randint(a, len(text))
            expect(index.count(a, b) == count(text[a:b]), f"range {text[:40]!r} [{a}:{b}]")
        n = rng.randint(1, max(1, whole))
        kept = budget.truncate(text, n, "right")
        expect(kept.count == count(kept.text) <= n and (kept.offset == len(text) or count(text[: kept.offset + 1]) > n),
               f"truncate right {text[:40]!r} n={n}")
        kept = budget.truncate(text, n, "left")
        expect(kept.count == count(kept.text) <= n and (kept.offset == 0 or count(text[kept.offset - 1 :]) > n),
               f"truncate left {text[:40]!r} n={n}")
        chunks = budget.chunk(text, max(8, whole // 5))
        expect("".join(c.text for c in chunks) == text and all(c.count == count(c.text) for c in chunks),
               f"chunk {text[:40]!r}")
        encoder = budget.appending_encoder()
        step = rng.randint(1, 7)
        for i in range(0, len(text), step):
            encoder.append(text[i : i + step])
        expect(encoder.count == whole, f"append {text[:40]!r}")
    return {"checks": checks, "mismatches": mismatches, "examples": examples}


def speed(tok: Tokenizer, text: str, queries: int) -> dict[str, Any]:
    budget = tok.budget
    rng = random.Random(1)
    ranges = [tuple(sorted((rng.randrange(len(text) + 1), rng.randrange(len(text) + 1)))) for _ in range(queries)]
    start = time.perf_counter()
    index = budget.interval_counter(text)
    build = time.perf_counter() - start
    start = time.perf_counter()
    counts = [index.count(a, b) for a, b in ranges]
    query = (time.perf_counter() - start) / queries
    sample = ranges[:: max(1, queries // 20)]
    start = time.perf_counter()
    for (a, b) in sample:
        len(tok.encode(text[a:b]))
    reencode = (time.perf_counter() - start) / len(sample)
    assert all(counts[ranges.index(r)] == len(tok.encode(text[r[0]:r[1]])) for r in sample[:5])
    return {"chars": len(text), "build_s": build, "query_us": query * 1e6, "reencode_us": reencode * 1e6,
            "speedup": reencode / query}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vocabs", nargs="+", help="real model names, GGUF paths, or 'embedded'")
    parser.add_argument("--texts", type=int, default=0, help="check only the first N held-out texts (0: all)")
    args = parser.parse_args()
    texts = held_out_texts()
    if args.texts:
        texts = texts[: args.texts]
    corpus = "\n\n".join(texts)
    rows = []
    for vocab in args.vocabs:
        log(f"{vocab}: loading")
        tok = load(vocab)
        path = type(tok.budget).__name__
        log(f"{vocab}: {path}; {len(texts)} held-out texts and {len(ADVERSARIAL)} adversarial strings")
        result = check(tok, texts + ADVERSARIAL)
        vectors = test_vectors(Path(vocab)) if vocab.endswith(".gguf") else []
        if vectors:  # llama.cpp's test vectors: counts against the family's own tokenizer's ids
            result["llama_cpp_vectors"] = len(vectors)
            wrong = [text for text, ids in vectors if tok.budget.count(text) != len(ids)]
            result["llama_cpp_vectors_wrong"] = len(wrong)
            result["examples"] += [f"llama.cpp vector {text[:40]!r}" for text in wrong[:5]]
        timings = {size: speed(tok, (corpus * (1 + size // max(1, len(corpus))))[:size], 2000)
                   for size in (10_000, 1_000_000)}
        rows.append({"vocab": os.path.basename(vocab), "budget": path, **result,
                     "speed": {str(k): v for k, v in timings.items()}})
    print("| vocabulary | budget | checks | mismatches | llama.cpp vectors (count = ids) | range count vs re-encode, "
          "10 KB text | 1 MB text |")
    print("| --- | --- | ---: | ---: | --- | --- | --- |")
    for r in rows:
        s10, s1m = r["speed"]["10000"], r["speed"]["1000000"]
        vectors = (f"{r['llama_cpp_vectors'] - r['llama_cpp_vectors_wrong']} of {r['llama_cpp_vectors']}"
                   if "llama_cpp_vectors" in r else "-")
        print(f"| {r['vocab']} | {r['budget']} | {r['checks']:,} | {r['mismatches']} | {vectors} | {s10['query_us']:.0f} us vs "
              f"{s10['reencode_us']:.0f} us ({s10['speedup']:.1f}x) | {s1m['query_us']:.0f} us vs "
              f"{s1m['reencode_us'] / 1000:.1f} ms ({s1m['speedup']:,.0f}x) |")
        for example in r["examples"]:
            print(f"  mismatch: {example}")
    os.makedirs(RESULTS, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    with open(os.path.join(RESULTS, "check_budgeting.json"), "w") as f:
        json.dump({"cpu": cpu, "python": platform.python_version(), "texts": len(texts),
                   "adversarial": len(ADVERSARIAL), "results": rows}, f, indent=2)
    log(f"wrote {RESULTS}/check_budgeting.json")
    return 1 if any(r["mismatches"] or r.get("llama_cpp_vectors_wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
