"""Real-world JSON schemas through the API: how many are served, refused, and valid when finished.

    python -m loadtests.schemas_survey [--url URL] [--max-tokens 256] [--repeat-instructor 50]

Sends every schema of ../shared/data/schemas.jsonl (300 schemas written outside this project,
see SCHEMAS.md) as ``response_format`` json_schema to a chat request (greedy, drafting on, a
short prompt naming the schema: the grammar does the rest), 4 at a time, and reads the answer's
``schema_check`` (what the grammar left out, whether the finished output validated against the
whole schema). Then repeats the request body that once made a 500 (instructor's JSON_SCHEMA mode:
``json_object`` with a ``schema``, the schema quoted in the system prompt) ``--repeat-instructor``
times. Starts ``parrot serve`` on the embedded model unless given ``--url``. Prints tables and
writes loadtests/results/schemas_survey.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from loadtests.bench_engine import DATA, RESULTS, machine

SCHEMAS = DATA / "schemas.jsonl"
PERSON = {"properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
          "required": ["name", "age"], "title": "User", "type": "object"}
INSTRUCTOR_BODY = {
    "messages": [
        {"role": "system", "content": "As a genius expert, your task is to understand the content and provide the "
         f"parsed objects in json that match the following json_schema:\n\n{json.dumps(PERSON, indent=2)}\n\n"
         "Make sure to return an instance of the JSON, not the schema itself"},
        {"role": "user", "content": "Jason is 25 years old."},
    ],
    "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object", "schema": PERSON},
}


def ask(url: str, row: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    schema = row["schema"]
    about = schema.get("title") or schema.get("description") or row["id"] if isinstance(schema, dict) else row["id"]
    body = {"messages": [{"role": "user", "content": f"Write a realistic example JSON document: {str(about)[:200]}"}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    start = time.perf_counter()
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    except httpx.HTTPError as exc:
        return {"id": row["id"], "subset": row["subset"], "status": None, "error": f"{type(exc).__name__}: {exc}"}
    entry: dict[str, Any] = {"id": row["id"], "subset": row["subset"], "status": r.status_code,
                             "seconds": time.perf_counter() - start}
    payload = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200:
        entry["error"] = payload.get("error", {}).get("message", r.text[:300])
        return entry
    check = payload["schema_check"]
    choice = payload["choices"][0]
    entry.update(finish=choice["finish_reason"], valid=check["choices"][0]["valid"],
                 invalid_because=check["choices"][0]["error"] if check["choices"][0]["valid"] is False else None,
                 unenforced=check["unenforced"], tokens=payload["usage"]["completion_tokens"],
                 drafted=payload["usage"]["speculation"]["drafted_tokens"],
                 accepted=payload["usage"]["speculation"]["accepted_tokens"],
                 forced=payload["usage"]["speculation"]["forced_tokens"])
    return entry


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    served = [r for r in runs if r["status"] == 200]
    finished = [r for r in served if r["finish"] == "stop"]
    return {
        "schemas": len(runs), "served": len(served), "refused_4xx": sum(1 for r in runs if r["status"] and 400 <= r["status"] < 500),
        "server_errors_5xx": sum(1 for r in runs if r["status"] and r["status"] >= 500),
        "transport_errors": sum(1 for r in runs if r["status"] is None),
        "with_unenforced": sum(1 for r in served if r["unenforced"]),
        "finished": len(finished), "finished_valid": sum(1 for r in finished if r["valid"]),
        "finished_invalid": sum(1 for r in finished if r["valid"] is False),
        "finished_invalid_with_unenforced": sum(1 for r in finished if r["valid"] is False and r["unenforced"]),
        "length": sum(1 for r in served if r["finish"] == "length"),
        "tokens": sum(r["tokens"] for r in served), "drafted": sum(r["drafted"] for r in served),
        "accepted": sum(r["accepted"] for r in served), "forced": sum(r["forced"] for r in served),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: start parrot serve on the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeat-instructor", type=int, default=50)
    parser.add_argument("--port", type=int, default=8752)
    parser.add_argument("--out", default=str(RESULTS / "schemas_survey.json"))
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines() if line.strip()]
    from loadtests.peers import Server

    server = None
    url = args.url
    if url is None:
        server = Server("schemas_survey", [sys.executable, "-m", "parrot.cli", "serve", "--port", str(args.port)],
                        args.port, dict(os.environ))
        server.wait()
        url = server.url
    runs: list[dict[str, Any]] = []
    instructor: collections.Counter[str] = collections.Counter()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            for entry in pool.map(lambda row: ask(url, row, args.max_tokens), rows):
                runs.append(entry)
                if len(runs) % 25 == 0 or entry["status"] != 200:
                    print(f"[{len(runs)}/{len(rows)}] {entry['id']}: {entry['status']} "
                          f"{entry.get('finish', '')} valid={entry.get('valid')} {entry.get('error', '')[:120]}", flush=True)
        for i in range(args.repeat_instructor):
            r = httpx.post(url + "/v1/chat/completions", json=INSTRUCTOR_BODY, timeout=120)
            instructor[str(r.status_code)] += 1
            if r.status_code == 200:
                instructor["valid"] += bool(r.json()["schema_check"]["choices"][0]["valid"])
                instructor["drafted"] += r.json()["usage"]["speculation"]["drafted_tokens"]
            if (i + 1) % 10 == 0:
                print(f"[instructor {i + 1}/{args.repeat_instructor}] {dict(instructor)}", flush=True)
    finally:
        if server is not None:
            server.stop()

    subsets = sorted({r["subset"] for r in runs})
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": args.max_tokens,
              "summary": summarize(runs), "by_subset": {s: summarize([r for r in runs if r["subset"] == s]) for s in subsets},
              "unenforced_kinds": dict(collections.Counter(w.split(":")[0].split(" (")[0] for r in runs
                                                           for w in r.get("unenforced", []))),
              "instructor_repeats": dict(instructor), "runs": runs}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))
    print(f"wrote {args.out}")
    return 0


def render(result: dict[str, Any]) -> str:
    cols = ["schemas", "served", "refused_4xx", "server_errors_5xx", "with_unenforced", "finished", "finished_valid",
            "finished_invalid", "length"]
    lines = [f"# Real-world schemas ({result['date']}, max_tokens {result['max_tokens']}, greedy, drafting on)", "",
             "| subset | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, s in [*result["by_subset"].items(), ("**all**", result["summary"])]:
        lines.append(f"| {name} | " + " | ".join(str(s[c]) for c in cols) + " |")
    s = result["summary"]
    repeats = sum(v for k, v in result["instructor_repeats"].items() if k.isdigit())
    lines += ["",
              (f"Served {s['served']}/{s['schemas']} ({100 * s['served'] / s['schemas']:.1f}%); finished outputs valid "
               f"against the whole schema: {s['finished_valid']}/{s['finished']}; invalid ones with an unenforced "
               f"keyword: {s['finished_invalid_with_unenforced']}/{s['finished_invalid']}. Drafts: "
               f"{s['accepted']}/{s['drafted']} accepted, {s['forced']} forced tokens of {s['tokens']}."),
              f"Unenforced, by kind: {result['unenforced_kinds']}",
              f"Refused: {[(r['id'], r['error'][:100]) for r in result['runs'] if r['status'] != 200]}",
              f"instructor JSON_SCHEMA body x{repeats}: {result['instructor_repeats']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
