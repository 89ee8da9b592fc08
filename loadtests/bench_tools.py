"""Drafting inside tool-call arguments: an agent's write_file call that copies the file it sent.

    python -m loadtests.bench_tools [--rows 6] [--max-tokens 384] [--model FILE]

Starts ``parrot serve`` on the embedded model and sends, for rows of
../shared/data/code_edit.jsonl, the row's edit request with one tool, ``write_file(path,
content)``, and ``tool_choice`` naming it: the answer is a call whose ``content`` argument is the
edited file, so most of it copies the code in the prompt. Each row runs with drafting on and off
(``speculation.enabled``, rotating order), greedy, not streamed: tokens/s, forced tokens (the
grammar's: tags, name, keys), drafted and accepted tokens. The calls must be identical either
way and parse as JSON with a string ``content``. Prints a table and writes
loadtests/results/bench_tools.json.

The embedded 135M model does not do the task: asked by name for write_file it answers
``{"path":"","content":""}`` (valid, empty), so on it this measures the grammar's forced tokens
and a few drafts, not copying; run it with ``--model`` on a model that follows tool prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_engine import DATA, RESULTS, machine

WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Save the complete edited file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"], "additionalProperties": False}}}


def call(url: str, prompt: str, drafting: bool, max_tokens: int) -> dict[str, Any]:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt + "\n\nSave the edited code with write_file."}],
            "tools": [WRITE_FILE], "tool_choice": {"type": "function", "function": {"name": "write_file"}},
            "speculation": {"enabled": drafting}}
    start = time.perf_counter()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    answer = response.json()
    choice, usage = answer["choices"][0], answer["usage"]
    calls = choice["message"].get("tool_calls") or []
    arguments = calls[0]["function"]["arguments"] if calls else ""
    try:
        valid = isinstance(json.loads(arguments).get("content"), str)
    except (ValueError, AttributeError):
        valid = False
    spec = usage.get("speculation", {})
    return {"tokens": usage["completion_tokens"], "seconds": elapsed, "finish_reason": choice["finish_reason"],
            "arguments": arguments, "valid": valid, "forced": spec.get("forced_tokens", 0),
            "drafted": spec.get("drafted_tokens", 0), "accepted": spec.get("accepted_tokens", 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--model", default="embedded", help="what `parrot serve --model` takes")
    parser.add_argument("--port", type=int, default=8761)
    parser.add_argument("--out", default=str(RESULTS / "bench_tools.json"))
    args = parser.parse_args(argv)
    from loadtests.peers import Server

    with open(DATA / "code_edit.jsonl") as f:
        rows = [json.loads(line) for line in f][: args.rows]
    server = Server("bench_tools", [sys.executable, "-m", "parrot.cli", "serve", "--model", args.model,
                                    "--port", str(args.port)], args.port, dict(os.environ))
    runs = []
    try:
        server.wait()
        call(server.url, rows[0]["prompt"], True, 8)  # warm-up
        for index, row in enumerate(rows):
            entry: dict[str, Any] = {"id": row["id"]}
            for mode in (["on", "off"] if index % 2 == 0 else ["off", "on"]):
                entry[mode] = call(server.url, row["prompt"], mode == "on", args.max_tokens)
            on, off = entry["on"], entry["off"]
            entry["identical"] = on["arguments"] == off["arguments"]
            runs.append(entry)
            print(f"[{index + 1}/{len(rows)}] {row['id']}: drafting on {on['tokens'] / on['seconds']:.0f} tok/s "
                  f"({on['accepted']}/{on['drafted']} drafts accepted, {on['forced']} forced), off "
                  f"{off['tokens'] / off['seconds']:.0f} tok/s; {on['finish_reason']}, valid {on['valid']}", flush=True)
    finally:
        server.stop()

    summary = {}
    for mode in ("on", "off"):
        turns = [r[mode] for r in runs]
        summary[mode] = {"tok_s": sum(t["tokens"] for t in turns) / sum(t["seconds"] for t in turns),
                         "forced": sum(t["forced"] for t in turns), "drafted": sum(t["drafted"] for t in turns),
                         "accepted": sum(t["accepted"] for t in turns), "valid": sum(t["valid"] for t in turns)}
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model, "rows": len(runs),
              "max_tokens": args.max_tokens, "summary": summary, "identical": sum(r["identical"] for r in runs),
              "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    on, off = summary["on"], summary["off"]
    empty = sum(not json.loads(r["on"]["arguments"] or "{}").get("content") for r in runs if r["on"]["valid"])
    print(f"\n{empty}/{len(runs)} calls had an empty content argument")
    print(f"\nwrite_file calls copying the edited file, {len(runs)} code-edit rows ({result['date']}), greedy, "
          f"max_tokens {args.max_tokens}, end to end\n")
    print("| drafting | tokens/s | forced tokens | drafts accepted / made | arguments valid JSON |")
    print("|---|---:|---:|---:|---:|")
    for mode, s in (("on", on), ("off", off)):
        print(f"| {mode} | {s['tok_s']:.1f} | {s['forced']} | {s['accepted']} / {s['drafted']} | {s['valid']}/{len(runs)} |")
    print(f"\nDrafting on / off: {on['tok_s'] / off['tok_s']:.2f}x; calls identical on {result['identical']}/{len(runs)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
