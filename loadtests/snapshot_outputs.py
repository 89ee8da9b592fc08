"""Greedy outputs of a running server over held-out prompts, to compare a change that should not
change behaviour (a refactor, a new kernel layout) with the tree before it.

    python -m loadtests.snapshot_outputs --url http://127.0.0.1:8000 --out after.json
    python -m loadtests.snapshot_outputs --compare before.json after.json

Each record keeps the text, finish reason, usage and every token's logprob with its two best
alternatives, so "identical" means bit for bit: the first 10 prompts of each task file in
``../shared/data`` (chat, greedy, 64 tokens) and 8 structured-output requests from its schemas.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
TASKS = ("code_edit", "context_qa", "grammar", "open_chat", "summarization")


def requests(data: Path, per_task: int, schemas: int) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for task in TASKS:
        with open(data / f"{task}.jsonl") as f:
            for line in list(f)[:per_task]:
                p = json.loads(line)
                rows.append((p["id"], {"messages": [{"role": "user", "content": p["prompt"]}]}))
    with open(data / "schemas.jsonl") as f:
        for line in list(f)[:schemas]:
            s = json.loads(line)
            rows.append((s["id"], {"messages": [{"role": "user", "content": "Give an example object as JSON."}],
                                   "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s["schema"]}}}))
    return rows


def snapshot(url: str, rows: list[tuple[str, dict[str, Any]]], max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client(timeout=600) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for rid, body in rows:
            body = {**body, "model": model, "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "top_logprobs": 2}
            r = client.post(url + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                out[rid] = {"status": r.status_code, "body": r.json()}
                continue
            j = r.json()
            choice = j["choices"][0]
            tokens = (choice.get("logprobs") or {}).get("content") or []
            out[rid] = {"text": choice["message"].get("content"), "finish": choice["finish_reason"],
                        "logprobs": [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
                                     for t in tokens],
                        "usage": {k: v for k, v in j["usage"].items() if k != "speculation"}}
            print(f"{rid}: {choice['finish_reason']}, {len(tokens)} tokens", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--schemas", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        print(f"| requests | identical | different |\n|---:|---:|---:|\n| {len(before)} | {len(before) - len(differ)} | {len(differ)} |")
        for key in differ:
            print(f"different: {key}")
        return 1 if differ else 0
    if args.out is None:
        parser.error("--out is needed to take a snapshot")
    result = snapshot(args.url, requests(args.data, args.per_task, args.schemas), args.max_tokens)
    args.out.write_text(json.dumps(result, indent=0))
    print(f"{len(result)} outputs written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
