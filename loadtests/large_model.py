"""Plain decoding of a model the size users run, against llama-bench on the same GGUF, and memory.

    python -m loadtests.large_model [--params 1B --type Q4_K_M] [--llama-bench PATH]

`make bench-peers` runs this after its side-by-side table. The GGUF is the synthetic one
(``loadtests/make_synthetic_gguf.py``: a published 1B Llama's shape, random weights), written
once into ``loadtests/results/cache``. Random weights make drafting meaningless, so every number
here is plain decoding:

- served: ``parrot serve --model FILE`` streams greedy completions with ``ignore_eos`` (decode
  tokens/s after the first token), interleaved per round with ``llama-bench -n`` (llama.cpp's
  decode loop without a server: the comparison favours llama.cpp slightly);
- in a child process: Parrot's decoding loop without a server (a one-token forward and an
  argmax per token), alternating with ``llama-bench -n`` runs (like for like); its 1- and
  8-token passes at a context depth and its prompt rate, beside ``llama-bench -p 1,8 -d DEPTH``
  and ``-p PROMPT``;
- memory, in the same child: resident memory before loading (Python, torch and the server's
  modules), after loading and after the passes, the KV cache's bytes and the file's size; the
  rule is resident <= baseline + 1.3 x file + KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtests.bench_engine import RESULTS

CACHE = RESULTS / "cache"
PROMPT = ("Write a detailed account of how a river delta forms, the sediments involved, and how "
          "people have farmed and settled on deltas through history.")


def synthetic(params: str, kind: str) -> Path:
    """The synthetic GGUF for ``params`` and ``kind``, written on first use."""
    path = CACHE / f"synthetic-{params}-{kind}.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"[large] writing {path} (once; about 10 s for 1B)", flush=True)
        partial = path.with_suffix(".partial")
        subprocess.run([sys.executable, "-m", "loadtests.make_synthetic_gguf", "--params", params, "--type", kind,
                        "--out", str(partial)], check=True)
        partial.rename(path)
    return path


def in_process(path: str, depth: int, prompt: int, decode: int = 64, rounds: int = 7,
               llama_bench_bin: str | None = None, threads: int = 2) -> dict[str, Any]:
    """Memory, pass costs and a plain greedy decoding loop of ``decode`` tokens from an empty
    context (what ``llama-bench -n`` times) of ``path``, measured in this (fresh) process; the
    loop alternates with ``llama-bench -n`` runs when given its path."""
    import torch

    import parrot.server.app  # noqa: F401  (the server's modules: part of the baseline, as in `parrot serve`)
    from parrot.config import ModelConfig
    from parrot.engine.loader import load_model
    from parrot.engine.memory import resident_bytes

    baseline = resident_bytes()
    forward = load_model(ModelConfig(source=path)).forward
    loaded = resident_bytes()
    ids = torch.randint(100, 20000, (max(depth, prompt) + 8,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = forward.new_cache(max(depth, prompt) + 8)
    begin = time.perf_counter()
    forward.forward([(cache, ids[:prompt], 1)])
    prompt_ms = (time.perf_counter() - begin) * 1e3 / prompt
    cache.crop(0)
    forward.forward([(cache, ids[:depth], 1)])
    times: dict[int, list[float]] = {1: [], 8: []}
    for _ in range(rounds):
        for n, spent in times.items():
            begin = time.perf_counter()
            forward.forward([(cache, ids[depth:depth + n], n)])
            spent.append(time.perf_counter() - begin)
            cache.crop(depth)
    kv_bytes = cache.k.numel() * cache.k.element_size() * 2
    loops, theirs = [], []
    for _ in range(5):
        cache.crop(0)
        token = ids[0]
        begin = time.perf_counter()
        for _ in range(decode):
            token = int(forward.forward([(cache, [token], 1)])[0][-1].argmax())
        loops.append(decode / (time.perf_counter() - begin))
        if llama_bench_bin:
            theirs.append(llama_bench(llama_bench_bin, path, ["-p", "0", "-n", str(decode), "-r", "1"], threads)[0]["avg_ts"])
    return {"baseline_bytes": baseline, "loaded_bytes": loaded, "after_passes_bytes": resident_bytes(),
            "kv_bytes": kv_bytes, "kv_positions": cache.capacity, "prompt_ms_per_token": prompt_ms,
            "decode_loop_tok_s": sorted(loops)[2], "llama_decode_loop_tok_s": sorted(theirs)[2] if theirs else None,
            "decode_loop_runs": loops, "llama_decode_loop_runs": theirs,
            "pass_ms": {str(n): sorted(t)[len(t) // 2] * 1e3 for n, t in times.items()}}


def llama_bench(binary: str, path: str, args: list[str], threads: int) -> list[dict[str, Any]]:
    from loadtests.peers import peer_env

    command = [binary, "-m", path, "-t", str(threads), "-o", "json", *args]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=peer_env()).stdout)


def run(params: str = "1B", kind: str = "Q4_K_M", llama_bench_bin: str | None = None, threads: int = 2,
        rounds: int = 3, max_tokens: int = 64, depth: int = 256, prompt: int = 256, port: int = 8741) -> dict[str, Any]:
    from loadtests.peers import Server, resident, stream_chat

    path = str(synthetic(params, kind))
    result: dict[str, Any] = {"params": params, "type": kind, "gguf": path, "gguf_bytes": os.path.getsize(path),
                              "threads": threads, "max_tokens": max_tokens, "depth": depth, "prompt_tokens": prompt}
    # 1. Served plain decoding, interleaved with llama-bench's decode loop.
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    server = Server(f"parrot_{params}", [sys.executable, "-m", "parrot.cli", "serve", "--model", path, "--port", str(port)],
                    port, env)
    served, theirs = [], []
    try:
        server.wait()
        result["server_resident_after_start"] = resident(server.process.pid)
        extra = {"ignore_eos": True, "speculation": {"enabled": False}}
        stream_chat(server.url, PROMPT, 4, extra)  # warm-up
        for i in range(rounds):
            run_ = stream_chat(server.url, PROMPT, max_tokens, extra)
            served.append((run_["tokens"] - 1) / max(run_["decode_s"], 1e-9))
            line = f"[large {i + 1}/{rounds}] Parrot served {served[-1]:.1f} tok/s"
            if llama_bench_bin:
                rows = llama_bench(llama_bench_bin, path, ["-p", "0", "-n", str(max_tokens), "-r", "1"], threads)
                theirs.append(rows[0]["avg_ts"])
                line += f", llama-bench tg{max_tokens} {theirs[-1]:.1f} tok/s"
            print(line, flush=True)
        result["server_resident_after_requests"] = resident(server.process.pid)
    finally:
        server.stop()
    result["parrot_decode_tok_s"] = sorted(served)[len(served) // 2]
    result["llama_decode_tok_s"] = sorted(theirs)[len(theirs) // 2] if theirs else None
    # 2. Passes and memory in a fresh process, then llama-bench's passes on the same file.
    child = subprocess.run([sys.executable, "-m", "loadtests.large_model", "--child", path, "--depth", str(depth),
                            "--prompt", str(prompt), "--max-tokens", str(max_tokens), "--threads", str(threads),
                            *(["--llama-bench", llama_bench_bin] if llama_bench_bin else [])],
                           capture_output=True, text=True, check=True, env=env)
    result["parrot"] = json.loads(child.stdout.strip().splitlines()[-1])
    if llama_bench_bin:
        rows = llama_bench(llama_bench_bin, path, ["-p", "1,8", "-n", "0", "-d", str(depth), "-r", "5"], threads)
        rows += llama_bench(llama_bench_bin, path, ["-p", str(prompt), "-n", "0", "-r", "2"], threads)
        result["llama"] = {"pass_ms": {str(r["n_prompt"]): 1e3 * r["n_prompt"] / r["avg_ts"] for r in rows[:-1]},
                           "prompt_ms_per_token": 1e3 / rows[-1]["avg_ts"]}
    return result


def render(result: dict[str, Any]) -> str:
    mb = 2**20
    ours, theirs = result["parrot"], result.get("llama") or {}

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "—"

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.1f}"

    tokens, theirs_tg = result["max_tokens"], result["llama_decode_tok_s"]
    lines = [(f"Synthetic {result['params']} {result['type']} ({result['gguf_bytes'] / mb:.0f} MB), plain decoding, "
              f"{result['threads']} threads"), "",
             "| measure | Parrot | llama.cpp | Parrot / llama.cpp |", "|---|---:|---:|---:|",
             (f"| decode tok/s ({tokens} tokens; Parrot served, llama-bench tg) | {result['parrot_decode_tok_s']:.1f} | "
              f"{ms(theirs_tg)} | {ratio(result['parrot_decode_tok_s'], theirs_tg)} |"),
             (f"| decode tok/s, loop without a server ({tokens} tokens; Parrot in process, llama-bench tg; interleaved) | "
              f"{ours['decode_loop_tok_s']:.1f} | {ms(ours.get('llama_decode_loop_tok_s'))} | "
              f"{ratio(ours['decode_loop_tok_s'], ours.get('llama_decode_loop_tok_s'))} |")]
    for n in ("1", "8"):
        mine, peer = ours["pass_ms"][n], (theirs.get("pass_ms") or {}).get(n)
        lines.append(f"| {n}-token pass at {result['depth']} tokens of context, ms | {mine:.1f} | {ms(peer)} | "
                     f"{ratio(mine, peer)} |")
    lines.append(f"| prompt, ms per token ({result['prompt_tokens']} tokens) | {ours['prompt_ms_per_token']:.1f} | "
                 f"{ms(theirs.get('prompt_ms_per_token'))} | {ratio(ours['prompt_ms_per_token'], theirs.get('prompt_ms_per_token'))} |")
    base, after, kv, size = ours["baseline_bytes"], ours["after_passes_bytes"], ours["kv_bytes"], result["gguf_bytes"]
    limit = base + 1.3 * size + kv
    lines += ["", (f"Memory: resident {after / mb:.0f} MB after the passes = baseline {base / mb:.0f} MB (Python, torch, "
                   f"server modules) + {(after - base) / mb:.0f} MB; file {size / mb:.0f} MB, KV cache {kv / mb:.0f} MB "
                   f"({ours['kv_positions']} positions); rule baseline + 1.3 x file + KV = {limit / mb:.0f} MB: "
                   f"{'holds' if after <= limit else 'exceeded'}. Server: "
                   f"{result['server_resident_after_requests'] / mb:.0f} MB after the requests.")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1B")
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per decoding run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "large_model.json"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(in_process(args.child, args.depth, args.prompt, args.max_tokens,
                                    llama_bench_bin=args.llama_bench, threads=args.threads)))
        return 0
    result = run(args.params, args.type, args.llama_bench, args.threads, args.rounds, args.max_tokens, args.depth, args.prompt)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(render(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
