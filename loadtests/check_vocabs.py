"""Real families' vocabularies against llama.cpp's tokenizer tests, and served on small GGUFs.

    make check-vocabs LLAMA_CPP_DIR=/path/llama.cpp    (the llama-cpp-python source's vendor/llama.cpp)

llama.cpp's source carries ``models/ggml-vocab-*.gguf``: the vocabularies (no weights) of the
families it supports, most with test vectors (``.inp``: texts separated by
``__ggml_vocab_test__`` lines; ``.out``: the token ids the family's own Hugging Face tokenizer
gives them, without special tokens). For every file this loads the vocabulary as Parrot loads a
GGUF's and records: loaded or refused (with the message a user gets), test vectors encoded
exactly, end-of-generation tokens, and whether exact budgeting or only ``/v1/tokenize`` serves it.

Then for the Llama-architecture families (Llama 3 ``llama-bpe``, Llama 2 / Mistral SentencePiece
``llama-spm``, Qwen2 ``qwen2``) it writes a two-layer GGUF with random weights and that vocabulary
(``make_synthetic_gguf --params tiny --vocab``; Llama 3 gets its published chat template from
llama.cpp's ``models/templates``), starts ``parrot serve --model`` on it as a user would, and
checks: /v1/tokenize gives the test vectors' ids, a chat completion renders and runs, and greedy
output with drafting on equals drafting off. Random weights make the text meaningless; the point
is the vocabulary, the template and the kernels under it. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_engine import RESULTS
from loadtests.peers import Server

SERVED = {  # vocabulary -> (architecture, chat template in models/templates or None)
    "llama-bpe": ("llama", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "llama-spm": ("llama", None),
    "qwen2": ("qwen2", None),  # the vocabulary file carries Qwen2's template
    "deepseek-coder": ("llama", None),
}
SEPARATOR = "\n__ggml_vocab_test__\n"


def test_vectors(vocab_path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's tests for one vocabulary, as its tests/test-tokenizer-0.cpp reads them."""
    inp, out = Path(str(vocab_path) + ".inp"), Path(str(vocab_path) + ".out")
    if not inp.exists() or not out.exists():
        return []
    texts = inp.read_text(encoding="utf-8").split(SEPARATOR)
    ids = out.read_text(encoding="utf-8").split("\n")
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, ids)]


