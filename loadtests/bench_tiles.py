"""The 8-bit path's linear layers alone: their cost per step and per row of x, with the weights
in cache and streamed from memory, for each kernel set this CPU runs, interleaved in one run
(ratios between sets and between numbers of rows, not absolute times, carry across machines).

    .venv/bin/python -m loadtests.bench_tiles [--sets avx2,avx512] [--formats q4_k,q6_k] [--rows 1,2,4,8]

No model is needed: the layers are random blocks of each format (any bytes are valid K-quant
blocks). A step is one weight vector of the packed layout (csrc/packed.h): 4 input channels of 8
weight rows, 32 weights.

- **cached**: one layer of ``--cached-n`` x ``--k`` (512 x 1,536 by default: under 1 MB packed, so
  in a core's L2) on one thread: the tiles' arithmetic alone. Over the numbers of rows it is
  fitted by least squares as ``fixed + per_row x rows`` ns per step: the weights' unpacking, the
  per-super-block epilogue and the fetches in the first, each row of x's multiply-adds in the
  second.
- **streamed**: ``--streamed-mb`` of layers of ``--streamed-n`` x ``--k`` read in turn by
  ``--threads`` threads, as a decoding pass reads its weights (every byte from memory once).
  Its ns per step over the cached ones (per thread) tells how far fetching and arithmetic
  overlap: a pass over few tokens is memory-bound where the streamed cost stays flat as rows
  grow, compute-bound where it follows the cached cost.

Each figure is the median of ``--rounds`` rounds, the sets alternating within a round (the
machine's neighbours move timings by 20-50% between minutes). Prints a markdown table and writes
``loadtests/results/bench_tiles.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from parrot.engine.kernels import Kernels, available_isas, cpu_description, kernels, mats
from parrot.engine.quant import FORMATS, BlockWeight

RESULTS = os.path.join(os.path.dirname(__file__), "results")
WEIGHTS_PER_STEP = 32


def log(message: str) -> None:
    print(f"[bench_tiles] {message}", file=sys.stderr, flush=True)


def random_layer(kind: str, n: int, k: int, seed: int) -> BlockWeight:
    """n x k weights of random blocks of ``kind``."""
    fmt = FORMATS[kind]
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // fmt.block_weights * fmt.block_bytes), generator=generator, dtype=torch.uint8)
    return BlockWeight(kind, data, private=True)  # its own bytes: dropped once packed


class Layers:
    """Layers of one format packed by one kernel set, called as the engine calls them: x [rows, k]
    through each in turn (the library's own entry point, without the Python wrapper's per-call
    allocation, which would be a tenth of a small layer's time)."""

    def __init__(self, lib: Kernels, layers: list[BlockWeight]) -> None:
        self.lib = lib
        for layer in layers:
            lib.pack(layer)
            layer.release_blocks()  # the packed copy is all the 8-bit path reads
        self.layers = layers  # the descriptors point into them
        self.chains = [mats([layer]) for layer in layers]
        self.n, self.k = layers[0].shape

    def time(self, rows: int, threads: int, calls: int) -> float:
        """Seconds per layer over ``calls`` calls (cycling through the layers)."""
        x = torch.randn(rows, self.k, generator=torch.Generator().manual_seed(rows))
        y = torch.empty(rows, self.n)
        linear = self.lib._lib.parrot_linear
        for chain in self.chains[: min(len(self.chains), 4)]:  # warm-up: the tiles' first calls
            linear(ctypes.byref(chain[0]), x.data_ptr(), rows, y.data_ptr(), threads, 1)
        begin = time.perf_counter()
        for call in range(calls):
            linear(ctypes.byref(self.chains[call % len(self.chains)][0]), x.data_ptr(), rows, y.data_ptr(), threads, 1)
        return (time.perf_counter() - begin) / calls


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``a + b x`` through (x, y): (a, b)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default=None, help="kernel sets (default: every set this CPU runs but portable)")
    parser.add_argument("--formats", default="q4_k,q6_k")
    parser.add_argument("--rows", default="1,2,3,4,6,8", help="rows of x (tokens of a pass)")
    parser.add_argument("--k", type=int, default=1536, help="input channels (a multiple of 256)")
    parser.add_argument("--cached-n", type=int, default=512)
    parser.add_argument("--streamed-n", type=int, default=4096)
    parser.add_argument("--streamed-mb", type=int, default=512, help="packed megabytes streamed per format and set")
    parser.add_argument("--threads", type=int, default=Kernels.threads())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(RESULTS, "bench_tiles.json"))
    args = parser.parse_args(argv)

    sets = args.sets.split(",") if args.sets else [isa for isa in available_isas() if isa != "portable"]
    formats, rows = args.formats.split(","), [int(r) for r in args.rows.split(",")]
    if any(isa not in available_isas() for isa in sets):
        parser.error(f"this CPU runs the sets {', '.join(available_isas())}")
    if args.k % 256:
        parser.error("--k must be a multiple of 256 (a K-quant super-block)")
    log(f"CPU: {cpu_description()}; sets {', '.join(sets)}; {args.threads} threads streamed")

    cached: dict[tuple[str, str], Layers] = {}
    streamed: dict[tuple[str, str], Layers] = {}
    for kind in formats:
        for isa in sets:
            lib = kernels(isa)
            cached[isa, kind] = Layers(lib, [random_layer(kind, args.cached_n, args.k, seed=0)])
            one = random_layer(kind, args.streamed_n, args.k, seed=1)
            lib.pack(one)
            count = max(2, args.streamed_mb * 2**20 // max(one.packed.numel(), 1))
            log(f"{isa} {kind}: packing {count} layers of {args.streamed_n} x {args.k} to stream")
            streamed[isa, kind] = Layers(lib, [one, *(random_layer(kind, args.streamed_n, args.k, seed=s) for s in range(2, count + 1))])

    samples: dict[tuple[str, str, int, str], list[float]] = {}
    for round_ in range(args.rounds):
        log(f"round {round_ + 1}/{args.rounds}")
        for kind in formats:
            for m in rows:
                for isa in sets:  # the sets alternate within a round
                    layers = cached[isa, kind]
                    samples.setdefault((isa, kind, m, "cached"), []).append(layers.time(m, 1, 200))
                    layers = streamed[isa, kind]
                    samples.setdefault((isa, kind, m, "streamed"), []).append(
                        layers.time(m, args.threads, len(layers.layers)))

    table: list[dict[str, Any]] = []
    fits: dict[str, dict[str, float]] = {}
    for isa in sets:
        for kind in formats:
            steps_cached = args.cached_n * args.k / WEIGHTS_PER_STEP
            steps_streamed = args.streamed_n * args.k / WEIGHTS_PER_STEP
            layer_bytes = streamed[isa, kind].layers[0].packed.numel()
            per_step = {m: 1e9 * statistics.median(samples[isa, kind, m, "cached"]) / steps_cached for m in rows}
            fixed, per_row = fit(per_step) if len(rows) > 1 else (per_step[rows[0]], 0.0)
            fits[f"{isa} {kind}"] = {"fixed_ns_per_step": fixed, "per_row_ns_per_step": per_row}
            for m in rows:
                seconds = statistics.median(samples[isa, kind, m, "streamed"])
                streamed_ns = 1e9 * seconds / steps_streamed
                table.append({"set": isa, "format": kind, "rows": m, "cached_ns_per_step": per_step[m],
                              "streamed_ns_per_step": streamed_ns,
                              # the cached cost shared by the streaming threads
                              "streamed_over_cached": streamed_ns / (per_step[m] / args.threads),
                              "streamed_gb_s": layer_bytes / seconds / 1e9})

    lines = [f"CPU: {cpu_description()}; cached: {args.cached_n} x {args.k}, 1 thread; streamed: "
             f"{args.streamed_mb} MB of {args.streamed_n} x {args.k}, {args.threads} threads; "
             f"medians of {args.rounds} rounds", "",
             "| set | format | rows | cached ns/step | streamed ns/step | streamed / (cached / threads) | streamed GB/s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['set']} | {r['format']} | {r['rows']} | {r['cached_ns_per_step']:.3f} | {r['streamed_ns_per_step']:.3f} "
              f"| {r['streamed_over_cached']:.2f} | {r['streamed_gb_s']:.1f} |" for r in table]
    lines += ["", "| set format | cached: fixed ns/step | + per row of x |", "|---|---:|---:|"]
    lines += [f"| {name} | {f['fixed_ns_per_step']:.3f} | {f['per_row_ns_per_step']:.3f} |" for name, f in fits.items()]
    print("\n".join(lines))
    result = {"cpu": cpu_description(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args),
              "table": table, "fits": fits}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"wrote {args.out} and its .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
