"""Cross-request (session) drafting on a multi-turn code-edit replay: turn 2 with and without it.

    python -m loadtests.replay_sessions [--rows 6] [--max-tokens 256]

Starts ``parrot serve`` on the embedded model with ``server.session_drafting = true`` (a config
in a temporary directory) and replays rows of ../shared/data/code_edit.jsonl as two turns of
one tenant (its own ``user``): turn 1 is the row's edit request; turn 2 sends the same file
with the same instruction again, as an agent does when it retries or re-applies an edit after
a failed check, so the answer repeats much of turn 1's output, which the turn-2 prompt does not
contain (it has the code before the edit). Turn 2 runs twice per row, with
``speculation.session`` on and off (in a rotating order, each after its own turn 1 for a fresh
tenant), greedy, streamed: decode tokens/s, drafted and accepted tokens. Outputs must be
identical either way (drafts never change greedy output). Prints a table and writes
loadtests/results/replay_sessions.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.bench_engine import DATA, RESULTS, machine


def chat(url: str, prompt: str, user: str, session: bool, max_tokens: int) -> dict[str, Any]:
    from loadtests.peers import stream_chat

    run = stream_chat(url, prompt, max_tokens, {"user": user, "speculation": {"session": session}})
    return {**run, "drafted": run["speculation"].get("drafted_tokens", 0), "accepted": run["speculation"].get("accepted_tokens", 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=8751)
    parser.add_argument("--out", default=str(RESULTS / "replay_sessions.json"))
    args = parser.parse_args(argv)
    from loadtests.peers import Server

    with open(DATA / "code_edit.jsonl") as f:
        rows = [json.loads(line) for line in f][: args.rows]
    config = Path(tempfile.mkdtemp()) / "sessions.toml"
    config.write_text("[server]\nsession_drafting = true\n")
    server = Server("replay_sessions", [sys.executable, "-m", "parrot.cli", "serve", "--config", str(config),
                                        "--port", str(args.port)], args.port, dict(os.environ))
    runs = []
    try:
        server.wait()
        for index, row in enumerate(rows):
            entry: dict[str, Any] = {"id": row["id"]}
            for mode in (["on", "off"] if index % 2 == 0 else ["off", "on"]):
                user = f"replay-{index}-{mode}"
                entry[f"turn1_{mode}"] = chat(server.url, row["prompt"], user, True, args.max_tokens)
                entry[f"turn2_{mode}"] = chat(server.url, row["prompt"], user, mode == "on", args.max_tokens)
            on, off = entry["turn2_on"], entry["turn2_off"]
            entry["identical"] = on["text"] == off["text"]
            runs.append(entry)
            print(f"[{index + 1}/{len(rows)}] {row['id']}: turn 2 session on {on['tokens'] / max(on['total_s'], 1e-9):.0f} "
                  f"tok/s ({on['accepted']}/{on['drafted']} drafts accepted), off "
                  f"{off['tokens'] / max(off['total_s'], 1e-9):.0f} tok/s ({off['accepted']}/{off['drafted']})", flush=True)
    finally:
        server.stop()

    def rate(mode: str, metric: str) -> float:
        turns = [r[f"turn2_{mode}"] for r in runs]
        if metric == "decode":
            return sum(max(t["tokens"] - 1, 0) for t in turns) / sum(t["decode_s"] for t in turns)
        return sum(t["tokens"] for t in turns) / sum(t["total_s"] for t in turns)

    summary = {mode: {"decode_tok_s": rate(mode, "decode"), "e2e_tok_s": rate(mode, "e2e"),
                      "drafted": sum(r[f"turn2_{mode}"]["drafted"] for r in runs),
                      "accepted": sum(r[f"turn2_{mode}"]["accepted"] for r in runs)} for mode in ("on", "off")}
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "rows": len(runs),
              "max_tokens": args.max_tokens, "summary": summary,
              "identical": sum(r["identical"] for r in runs), "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    on, off = summary["on"], summary["off"]
    print(f"\nTurn 2 of {len(runs)} code-edit replays ({result['date']}), greedy, max_tokens {args.max_tokens}\n")
    print("| session drafting | decode tok/s | end-to-end tok/s | drafts accepted / made |")
    print("|---|---:|---:|---:|")
    for mode, s in (("on", on), ("off", off)):
        print(f"| {mode} | {s['decode_tok_s']:.1f} | {s['e2e_tok_s']:.1f} | {s['accepted']} / {s['drafted']} |")
    print(f"\nSession on / off: decode {on['decode_tok_s'] / off['decode_tok_s']:.2f}x, end to end "
          f"{on['e2e_tok_s'] / off['e2e_tok_s']:.2f}x; turn-2 outputs identical on {result['identical']}/{len(runs)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
