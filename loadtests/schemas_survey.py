"""Real-world JSON schemas through the API: how many are served, refused, and valid when finished.

    python -m loadtests.schemas_survey [--url URL] [--set shared|packages] [--strict absent,true]
                                       [--max-tokens 256] [--repeat-instructor 50]

Sends every schema of a set (``shared``: ../shared/data/schemas.jsonl, 300 schemas written
outside this project, see SCHEMAS.md; ``packages``: the 110 Kubernetes and SchemaStore schemas of
loadtests/package_schemas.py) as ``response_format`` json_schema to a chat request, once per
``strict`` setting asked for (greedy, drafting on, a short prompt naming the schema: the grammar
does the rest), 4 at a time, and reads the answer's
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
import re
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


def ask(url: str, row: dict[str, Any], max_tokens: int, strict: str = "absent") -> dict[str, Any]:
    schema = row["schema"]
    about = schema.get("title") or schema.get("description") or row["id"] if isinstance(schema, dict) else row["id"]
    json_schema: dict[str, Any] = {"name": "answer", "schema": schema}
    if strict != "absent":
        json_schema["strict"] = strict == "true"
    body = {"messages": [{"role": "user", "content": f"Write a realistic example JSON document: {str(about)[:200]}"}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": json_schema}}
    start = time.perf_counter()
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    except httpx.HTTPError as exc:
        return {"id": row["id"], "subset": row["subset"], "strict": strict, "status": None,
                "error": f"{type(exc).__name__}: {exc}"}
    entry: dict[str, Any] = {"id": row["id"], "subset": row["subset"], "strict": strict, "status": r.status_code,
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
    parser.add_argument("--set", choices=("shared", "packages"), default="shared")
    parser.add_argument("--strict", default="absent", help="comma-separated: absent, true, false (default absent)")
    parser.add_argument("--out")
    parser.add_argument("--render", help="print the tables of a results file again (with today's keyword grouping)")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        print(render({**saved, **keyword_tables(saved["runs"])}))
        return 0
    if args.set == "shared":
        rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines() if line.strip()]
    else:
        from loadtests.package_schemas import package_schemas

        rows = package_schemas()
    stricts = [v for v in args.strict.split(",") if v]
    jobs = [(row, strict) for strict in stricts for row in rows]
    out = args.out or str(RESULTS / ("schemas_survey.json" if args.set == "shared" else "schemas_survey_packages.json"))
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
            for entry in pool.map(lambda job: ask(url, job[0], args.max_tokens, job[1]), jobs):
                runs.append(entry)
                if len(runs) % 25 == 0 or entry["status"] != 200:
                    print(f"[{len(runs)}/{len(jobs)}] {entry['id']} strict={entry['strict']}: {entry['status']} "
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

    groups = sorted({(r["subset"], r["strict"]) for r in runs})
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": args.max_tokens,
              "set": args.set, "strict": stricts, "summary": summarize(runs),
              "by_subset": {f"{s} (strict {t})": summarize([r for r in runs if (r["subset"], r["strict"]) == (s, t)])
                            for s, t in groups},
              **keyword_tables(runs), "instructor_repeats": dict(instructor), "runs": runs}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(render(result))
    print(f"wrote {out}")
    return 0


def keywords(unenforced: str) -> list[str]:
    """The keywords an ``unenforced`` entry (llguidance's warning) names: 'Unimplemented keys:
    ["if", "then"] (3 times)' -> ["if", "then"]; 'Unknown format: byte' -> ["format: byte"];
    'oneOf not fully supported, ...' -> ["oneOf"]."""
    text = re.sub(r" \(\d+ times\)$", "", unenforced)
    if text.startswith("Unimplemented keys:"):
        return json.loads(text.split(":", 1)[1])
    if text.startswith("Unknown format:"):
        return ["format: " + text.split(":", 1)[1].strip()]
    if text.startswith("min/maxProperties"):
        return ["minProperties/maxProperties"]
    return [text.split(" ")[0]]


def keyword_tables(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How often each keyword was left to the check (``unenforced_kinds``, per warning), and the
    answers that had it (``by_keyword``)."""
    return {"unenforced_kinds": dict(collections.Counter(k for r in runs for w in r.get("unenforced", [])
                                                         for k in keywords(w))),
            "by_keyword": by_keyword(runs)}


def by_keyword(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """For each keyword the grammar left out: answers that had it, and how their finished outputs
    checked against the whole schema."""
    out: dict[str, collections.Counter[str]] = {}
    for r in runs:
        for name in {k for w in r.get("unenforced", []) for k in keywords(w)}:
            counts = out.setdefault(name, collections.Counter())
            counts["served"] += 1
            if r.get("finish") == "stop":
                counts["finished_valid" if r["valid"] else "finished_invalid"] += 1
            else:
                counts["cut_by_length"] += 1
    return {name: dict(c) for name, c in sorted(out.items(), key=lambda kv: -kv[1]["served"])}


def render(result: dict[str, Any]) -> str:
    cols = ["schemas", "served", "refused_4xx", "server_errors_5xx", "with_unenforced", "finished", "finished_valid",
            "finished_invalid", "length"]
    lines = [f"# Real-world schemas, set {result.get('set', 'shared')} ({result['date']}, max_tokens "
             f"{result['max_tokens']}, greedy, drafting on)", "",
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
              f"Unenforced, by kind: {result['unenforced_kinds']}", "",
              "| keyword left to the check | served | finished valid | finished invalid | cut by length |",
              "|---|---:|---:|---:|---:|",
              *(f"| {k} | {c.get('served', 0)} | {c.get('finished_valid', 0)} | {c.get('finished_invalid', 0)} | "
                f"{c.get('cut_by_length', 0)} |" for k, c in result.get("by_keyword", {}).items()), "",
              f"Refused: {[(r['id'], r['error'][:100]) for r in result['runs'] if r['status'] != 200]}",
              f"instructor JSON_SCHEMA body x{repeats}: {result['instructor_repeats']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