def windowed_decode(tokenizer: Any, vectors: list[tuple[str, list[int]]], specials: list[int]) -> str:
    """Token streams through the server's text assembly (parrot/engine/textout.py, which decodes
    a window of the last tokens), a few tokens per step: "exact" when its text equals a whole
    decode after every step and what it sends adds up to the whole text, else where it differs.
    Streams: the tests' ids one after another, the same with special tokens mixed in, random ids."""
    import random

    from parrot.engine.textout import TextAssembler

    rng = random.Random(0)
    tests = [t for _, ids in vectors for t in ids]
    mixed = list(tests)
    for _ in range(len(tests) // 10 if specials else 0):
        mixed.insert(rng.randrange(len(mixed) + 1), rng.choice(specials))
    noise = [rng.randrange(len(tokenizer.hf)) for _ in range(400)]
    for name, ids in (("tests", tests), ("tests with specials", mixed), ("random ids", noise)):
        assembler, sent, at = TextAssembler(tokenizer), "", 0
        while at < len(ids):
            step = rng.randint(1, 5)
            sent += assembler.add(ids[at : at + step])[1]
            at += step
            if assembler.text != tokenizer.decode(ids[:at]):
                return f"{name}: differs after {at} tokens"
        if sent + assembler.flush() != tokenizer.decode(ids):
            return f"{name}: sent text differs"
    return "exact" if tokenizer.decodes_incrementally else "exact (decoded whole)"


def check_vocabulary(vocab_path: Path) -> dict[str, Any]:
    from parrot.tokenizer.bpe import UnsupportedTokenizer
    from parrot.tokenizer.gguf_vocab import CONTROL, USER_DEFINED, GGUFVocabulary
    from parrot.tokenizer.loader import load_tokenizer

    begin = time.perf_counter()
    row: dict[str, Any] = {"vocab": vocab_path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")}
    try:
        tokenizer = load_tokenizer(str(vocab_path.parent), vocab_path.name)
    except Exception as exc:  # a refusal: what a user is told
        row.update(status="refused", reason=f"{type(exc).__name__}: {exc}"[:300])
        return row
    vectors = test_vectors(vocab_path)
    wrong = [text for text, ids in vectors if tokenizer.encode(text) != ids]
    file_tokens = GGUFVocabulary.read(str(vocab_path))
    specials = [(i, text) for i, (text, kind) in enumerate(zip(file_tokens.tokens, file_tokens.types))
                if kind in (CONTROL, USER_DEFINED)]
    try:
        tokenizer.budget  # noqa: B018
        budget = "exact budgeting"
    except UnsupportedTokenizer:
        budget = "tokenize only" if tokenizer.covers_every_byte else "neither"
    row.update(status="loaded", tests=len(vectors), exact=len(vectors) - len(wrong), wrong=[w[:60] for w in wrong[:5]],
               vocab_size=len(file_tokens.tokens), tokenizer_size=len(tokenizer.hf),
               special_tokens=len(specials),
               special_tokens_at_file_ids=sum(tokenizer.hf.convert_tokens_to_ids(text) == i for i, text in specials),
               end_of_generation=tokenizer.hf.convert_ids_to_tokens(sorted(tokenizer.eos_token_ids)),
               chat_template=bool(getattr(tokenizer.hf, "chat_template", None)), budget=budget,
               windowed_decode=windowed_decode(tokenizer, vectors, [i for i, _ in specials]),
               seconds=round(time.perf_counter() - begin, 1))
    return row


def serve_family(models: Path, vocab: str, port: int, workdir: Path) -> dict[str, Any]:
    from loadtests.make_synthetic_gguf import write

    arch, template = SERVED[vocab]
    vocab_path = models / f"ggml-vocab-{vocab}.gguf"
    gguf = workdir / f"tiny-{vocab}.gguf"
    write(str(gguf), "tiny", "Q8_0", arch=arch, vocab_file=str(vocab_path),
          chat_template=str(models / "templates" / template) if template else None)
    log = workdir / f"serve-{vocab}.log"
    server = Server(f"parrot-{vocab}", [sys.executable, "-m", "parrot.cli", "serve", "--model", str(gguf),
                                        "--port", str(port)], port, log=log)
    row: dict[str, Any] = {"vocab": vocab, "arch": arch, "gguf_mb": round(gguf.stat().st_size / 1e6)}
    try:
        server.wait()
        with httpx.Client(base_url=server.url, timeout=300) as client:
            vectors = test_vectors(vocab_path)
            served = [client.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
                      for text, _ in vectors]
            row["tokenize_exact"] = sum(s.get("tokens") == ids for s, (_, ids) in zip(served, vectors))
            row["tokenize_tests"] = len(vectors)
            chat = client.post("/v1/chat/completions", json={
                "model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
            row["chat"] = chat.status_code if chat.status_code != 200 else "200 " + chat.json()["choices"][0]["finish_reason"]
            # special tokens' texts in a prompt: each becomes the file's id (or plain text), none
            # an id beyond the model's rows
            odd = client.post("/v1/completions", json={
                "model": "default", "prompt": "<|endoftext|> <|im_end|> <｜end▁of▁sentence｜> </s> hi", "max_tokens": 4})
            row["special_text_prompt"] = odd.status_code
            # the prompt a completion feeds the model is the one /v1/tokenize shows (BOS included)
            counted = client.post("/v1/tokenize", json={"prompt": "Hello world"}).json()["count"]
            used = client.post("/v1/completions", json={"model": "default", "prompt": "Hello world", "max_tokens": 1})
            row["prompt_tokens_match"] = used.json()["usage"]["prompt_tokens"] == counted
            prompt = "The quick brown fox jumps over the lazy dog. " * 6
            answers = {}
            for enabled in (True, False):
                r = client.post("/v1/completions", json={
                    "model": "default", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                    "speculation": {"enabled": enabled}})
                body = r.json()
                answers[enabled] = body["choices"][0]["text"]
                if enabled:
                    row["drafted"] = body["usage"]["speculation"]["drafted_tokens"]
                    row["accepted"] = body["usage"]["speculation"]["accepted_tokens"]
            row["greedy_equal"] = answers[True] == answers[False]
            row["text"] = answers[True][:80]
        lines = log.read_text().splitlines()
        row["kernels"] = next((line.split("backend ")[1].split(", context")[0] for line in lines if "loaded in" in line), "?")
        row["resident"] = next((line.split("engine: ")[1] for line in lines if "resident memory" in line), "?")
    finally:
        server.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR", ""),
                        help="llama.cpp's source directory (default: $LLAMA_CPP_DIR)")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--no-serve", action="store_true", help="check the vocabularies only")
    parser.add_argument("--out", type=Path, default=RESULTS / "check_vocabs.json")
    args = parser.parse_args(argv)
    models = Path(args.llama_cpp) / "models"
    if not models.is_dir():
        parser.error("give llama.cpp's source directory (LLAMA_CPP_DIR=... or --llama-cpp): "
                     "pip download --no-deps --no-binary :all: llama-cpp-python, unpack, vendor/llama.cpp")
    vocabularies = []
    for path in sorted(models.glob("ggml-vocab-*.gguf")):
        print(f"checking {path.name} ...", flush=True)
        vocabularies.append(check_vocabulary(path))
    print(f"\n{'vocabulary':<16} {'status':<8} {'tests exact':>11} {'specials':>11} {'size':>6}  {'budget':<15} "
          f"{'windowed decode':<16} end of generation / reason")
    for row in vocabularies:
        if row["status"] == "loaded":
            tests = f"{row['exact']}/{row['tests']}" if row["tests"] else "no tests"
            specials = f"{row['special_tokens_at_file_ids']}/{row['special_tokens']}"
            size = "ok" if row["vocab_size"] == row["tokenizer_size"] else f"+{row['tokenizer_size'] - row['vocab_size']}"
            print(f"{row['vocab']:<16} {'loaded':<8} {tests:>11} {specials:>11} {size:>6}  {row['budget']:<15} "
                  f"{row['windowed_decode']:<16} {', '.join(row['end_of_generation'])}")
        else:
            reason = row["reason"].replace("the GGUF's tokenizer is byte-level BPE with ", "").replace("\n", " ")
            print(f"{row['vocab']:<16} {'refused':<8} {'':>11} {'':>11} {'':>6}  {'':<15} {'':<16} {' '.join(reason.split())[:90]}")
    served = []
    if not args.no_serve:
        with tempfile.TemporaryDirectory() as tmp:
            for vocab in SERVED:
                print(f"\nserving a two-layer {vocab} GGUF ...", flush=True)
                served.append(serve_family(models, vocab, args.port, Path(tmp)))
        print(f"\n{'vocabulary':<14} {'arch':<6} {'tokenize':>9} {'chat':<12} {'drafted/accepted':>16} {'greedy on = off':>15} {'specials':>8}  kernels")
        for row in served:
            print(f"{row['vocab']:<14} {row['arch']:<6} {row['tokenize_exact']:>4}/{row['tokenize_tests']:<4} {row['chat']:<12} "
                  f"{row['drafted']:>8}/{row['accepted']:<7} {str(row['greedy_equal']):>15} {row['special_text_prompt']:>8}  {row['kernels']}")
    args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "llama_cpp": str(models.parent),
                                    "vocabularies": vocabularies, "served": served}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    failed = [r["vocab"] for r in vocabularies if r["status"] == "loaded" and (
        r["exact"] != r["tests"] or r["vocab_size"] != r["tokenizer_size"] or r["special_tokens_at_file_ids"] != r["special_tokens"])]
    failed += [r["vocab"] for r in served if not r["greedy_equal"] or r["tokenize_exact"] != r["tokenize_tests"]
               or r["special_text_prompt"] != 200 or not r["prompt_tokens_match"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
