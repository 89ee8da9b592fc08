"""Multi-turn conversations against llama.cpp: time to first token per turn, with the prefix cache.

    make bench-multiturn LLAMA_SERVER=/path/llama-server [MULTITURN_ARGS="--model qwen2.5-coder-1.5b"]

Chat clients and agents resend the whole conversation every turn. Two workloads, greedy,
streamed, each system keeping its own answers in its history (as its clients would):

- documents: a conversation over a document (held-out rows of ../shared/data/context_qa and
  summarization, about 800-1,200 tokens), then short follow-up questions, ``--turns`` turns of
  at most ``--max-tokens`` tokens each;
- agent: a loop that edits a file (held-out rows of code_edit.jsonl): each turn the agent sends
  the file as it now stands (the last answer) with a new instruction, and the answer is the
  whole edited file.

Systems, interleaved per turn in a rotating order (each conversation's turn goes to every
system before the next): Parrot with its prefix cache; Parrot without (``--prefix-cache-bytes
0``, unless ``--no-baseline``); llama.cpp's ``llama-server`` (given ``LLAMA_SERVER``; its prompt
cache on, as by default). Per turn and system: time to first token, end-to-end latency, prompt
and cached tokens (Parrot's ``usage.prompt_tokens_details``, llama.cpp's ``timings.cache_n``),
resident memory. For Parrot, also the time to first token of a request holding only the turn's
uncached tokens (a fresh scope, so nothing is reused): what the turn would cost if reading its
new tokens were all it did.

Prints a table and writes loadtests/results/bench_multiturn.json (machine, CPU flags, llama.cpp's
build and flags).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_engine import DATA, RESULTS, machine
from loadtests.peers import Server, peer_env, resident, sse_events
from loadtests.real_models import resolve

FOLLOW_UPS = [
    "Summarise your answer in one sentence.",
    "Which names or numbers in the text matter most? List at most three.",
    "Quote the one sentence of the text that best supports your answer.",
    "Is anything in the text uncertain or disputed? Answer briefly.",
    "Give one more detail from the text that you have not mentioned yet.",
]
EDITS = [
    "Add a short docstring to every function and method. Output the complete edited code, and nothing else.",
    "Rename every variable called `i` to `index`, and add type hints where they are missing. Output the complete "
    "edited code, and nothing else.",
    "Add a comment above each class saying what it is for. Output the complete edited code, and nothing else.",
]
LLAMA_FLAGS = ["-c", "16384", "--jinja", "--poll", "0"]


def held_out(task: str, n: int, skip: int = 0) -> list[dict[str, Any]]:
    with open(DATA / f"{task}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows[len(rows) - skip - n : len(rows) - skip]


def conversations(kind: str, count: int) -> list[dict[str, Any]]:
    """Each conversation: its first message and how the next ones are made."""
    if kind == "documents":
        rows = [r for task in ("context_qa", "summarization") for r in held_out(task, count)][:count * 2]
        return [{"id": r["id"], "first": r["prompt"]} for r in rows[:: 2][:count]]
    rows = held_out("code_edit", count)
    return [{"id": r["id"], "first": r["prompt"]} for r in rows]


def next_message(kind: str, turn: int, answer: str) -> str:
    if kind == "documents":
        return FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
    return f"Here is the file as it is now:\n\n{answer.strip()}\n\n{EDITS[(turn - 1) % len(EDITS)]}"


def stream(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    """One streamed request: time to the first content, end-to-end time, text, usage and timings."""
    start = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    for event in sse_events(url + path, {**body, "stream": True, "stream_options": {"include_usage": True}}, 1200):
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") or choice.get("text")
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "total_s": end - start, "text": "".join(text), "usage": usage,
            "timings": timings}


def cached_tokens(run: dict[str, Any]) -> int | None:
    details = (run["usage"] or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"])
    return int(run["timings"]["cache_n"]) if "cache_n" in run["timings"] else None


def prompt_tokens(run: dict[str, Any]) -> int | None:
    if run["usage"].get("prompt_tokens") is not None:
        return int(run["usage"]["prompt_tokens"])
    t = run["timings"]
    return int(t["prompt_n"]) + int(t.get("cache_n", 0)) if "prompt_n" in t else None


def new_tokens_only(url: str, messages: list[dict[str, str]], cached: int) -> dict[str, Any]:
    """Parrot's time to first token for the turn's uncached tokens alone, in a fresh scope."""
    ids = httpx.post(url + "/v1/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    tail = ids[cached:]
    run = stream(url, {"prompt": tail, "max_tokens": 1, "temperature": 0, "cache_salt": uuid.uuid4().hex},
                 path="/v1/completions")
    return {"tokens": len(tail), "ttft_s": run["ttft_s"]}


def run_workload(kind: str, systems: dict[str, Server], count: int, turns: int, max_tokens: int,
                 parrot: str) -> list[dict[str, Any]]:
    """Every conversation, turn by turn, interleaved over the systems; one record per turn."""
    convs = conversations(kind, count)
    histories = {(c["id"], name): [{"role": "user", "content": c["first"]}] for c in convs for name in systems}
    records = []
    names = list(systems)
    step = 0
    for turn in range(turns):
        for conv in convs:
            order = names[step % len(names):] + names[: step % len(names)]
            step += 1
            record: dict[str, Any] = {"workload": kind, "conversation": conv["id"], "turn": turn + 1, "runs": {}}
            for name in order:
                history = histories[(conv["id"], name)]
                body = {"model": "default", "messages": history, "max_tokens": max_tokens, "temperature": 0}
                run = stream(systems[name].url, body)
                run.update(cached=cached_tokens(run), prompt=prompt_tokens(run),
                           resident=resident(systems[name].process.pid))
                if name == parrot and turn > 0 and run["cached"]:
                    run["new_only"] = new_tokens_only(systems[name].url, history, run["cached"])
                record["runs"][name] = run
                history += [{"role": "assistant", "content": run["text"]},
                            {"role": "user", "content": next_message(kind, turn + 1, run["text"])}]
            records.append(record)
            print(f"[{kind}] turn {turn + 1} {conv['id']}: " + ", ".join(
                f"{n} ttft {r['ttft_s']:.2f} s (cached {r['cached']}/{r['prompt']})" for n, r in record["runs"].items()),
                flush=True)
    return records


def summarize(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per workload and turn: median TTFT and end-to-end per system, cached shares, the ratios."""
    rows = []
    for kind in dict.fromkeys(r["workload"] for r in records):
        for turn in sorted({r["turn"] for r in records if r["workload"] == kind}):
            group = [r for r in records if r["workload"] == kind and r["turn"] == turn]
            row: dict[str, Any] = {"workload": kind, "turn": turn, "conversations": len(group)}
            for name in names:
                runs = [g["runs"][name] for g in group if name in g["runs"]]
                row[f"{name}_ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
                row[f"{name}_e2e_s"] = statistics.median(r["total_s"] for r in runs)
                row[f"{name}_prompt"] = statistics.median(r["prompt"] or 0 for r in runs)
                row[f"{name}_cached"] = statistics.median(r["cached"] or 0 for r in runs)
                new = [r["new_only"]["ttft_s"] for r in runs if "new_only" in r]
                if new:
                    row[f"{name}_new_only_ttft_s"] = statistics.median(new)
                    row[f"{name}_vs_new_only"] = statistics.median(
                        r["ttft_s"] / r["new_only"]["ttft_s"] for r in runs if "new_only" in r)
            rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], names: list[str], parrot: str) -> str:
    head = ["workload", "turn"] + [f"{n} TTFT s" for n in names] + [f"{n} turn s" for n in names]
    head += [f"{n} cached/prompt" for n in names]
    head += ["Parrot new-only TTFT s", "Parrot / new-only"]
    if "llama" in names:
        head.append("Parrot / llama.cpp TTFT")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["workload"], str(r["turn"])] + [f"{r[f'{n}_ttft_s']:.2f}" for n in names]
        cells += [f"{r[f'{n}_e2e_s']:.2f}" for n in names]
        cells += [f"{r[f'{n}_cached']:.0f}/{r[f'{n}_prompt']:.0f}" for n in names]
        cells += [f"{r[f'{parrot}_new_only_ttft_s']:.2f}" if f"{parrot}_new_only_ttft_s" in r else "–",
                  f"{r[f'{parrot}_vs_new_only']:.2f}x" if f"{parrot}_vs_new_only" in r else "–"]
        if "llama" in names:
            cells.append(f"{r[f'{parrot}_ttft_s'] / r['llama_ttft_s']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded",
                        help="'embedded', 'qwen2.5-coder-1.5b' (assembled from its PyPI packages once), or a GGUF path")
    parser.add_argument("--conversations", type=int, default=2, help="conversations per workload")
    parser.add_argument("--turns", type=int, default=4, help="turns of a document conversation")
    parser.add_argument("--agent-turns", type=int, default=3, help="turns of an agent loop (0: no agent workload)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer in a document conversation")
    parser.add_argument("--agent-max-tokens", type=int, default=384, help="tokens per answer in an agent loop")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-baseline", action="store_true", help="skip Parrot without its prefix cache")
    parser.add_argument("--port", type=int, default=8761)
    parser.add_argument("--out", default=str(RESULTS / "bench_multiturn.json"))
    parser.add_argument("--render", default=None, metavar="JSON", help="print the table of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.render:
        earlier = json.loads(Path(args.render).read_text())
        names = [n for n in ("parrot", "parrot_nocache", "llama") if f"{n}_ttft_s" in earlier["summary"][0]]
        print(f"{earlier['info']['date']}, {earlier['info']['cpu']}\n\n" + render(earlier["summary"], names, "parrot"))
        return 0

    from parrot.engine.kernels import cpu_description, kernels
    from parrot.engine.source import resolve_source

    source = resolve_source(resolve(args.model))
    gguf = os.path.join(source.path, source.gguf_file or "")
    llama_server = os.environ.get("LLAMA_SERVER")
    chosen = kernels()
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "cpu": cpu_description(),
        "kernel_set": chosen.isa if chosen else None, "gguf": gguf, "gguf_bytes": os.path.getsize(gguf),
        "threads": args.threads, "max_tokens": args.max_tokens, "agent_max_tokens": args.agent_max_tokens,
    }
    print(f"CPU: {info['cpu']}; GGUF {gguf} ({info['gguf_bytes'] / 1e6:.0f} MB)", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PARROT_MODEL_THREADS=str(args.threads))
    parrot_cmd = [sys.executable, "-m", "parrot.cli", "serve", "--model", gguf]
    servers: dict[str, Server] = {}
    try:
        servers["parrot"] = Server("parrot", parrot_cmd + ["--port", str(args.port)], args.port, env,
                                   log=RESULTS / "bench_multiturn_parrot.log")
        if not args.no_baseline:
            servers["parrot_nocache"] = Server("parrot_nocache", parrot_cmd + ["--port", str(args.port + 1),
                                                                            "--prefix-cache-bytes", "0"],
                                               args.port + 1, env, log=RESULTS / "bench_multiturn_parrot_nocache.log")
        if llama_server:
            flags = ["-t", str(args.threads), *LLAMA_FLAGS]
            servers["llama"] = Server("llama", [llama_server, "-m", gguf, "--host", "127.0.0.1", "--port",
                                                str(args.port + 2), *flags], args.port + 2, peer_env(),
                                      log=RESULTS / "bench_multiturn_llama.log")
            version = subprocess.run([llama_server, "--version"], capture_output=True, text=True, env=peer_env())
            info["llama_server"] = {"binary": llama_server, "flags": flags,
                                    "version": (version.stdout + version.stderr).strip()}
        for server in servers.values():
            server.wait()
        names = list(servers)
        records = run_workload("documents", servers, args.conversations, args.turns, args.max_tokens, "parrot")
        if args.agent_turns:
            records += run_workload("agent", servers, args.conversations, args.agent_turns, args.agent_max_tokens,
                                    "parrot")
        metrics = httpx.get(servers["parrot"].url + "/metrics").text
        info["parrot_prefix_cache"] = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                                       if line.startswith("parrot:prefix_cache")}
        info["resident_max"] = {n: max(g["runs"][n]["resident"] for g in records) for n in names}
    finally:
        for server in servers.values():
            server.stop()
    rows = summarize(records, names)
    table = render(rows, names, "parrot")
    print(table)
    print("resident memory, max over the run (MiB): " +
          ", ".join(f"{n} {v / 2**20:.0f}" for n, v in info["resident_max"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"info": info, "summary": rows, "records": records}, indent=1))
    Path(args.out).with_suffix(".md").write_text(f"{info['date']}, {info['cpu']}, {gguf}\n\n{table}\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
