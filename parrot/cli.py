"""The ``parrot`` command: ``parrot serve`` (HTTP server) and ``parrot generate`` (offline batch)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

from parrot.config import Config, load_config


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="TOML config file (default: configs/default.toml)")
    parser.add_argument("--model", default=None, help="'embedded', a model directory, a .gguf file, or a hub id")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    parser.add_argument("--activations", default=None, choices=("q8", "float32"),
                        help="block kernels' inputs: q8 (8-bit, faster; default) or float32")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template (a file, or the template itself) for a model that has none, as a "
                             "base model's GGUF, or to replace the model's own")
    parser.add_argument("--prefix-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                        help="host memory for KV blocks reused across requests (a chat's next turn reads only its "
                             "new tokens): bytes, or with a K/M/G suffix (2G); 0 turns the cache off; default: a "
                             "quarter of the memory available after loading, at most 8G")


def byte_size(text: str) -> int:
    """``2G``, ``512M``, ``64K`` (powers of 1024; ``GiB``, ``MB`` and such too) or plain bytes."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(raw[-1:], 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or a number with K, M or G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return int(value * scale)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parrot", description="Parrot: exact n-gram speculative decoding server")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_common(serve)
    serve.add_argument("--host", default=None, help="listen address (default from config: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default from config: 8000)")
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY) on /v1/ requests "
                       "(also PARROT_API_KEY)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="require one of the keys in this file (one per line, # comments) on /v1/ requests")
    serve.add_argument("--ray", action="store_true",
                       help="serve on Ray Serve: replicas of the server behind one gateway with session affinity "
                            "(needs the ray extra: pip install 'parrot-server[ray]'; RAY_ADDRESS names a cluster)")
    serve.add_argument("--replicas", type=int, default=1, help="with --ray: replicas, one engine each (default 1)")
    serve.add_argument("--max-replicas", type=int, default=None,
                       help="with --ray: autoscale between --replicas and this many on queue depth")

    gen = sub.add_parser("generate", help="generate for every line of a JSONL file (the model loads once)")
    _add_common(gen)
    gen.add_argument("--input", required=True, type=Path, help='JSONL: {"id", "prompt"} or {"id", "messages"}')
    gen.add_argument("--output", required=True, type=Path, help="JSONL results, one line per input line")
    gen.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (line i uses seed + i)")
    gen.add_argument("--no-draft", action="store_true", help="plain decoding, no speculation")
    return parser


def _config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, dict[str, Any]] = {
        "model": {"source": args.model, "device": args.device, "dtype": args.dtype, "activations": args.activations,
                  "chat_template": args.chat_template},
    }
    overrides["server"] = {name: getattr(args, name, None) for name in ("host", "port", "api_key", "api_key_file")}
    if getattr(args, "no_draft", False):
        overrides["drafting"] = {"enabled": False}
    if args.prefix_cache_bytes is not None:
        overrides["prefix_cache"] = {"bytes": args.prefix_cache_bytes}
    return load_config(args.config, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = _config_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"parrot: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from parrot.engine.loader import preflight
        from parrot.engine.source import ModelNotFoundError, ModelTooLargeError
        from parrot.server.app import serve
        from parrot.server.auth import read_keys

        try:  # a missing model or one that cannot fit, or an unreadable key file: said now, not as a traceback
            preflight(config.model)
            read_keys(config.server)
        except (ModelNotFoundError, ModelTooLargeError, ValueError) as exc:
            print(f"parrot: {exc}", file=sys.stderr)
            return 2
        if args.ray:
            return _serve_on_ray(config, args)
        if args.replicas != 1 or args.max_replicas is not None:
            print("parrot: --replicas and --max-replicas need --ray", file=sys.stderr)
            return 2
        return serve(config)
    return generate_file(config, args)


def _serve_on_ray(config: Config, args: argparse.Namespace) -> int:
    if args.replicas < 1 or (args.max_replicas is not None and args.max_replicas < args.replicas):
        print("parrot: need 1 <= --replicas <= --max-replicas", file=sys.stderr)
        return 2
    try:
        from parrot.server.ray_app import run
    except ImportError as exc:
        print(f"parrot: --ray needs Ray Serve ({exc}); install it with: pip install 'parrot-server[ray]'", file=sys.stderr)
        return 2
    return run(config, args.replicas, args.max_replicas)


def _parse_line(line: str, number: int) -> tuple[Any, list[dict[str, Any]]]:
    """(id, chat messages) of one input line, or ValueError saying what is wrong with it."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict):
        raise ValueError(f"line {number}: expected a JSON object")
    item_id = item.get("id", number)
    if "prompt" in item and "messages" in item:
        raise ValueError(f"line {number}: give either 'prompt' or 'messages', not both")
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise ValueError(f"line {number}: 'prompt' must be a string")
        return item_id, [{"role": "user", "content": item["prompt"]}]
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f"line {number}: needs 'prompt' (string) or 'messages' (list of {{role, content}})")
    return item_id, messages


def generate_file(config: Config, args: argparse.Namespace) -> int:
    from parrot.engine.build import build_engine
    from parrot.engine.engine import GenerationRequest, SpeculationParams
    from parrot.engine.source import ModelNotFoundError, ModelTooLargeError
    from parrot.engine.sampling import SamplingParams

    try:
        lines = args.input.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"parrot: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    items = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    try:
        base_params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
        )
    except ValueError as exc:
        print(f"parrot: {exc}", file=sys.stderr)
        return 2
    try:
        loaded, engine = build_engine(config)
    except (ModelNotFoundError, ModelTooLargeError) as exc:
        print(f"parrot: {exc}", file=sys.stderr)
        return 2
    device, dtype = str(loaded.device), str(loaded.dtype).removeprefix("torch.")
    failures = 0
    totals = {"tokens": 0, "seconds": 0.0, "passes": 0}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as out:
        for index, (number, line) in enumerate(items):
            try:
                item_id, messages = _parse_line(line, number)
                prompt_ids = loaded.tokenizer.encode_chat(messages)
                params = dataclasses.replace(base_params, seed=None if args.seed is None else args.seed + index)
                request = GenerationRequest(prompt_ids, params, SpeculationParams(enabled=not args.no_draft))
                result = engine.generate(request)
            except ValueError as exc:
                failures += 1
                _write(out, {"id": _safe_id(line, number), "error": str(exc)})
                print(f"[{index + 1}/{len(items)}] line {number}: error: {exc}", file=sys.stderr)
                continue
            s = result.stats
            _write(
                out,
                {
                    "id": item_id,
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.output_tokens},
                    "stats": {
                        **s.counters(),
                        "ttft_s": round(s.ttft_s or 0.0, 4),
                        "elapsed_s": round(s.elapsed_s, 4),
                        "device": device,
                        "dtype": dtype,
                    },
                },
            )
            totals["tokens"] += s.output_tokens
            totals["seconds"] += s.elapsed_s
            totals["passes"] += s.forward_passes
            print(
                f"[{index + 1}/{len(items)}] {item_id}: {s.output_tokens} tokens in {s.elapsed_s:.2f} s "
                f"({s.output_tokens / max(s.elapsed_s, 1e-9):.1f} tok/s, "
                f"{s.output_tokens / max(s.forward_passes, 1):.2f} tokens/pass), {result.finish_reason}",
                file=sys.stderr,
            )
    print(
        f"done: {len(items) - failures} generated, {failures} failed; {totals['tokens']} tokens in "
        f"{totals['seconds']:.1f} s ({totals['tokens'] / max(totals['seconds'], 1e-9):.1f} tok/s, "
        f"{totals['tokens'] / max(totals['passes'], 1):.2f} tokens/pass) -> {args.output}",
        file=sys.stderr,
    )
    return 1 if failures else 0


def _safe_id(line: str, number: int) -> Any:
    try:
        item = json.loads(line)
        return item.get("id", number) if isinstance(item, dict) else number
    except json.JSONDecodeError:
        return number


def _write(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
