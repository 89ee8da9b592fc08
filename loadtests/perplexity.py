"""Perplexity guard: Parrot with 8-bit and with float32 activations, and llama.cpp, on one GGUF.

    make numerics [MODEL=qwen2.5-coder-1.5b|gemma-3-270m|FILE] [LLAMA_PERPLEXITY=/path/llama-perplexity]

Perplexity over a fixed text, chunked and scored exactly as ``llama-perplexity -c 512`` does
(llama.cpp's tools/perplexity/perplexity.cpp, ``perplexity()``):

- the whole text is tokenized once, with BOS in front when the vocabulary adds one (llama.cpp's
  ``common_tokenize(ctx, text, add_special=true, parse_special=false)``; its ``-f`` drops one
  trailing newline, and the text here has none);
- it is cut into ``len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (the remainder is not read);
  each chunk is one fresh pass from an empty cache, its first token replaced by BOS when the
  vocabulary adds BOS;
- only the second half is scored: with ``first = n_ctx // 2``, the logits after positions
  ``first .. n_ctx - 2`` predict the tokens at ``first + 1 .. n_ctx - 1``, ``n_ctx - first - 1``
  tokens per chunk (255 at 512);
- PPL = exp(mean negative log-likelihood), and its +/- as llama.cpp prints it: the standard
  error of the mean NLL times PPL.

Three systems on the same file: Parrot with ``model.activations = "q8"`` (the default), Parrot
with ``"float32"`` (both through ``load_model``, whichever backend takes the file: the native
kernels, or transformers' forward for architectures they do not run, recorded in the JSON), and
llama.cpp's ``llama-perplexity -c 512 -t 2`` on the same text file (``LLAMA_PERPLEXITY`` or
``--llama-perplexity``; without it the llama.cpp column is skipped, and the table says so).
Beside the PPLs: the mean KL divergence of Parrot q8's next-token distributions from Parrot
float32's, KL(float32 || q8), over the scored positions, and how often their top tokens agree.

llama.cpp's divergence from the same float32 reference: with llama-perplexity given, Parrot
float32's scored rows are also written in the file format of ``llama-perplexity
--kl-divergence-base`` (its log-probabilities coded in 16 bits per token, 2.2 GB for the 1.5B,
deleted afterwards), and ``llama-perplexity --kl-divergence`` reads them against its own
distributions on the same chunks. Parrot q8's KL is taken once more from those stored rows as
llama.cpp takes its own (tokens above -16 in log-probability), so the two KLs compare like with
like. The KL does not depend on which way each rounding happens to move a scored token's
probability, which the PPL ratio does: a few chunks' luck moves it by about its +/-.

Token counts: ``llama-perplexity`` does not print how many tokens the text gives when it has
enough of them; with a context of the whole text (``-c N --chunks 0``, N = Parrot's count) it
stops at once and prints "tokenizes to only T tokens", from the same tokenization call. That T
is checked against Parrot's count.

The text (``fixed_text``): the first 34 news articles of the SummEval rows of
``../shared/data/summarization.jsonl`` (CNN/DailyMail's test split), each the row's prompt after
its instruction line, in file order, joined by blank lines: 15,875 tokens on the embedded model
(31 chunks of 512, 7,905 tokens scored).

Prints a table and writes loadtests/results/numerics_<model>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from loadtests.bench_engine import DATA, RESULTS

ARTICLES = 34
INSTRUCTION = "Summarize the following news article in a few sentences.\n\n"


# -- The text ---------------------------------------------------------------------------------------

def fixed_text(articles: int = ARTICLES, data: Path = DATA) -> str:
    """The first ``articles`` SummEval articles (CNN/DailyMail test split) of summarization.jsonl,
    in file order, joined by blank lines (no trailing newline)."""
    out: list[str] = []
    with open(data / "summarization.jsonl") as f:
        for line in f:
            row = json.loads(line)
            if row["id"].startswith("summeval-") and len(out) < articles:
                assert row["prompt"].startswith(INSTRUCTION), row["id"]
                out.append(row["prompt"][len(INSTRUCTION):].strip())
    if len(out) < articles:
        raise ValueError(f"summarization.jsonl has only {len(out)} SummEval articles")
    return "\n\n".join(out)


# -- llama-perplexity's arithmetic ------------------------------------------------------------------

def chunks(tokens: Sequence[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """The chunks llama-perplexity evaluates: ``len(tokens) // n_ctx`` runs of ``n_ctx`` tokens,
    the first token of each replaced by ``bos`` when the vocabulary adds BOS (``bos`` not None)."""
    out = []
    for i in range(len(tokens) // n_ctx):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def first_scored(n_ctx: int) -> int:
    """llama-perplexity's ``first``: logits are taken after positions ``first .. n_ctx - 1``."""
    return n_ctx // 2


def logits_wanted(n_ctx: int) -> int:
    """Logit rows a chunk's pass returns (positions ``first .. n_ctx - 1``, as llama.cpp asks)."""
    return n_ctx - first_scored(n_ctx)


def targets(chunk: Sequence[int]) -> list[int]:
    """The tokens a chunk scores: at positions ``first + 1 .. n_ctx - 1`` (``n_ctx - first - 1``)."""
    return list(chunk[first_scored(len(chunk)) + 1 :])


def scored_log_probs(log_probs: torch.Tensor, chunk: Sequence[int]) -> torch.Tensor:
    """Each scored token's log-probability (float64), from the chunk's log-softmax rows
    (``[logits_wanted, vocab]``; the last row, after the chunk's last token, is not used)."""
    wanted = targets(chunk)
    rows = log_probs[: len(wanted)]
    return rows.gather(1, torch.tensor(wanted, dtype=torch.long)[:, None])[:, 0].double()


def perplexity(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float | None]:
    """PPL and its +/- as llama-perplexity prints them: exp(mean NLL), and the standard error of
    the mean NLL times PPL (None where the variance is not positive)."""
    mean = nll_sum / count
    ppl = math.exp(mean)
    variance = nll2_sum / count - mean * mean
    return ppl, (math.sqrt(variance / (count - 1)) * ppl if variance > 0 and count > 1 else None)


def kl_rows(base: torch.Tensor, other: torch.Tensor, block: int = 32, above: float | None = None) -> torch.Tensor:
    """KL(base || other) per row of two log-softmax tensors ``[rows, vocab]`` (float64, in blocks
    of rows so that a 262k-token vocabulary stays small). ``above``: only the tokens whose base
    log-probability is above it count, as ``llama-perplexity --kl-divergence`` sums (-16)."""
    out = []
    for start in range(0, base.shape[0], block):
        p = base[start : start + block].double()
        q = other[start : start + block].double()
        terms = p.exp() * (p - q)
        if above is not None:
            terms = torch.where(p > above, terms, torch.zeros_like(terms))
        out.append(terms.sum(dim=1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


# -- llama-perplexity's log-probability file (``--kl-divergence-base``) ---------------------------

LOGITS_MAGIC = b"_logits_"


def logits_file_header(n_ctx: int, vocab: int, tokens: Sequence[int]) -> bytes:
    """The head of the file ``llama-perplexity --kl-divergence-base FILE`` saves and
    ``--kl-divergence`` reads (tools/perplexity/perplexity.cpp): "_logits_", n_ctx (uint32),
    the vocabulary and the chunk count (int32), then the chunks' tokens as the text gave them
    (int32; llama.cpp puts BOS in front of each chunk itself)."""
    n_chunk = len(tokens) // n_ctx
    head = LOGITS_MAGIC + struct.pack("<Iii", n_ctx, vocab, n_chunk)
    return head + struct.pack(f"<{n_chunk * n_ctx}i", *tokens[: n_chunk * n_ctx])


def log_prob_rows(log_probs: torch.Tensor) -> torch.Tensor:
    """Log-softmax rows ``[rows, vocab]`` as llama-perplexity stores them, int16-coded: per row
    the scale and the lowest log-probability kept (two float32: 4 uint16), then each token's
    ``round((lp - lowest) / scale)`` as uint16 (0 at or below the lowest, which is at most 16
    below the top), the row padded to an even count. Returned as an int16 tensor of the same
    bytes ``[rows, 2 * ceil(vocab / 2) + 4]``."""
    rows, vocab = log_probs.shape
    lp = log_probs.float()
    top = lp.max(dim=1).values
    lowest = torch.maximum(lp.min(dim=1).values, top - 16)
    scale = (top - lowest) / 65535.0
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    coded = torch.where(lp > lowest[:, None], torch.round(inverse[:, None] * (lp - lowest[:, None])),
                        torch.zeros_like(lp))
    out = torch.zeros(rows, 2 * ((vocab + 1) // 2) + 4, dtype=torch.int32)
    out[:, 4 : 4 + vocab] = coded.to(torch.int32)
    words = torch.stack([scale, lowest], dim=1).contiguous().view(torch.int32)  # [rows, 2] float32 bits
    out[:, 0] = words[:, 0] & 0xFFFF
    out[:, 1] = (words[:, 0] >> 16) & 0xFFFF
    out[:, 2] = words[:, 1] & 0xFFFF
    out[:, 3] = (words[:, 1] >> 16) & 0xFFFF
    return out.to(torch.int16)  # the low 16 bits: uint16 values in int16's bytes


def decode_log_prob_rows(coded: torch.Tensor, vocab: int) -> torch.Tensor:
    """The log-probabilities llama-perplexity reads back from :func:`log_prob_rows`' rows."""
    words = coded[:, :4].to(torch.int32) & 0xFFFF
    bits = torch.stack([words[:, 0] | (words[:, 1] << 16), words[:, 2] | (words[:, 3] << 16)], dim=1)
    scale, lowest = bits.contiguous().view(torch.float32).unbind(1)
    values = (coded[:, 4 : 4 + vocab].to(torch.int32) & 0xFFFF).float()
    return scale[:, None] * values + lowest[:, None]


def chunk_nlls(running: Sequence[float], per_chunk: int) -> list[float]:
    """Each chunk's mean NLL per scored token, from the running PPL after each chunk (llama.cpp's
    ``[i]x.xxxx``, printed to 4 decimals: the differences carry that rounding)."""
    totals = [math.log(p) * (i + 1) * per_chunk for i, p in enumerate(running)]
    return [(total - (totals[i - 1] if i else 0.0)) / per_chunk for i, total in enumerate(totals)]


def paired(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float] | None:
    """The mean over chunks of the per-token NLL difference, ours - theirs, and its standard error
    over the chunks (the same tokens on both sides: the text's own spread cancels)."""
    diffs = [a - b for a, b in zip(ours, theirs)]
    if len(diffs) < 2:
        return None
    mean = sum(diffs) / len(diffs)
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    return {"mean_nll_difference": mean, "standard_error": spread, "chunks": len(diffs)}


@dataclass
class Tally:
    """Running sums of one system's scored tokens, per chunk as llama.cpp prints them."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    running: list[float] = field(default_factory=list)  # PPL after each chunk (llama.cpp's [i]x.xxxx)

    def add(self, log_probs: torch.Tensor) -> None:
        nll = -log_probs.double()
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += nll.numel()
        self.running.append(math.exp(self.nll / self.count))

    def result(self) -> dict[str, Any]:
        ppl, plus_minus = perplexity(self.nll, self.nll2, self.count)
        return {"ppl": ppl, "plus_minus": plus_minus, "mean_nll": self.nll / self.count, "scored": self.count,
                "running_ppl": self.running}


def score(chunk_list: Sequence[Sequence[int]], systems: dict[str, Callable[[list[int]], torch.Tensor]],
          base: str | None = None, progress: Callable[[int, dict[str, Tally]], None] | None = None,
          base_file: BinaryIO | None = None) -> dict[str, Any]:
    """Each system's PPL over the chunks; ``systems`` maps a name to a function returning a chunk's
    logits ``[logits_wanted, vocab]``. With ``base``: every other system's mean KL(base || it) over
    the scored positions, and how often its top token is the base's. With ``base_file`` too: the
    base's rows are written to it as llama-perplexity stores them (after :func:`logits_file_header`),
    and each other system's KL is also taken from those stored rows as llama.cpp takes its own
    (``llama_way``), so that llama.cpp's KL from the same base compares like with like."""
    tallies = {name: Tally() for name in systems}
    kl: dict[str, dict[str, Any]] = {name: {"sum": 0.0, "max": 0.0, "same_top": 0, "per_chunk": [], "llama_way": 0.0,
                                            "llama_way2": 0.0}
                                     for name in systems if name != base}
    for index, chunk in enumerate(chunk_list):
        scored = len(targets(chunk))
        rows: dict[str, torch.Tensor] = {}
        for name, logits_of in systems.items():
            log_probs = torch.log_softmax(logits_of(list(chunk))[:scored].float(), dim=-1)
            tallies[name].add(scored_log_probs(log_probs, chunk))
            if base is not None:
                rows[name] = log_probs
            del log_probs
        stored = None
        if base is not None and base_file is not None:
            coded = log_prob_rows(rows[base])
            base_file.write(coded.numpy().tobytes())
            stored = decode_log_prob_rows(coded, rows[base].shape[1])
        if base is not None:
            for name, entry in kl.items():
                if stored is not None:
                    as_llama = kl_rows(stored, rows[name], above=-16)
                    entry["llama_way"] += float(as_llama.sum())
                    entry["llama_way2"] += float((as_llama * as_llama).sum())
                divergence = kl_rows(rows[base], rows[name])
                entry["sum"] += float(divergence.sum())
                entry["max"] = max(entry["max"], float(divergence.max()))
                entry["per_chunk"].append(float(divergence.mean()))
                entry["same_top"] += int((rows[base].argmax(1) == rows[name].argmax(1)).sum())
        rows.clear()
        if progress is not None:
            progress(index, tallies)
    out: dict[str, Any] = {"systems": {name: t.result() for name, t in tallies.items()}}
    if base is not None:
        count = next(iter(tallies.values())).count
        out["kl"] = {name: {"from": base, "mean": e["sum"] / count, "max": e["max"], "same_top": e["same_top"] / count,
                            "per_chunk": e["per_chunk"]} for name, e in kl.items()}
        if base_file is not None:
            for name, e in kl.items():
                mean = e["llama_way"] / count
                spread = max(e["llama_way2"] / count - mean * mean, 0.0)
                out["kl"][name]["mean_llama_way"] = mean
                out["kl"][name]["mean_llama_way_error"] = math.sqrt(spread / (count - 1)) if count > 1 else None
    return out


def forward_logits(forward: Any) -> Callable[[list[int]], torch.Tensor]:
    """A Parrot forward (``parrot.engine.backend.Forward``) as a chunk's logits: one pass over the
    chunk from an empty cache, the logits after its last ``logits_wanted`` tokens."""

    def logits(chunk: list[int]) -> torch.Tensor:
        cache = forward.new_cache(len(chunk))
        return forward.forward([(cache, chunk, logits_wanted(len(chunk)))])[0]

    return logits


# -- llama.cpp -------------------------------------------------------------------------------------

def llama_build(binary: str) -> dict[str, Any]:
    from loadtests.bench_peers import llama_build as build

    return build(binary)


def llama_token_count(binary: str, gguf: str, text_file: str, context: int, threads: int) -> dict[str, Any]:
    """How many tokens llama-perplexity makes of the text: run with a context of ``context``
    tokens and no chunks, it stops at once when the text has fewer than twice that and prints the
    count ("tokenizes to only T tokens"). ``tokens`` is None when it did not say."""
    from loadtests.peers import peer_env

    command = [binary, "-m", gguf, "-f", text_file, "-c", str(context), "-t", str(threads), "--chunks", "0"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=peer_env())
    found = re.search(r"tokenizes to only (\d+) tokens", done.stdout + done.stderr)
    return {"tokens": int(found.group(1)) if found else None, "command": " ".join(command)}


def run_llama_perplexity(binary: str, gguf: str, text_file: str, n_ctx: int, threads: int, chunk_limit: int = 0,
                         log: Path | None = None) -> dict[str, Any]:
    """``llama-perplexity -m GGUF -f TEXT -c n_ctx -t threads`` (``--chunks N`` with a limit): its
    final PPL and +/-, chunk count and the running PPL it prints after each chunk."""
    from loadtests.peers import peer_env

    command = [binary, "-m", gguf, "-f", text_file, "-c", str(n_ctx), "-t", str(threads)]
    if chunk_limit:
        command += ["--chunks", str(chunk_limit)]
    begin = time.perf_counter()
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=peer_env())
    output = done.stdout + done.stderr
    if log is not None:
        log.write_text(output)
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
    chunk_count = re.search(r"calculating perplexity over (\d+) chunks", output)
    running = [float(v) for v in re.findall(r"\[\d+\]([0-9.]+(?:e[+-]?\d+)?|nan|inf),", output)]
    return {"ppl": float(final.group(1)) if final else (running[-1] if running else None),
            "plus_minus": float(final.group(2)) if final else None,
            "chunks": int(chunk_count.group(1)) if chunk_count else None, "running_ppl": running,
            "returncode": done.returncode, "seconds": time.perf_counter() - begin, "command": " ".join(command),
            "tail": output[-1500:] if done.returncode or not final else None}


def run_llama_kl(binary: str, gguf: str, base_file: str, n_ctx: int, threads: int,
                 log: Path | None = None) -> dict[str, Any]:
    """``llama-perplexity --kl-divergence-base FILE --kl-divergence``: llama.cpp's next-token
    distributions against the base stored in FILE (Parrot float32's, :func:`log_prob_rows`) on
    the chunks' tokens stored there; what it prints at the end, parsed."""
    from loadtests.peers import peer_env

    command = [binary, "-m", gguf, "-c", str(n_ctx), "-t", str(threads), "--kl-divergence-base", base_file,
               "--kl-divergence"]
    begin = time.perf_counter()
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=peer_env())
    output = done.stdout + done.stderr
    if log is not None:
        log.write_text(output)

    def value(label: str) -> tuple[float | None, float | None]:
        found = re.search(re.escape(label) + r"\s*:\s*([-0-9.]+)\s*±\s*([-0-9.]+)", output)
        return (float(found.group(1)), float(found.group(2))) if found else (None, None)

    kld, kld_error = value("Mean    KLD")
    ratio, ratio_error = value("Mean PPL(Q)/PPL(base)")
    log_ratio, log_ratio_error = value("Mean ln(PPL(Q)/PPL(base))")
    same = re.search(r"Same top p:\s*([0-9.]+)", output)
    return {"mean_kl": kld, "mean_kl_error": kld_error, "ppl_ratio": ratio, "ppl_ratio_error": ratio_error,
            "log_ppl_ratio": log_ratio, "log_ppl_ratio_error": log_ratio_error,
            "same_top": float(same.group(1)) / 100 if same else None, "returncode": done.returncode,
            "seconds": time.perf_counter() - begin, "command": " ".join(command),
            "tail": output[-1500:] if done.returncode or kld is None else None}


# -- Parrot ----------------------------------------------------------------------------------------

def load_parrot(gguf: str, activations: str) -> Any:
    from parrot.config import ModelConfig
    from parrot.engine.loader import load_model

    return load_model(ModelConfig(source=gguf, activations=activations))


def tokenize(tokenizer: Any, text: str) -> dict[str, Any]:
    """Parrot's tokens of the text as llama-perplexity makes them (the vocabulary's BOS in front
    when it adds one), whether it adds BOS, and any special token inside the text's tokens
    (llama.cpp does not parse special tokens in the text: one there would tokenize differently)."""
    with_special = tokenizer.encode(text, add_special_tokens=True)
    plain = tokenizer.encode(text, add_special_tokens=False)
    add_bos = len(with_special) == len(plain) + 1 and with_special[1:] == plain
    if with_special != plain and not add_bos:
        raise ValueError("the vocabulary adds tokens other than one BOS in front (llama-perplexity wants no EOS)")
    hf = tokenizer.hf
    specials = set(getattr(hf, "all_special_ids", ()) or ())
    specials |= {i for i, t in (getattr(hf, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", False)}
    return {"tokens": with_special, "add_bos": add_bos, "bos": with_special[0] if add_bos else None,
            "specials_in_text": sorted({t for t in plain if t in specials})}


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {flag: flag in flags for flag in ("avx512f", "avx2")}


def model_label(model: str | None) -> str:
    if not model:
        return "embedded"
    from loadtests.real_models import MODELS

    return model if model in MODELS else Path(model).stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", "--gguf", dest="model", default=None,
                        help="a GGUF file or a real model's name (loadtests/real_models.py); default: the embedded model")
    parser.add_argument("--llama-perplexity", default=os.environ.get("LLAMA_PERPLEXITY") or None,
                        help="llama.cpp's llama-perplexity binary (default: $LLAMA_PERPLEXITY; none: skip llama.cpp)")
    parser.add_argument("--ctx", type=int, default=512, help="chunk length (llama-perplexity -c)")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity -t")
    parser.add_argument("--articles", type=int, default=ARTICLES, help="SummEval articles in the text")
    parser.add_argument("--chunks", type=int, default=0, help="score only the first N chunks (0: all; a quick look)")
    parser.add_argument("--kernels", default=None, help="Parrot's kernel set (PARROT_KERNELS; default: the best this CPU runs)")
    parser.add_argument("--out", default=None, help="default: loadtests/results/numerics_<model>.json")
    args = parser.parse_args(argv)
    if args.kernels:
        os.environ["PARROT_KERNELS"] = args.kernels
    if args.ctx < 4 or args.ctx % 2:
        parser.error("--ctx must be an even number >= 4")

    from parrot.engine.kernels import cpu_description, kernels
    from parrot.engine.source import resolve_source

    from loadtests.bench_engine import machine
    from loadtests.real_models import resolve

    label = model_label(args.model)
    out_path = Path(args.out or RESULTS / f"numerics_{label}.json")
    source = resolve_source(resolve(args.model) if args.model else "embedded")
    gguf = os.path.join(source.path, source.gguf_file or "")
    if not source.gguf_file:
        raise SystemExit(f"{args.model}: not a GGUF (llama.cpp reads only GGUFs)")
    chosen = kernels()
    text = fixed_text(args.articles)
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "cpu": cpu_description(), "cpu_flags": cpu_flags(),
        "kernel_set": chosen.isa if chosen else None, "model": label, "gguf": gguf, "gguf_bytes": os.path.getsize(gguf),
        "command": " ".join([os.path.basename(sys.executable), "-m", "loadtests.perplexity", *(argv or sys.argv[1:])]),
        "text": {"source": f"the first {args.articles} SummEval articles (CNN/DailyMail test split) of "
                           "../shared/data/summarization.jsonl, each its row's prompt after the instruction line, "
                           "in file order, joined by blank lines",
                 "articles": args.articles, "characters": len(text),
                 "sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text},
    }
    print(f"CPU: {info['cpu']}; Parrot kernels: {info['kernel_set']}; GGUF {gguf} ({info['gguf_bytes'] / 1e6:.0f} MB)",
          flush=True)

    # Parrot: both activation modes loaded side by side, each chunk through both, so that the KL
    # divergence is over the same positions without keeping any chunk's logits.
    loaded = {"q8": load_parrot(gguf, "q8")}
    if loaded["q8"].details.get("activations") is None:
        note = (f"the {loaded['q8'].backend} backend has no activation modes: "
                "model.activations does not apply, q8 and float32 are the same forward")
        loaded["float32"] = loaded["q8"]
    else:
        note = None
        loaded["float32"] = load_parrot(gguf, "float32")
    tokenizer = loaded["q8"].tokenizer
    tokens = tokenize(tokenizer, text)
    chunk_list = chunks(tokens["tokens"], args.ctx, tokens["bos"])
    if args.chunks:
        chunk_list = chunk_list[: args.chunks]
    if not chunk_list:
        raise SystemExit(f"the text gives {len(tokens['tokens'])} tokens: fewer than one chunk of {args.ctx}")
    from parrot.gguf_file import GGUFFile

    header = GGUFFile(gguf)
    info["tokens"] = {"parrot": len(tokens["tokens"]), "add_bos": tokens["add_bos"], "bos": tokens["bos"],
                      "gguf_add_bos_token": header.get("tokenizer.ggml.add_bos_token"),
                      "gguf_vocabulary": len(header.get("tokenizer.ggml.tokens", [])),
                      "specials_in_text": tokens["specials_in_text"]}
    info.update(n_ctx=args.ctx, first=first_scored(args.ctx), chunks=len(chunk_list),
                scored=len(chunk_list) * len(targets(chunk_list[0])))
    info["parrot"] = {mode: {"backend": m.backend, "details": m.details, "vocab_size": m.forward.vocab_size,
                             "load_seconds": m.load_seconds} for mode, m in loaded.items()}
    info["parrot_note"] = note
    print(f"text: {len(text):,} characters, {len(tokens['tokens']):,} tokens (BOS added: {tokens['add_bos']}); "
          f"{len(chunk_list)} chunks of {args.ctx}, {info['scored']:,} tokens scored; "
          f"Parrot backend {loaded['q8'].backend}" + (f" ({note})" if note else ""), flush=True)
    if tokens["specials_in_text"]:
        print(f"  warning: special tokens inside the text's tokens: {tokens['specials_in_text']}")

    # With llama-perplexity: Parrot float32's scored rows go to a file in its log-probability
    # format, for llama.cpp's KL from the same base (2 bytes per token per row: 2.2 GB for the
    # 1.5B's 29 chunks; deleted after).
    binary = args.llama_perplexity
    info["llama_cpp_skipped"] = None if binary else "no LLAMA_PERPLEXITY given"
    if binary and not os.path.isfile(binary):
        info["llama_cpp_skipped"] = f"no llama-perplexity at {binary}"
        print(f"llama-perplexity not found at {binary}: the llama.cpp column is skipped")
        binary = None
    base_path = None
    if binary and not note and loaded["float32"].forward.vocab_size == info["tokens"]["gguf_vocabulary"]:
        handle, base_path = tempfile.mkstemp(prefix="parrot-float32-", suffix=".logits")
        os.close(handle)
    base_file = open(base_path, "wb") if base_path else None  # noqa: SIM115 (closed after scoring, or unlinked)
    if base_file is not None:
        base_file.write(logits_file_header(args.ctx, loaded["float32"].forward.vocab_size,
                                           tokens["tokens"][: len(chunk_list) * args.ctx]))
    begin = time.perf_counter()

    def progress(index: int, tallies: dict[str, Tally]) -> None:
        print(f"  [{index + 1}/{len(chunk_list)}] " + ", ".join(f"{n} {t.running[-1]:.4f}" for n, t in tallies.items())
              + f" ({time.perf_counter() - begin:.0f} s)", flush=True)

    if note:
        scored = score(chunk_list, {"parrot_q8": forward_logits(loaded["q8"].forward)}, progress=progress)
        scored["systems"]["parrot_float32"] = scored["systems"]["parrot_q8"]
        scored["kl"] = {"parrot_q8": {"from": "parrot_float32", "mean": 0.0, "max": 0.0, "same_top": 1.0,
                                      "per_chunk": [], "note": note}}
    else:
        try:
            scored = score(chunk_list, {"parrot_float32": forward_logits(loaded["float32"].forward),
                                        "parrot_q8": forward_logits(loaded["q8"].forward)},
                           base="parrot_float32", progress=progress, base_file=base_file)
        except BaseException:
            if base_path is not None:  # a stopped run does not leave gigabytes in the temporary directory
                base_file.close()
                os.unlink(base_path)
            raise
    if base_file is not None:
        base_file.close()
    parrot_seconds = time.perf_counter() - begin
    systems = scored["systems"]
    del loaded

    # llama.cpp on the same file and text.
    llama: dict[str, Any] | None = None
    if binary:
        # The text as a file beside the results (not committed: the JSON holds it), so that the
        # command line recorded can be run again as it is.
        text_file = str(RESULTS / "numerics_text.txt")
        with open(text_file, "w", encoding="utf-8") as f:
            f.write(text)
        count = llama_token_count(binary, gguf, text_file, len(tokens["tokens"]), args.threads)
        print(f"llama.cpp tokens: {count['tokens']} (Parrot {len(tokens['tokens'])}); running llama-perplexity",
              flush=True)
        llama = run_llama_perplexity(binary, gguf, text_file, args.ctx, args.threads, args.chunks,
                                     log=RESULTS / f"numerics_{label}_llama.log")
        llama.update(build=llama_build(binary), tokens=count["tokens"], token_count_command=count["command"])
        if base_path is not None:
            print("running llama-perplexity --kl-divergence against Parrot float32's stored rows", flush=True)
            try:
                llama["kl_from_parrot_float32"] = run_llama_kl(binary, gguf, base_path, args.ctx, args.threads,
                                                               log=RESULTS / f"numerics_{label}_llama_kl.log")
            finally:
                os.unlink(base_path)
        info["tokens"]["llama_cpp"] = count["tokens"]
        info["tokens"]["agree"] = count["tokens"] == len(tokens["tokens"])
        if llama["ppl"] is not None:
            systems["llama_cpp"] = {"ppl": llama["ppl"], "plus_minus": llama["plus_minus"],
                                    "scored": llama["chunks"] * len(targets(chunk_list[0])) if llama["chunks"] else None,
                                    "running_ppl": llama["running_ppl"]}
    info["llama_cpp"] = llama
    base_ppl = systems["parrot_float32"]["ppl"]
    for entry in systems.values():
        entry["ratio_to_float32"] = entry["ppl"] / base_ppl
    if "llama_cpp" in systems:
        per_chunk = len(targets(chunk_list[0]))
        info["paired_q8_minus_llama_cpp"] = paired(chunk_nlls(systems["parrot_q8"]["running_ppl"], per_chunk),
                                                   chunk_nlls(systems["llama_cpp"]["running_ppl"], per_chunk))
    result = {**info, "finished": time.strftime("%Y-%m-%d %H:%M"), "systems": systems, "kl": scored["kl"],
              "parrot_seconds": parrot_seconds}
    out_path.write_text(json.dumps(result, indent=1))
    print(render(result))
    print(f"wrote {out_path}")
    return 0


def render(result: dict[str, Any]) -> str:
    systems, tokens = result["systems"], result["tokens"]
    names = {"parrot_float32": "Parrot, float32 activations", "parrot_q8": "Parrot, q8 activations (default)",
             "llama_cpp": "llama.cpp llama-perplexity"}
    lines = [f"{result['model']} ({os.path.basename(result['gguf'])}); CPU: {result['cpu']}; {result['date']}",
             f"text: {result['text']['articles']} SummEval articles, {result['text']['characters']:,} characters; "
             f"tokens: Parrot {tokens['parrot']:,}"
             + (f", llama.cpp {tokens['llama_cpp']:,}" if tokens.get("llama_cpp") is not None else
                (", llama.cpp did not say" if result.get("llama_cpp") else ""))
             + f"; {result['chunks']} chunks of {result['n_ctx']}, {result['scored']:,} tokens scored"
             + (" (BOS first in each chunk)" if tokens["add_bos"] else ""), "",
             "| system | PPL | +/- | / float32 |", "|---|---:|---:|---:|"]
    if result.get("parrot_note"):
        names["parrot_q8"] += f" = float32: {result['parrot']['q8']['backend']} backend"
    for key, label in names.items():
        if key in systems:
            s = systems[key]
            pm = f"{s['plus_minus']:.4f}" if s.get("plus_minus") is not None else "—"
            lines.append(f"| {label} | {s['ppl']:.4f} | {pm} | {s['ratio_to_float32']:.4f}x |")
    if "llama_cpp" not in systems:
        why = (result.get("llama_cpp_skipped") or "no LLAMA_PERPLEXITY given" if result.get("llama_cpp") is None
               else f"llama-perplexity failed (exit {result['llama_cpp']['returncode']})")
        lines.append(f"| llama.cpp llama-perplexity | skipped: {why} | | |")
    if "llama_cpp" in systems:
        ours, theirs = systems["parrot_q8"]["ratio_to_float32"], systems["llama_cpp"]["ratio_to_float32"]
        lines.append(f"Parrot q8 / Parrot float32 {ours:.4f}x against llama.cpp / Parrot float32 {theirs:.4f}x: "
                     + ("at or below llama.cpp's" if ours <= theirs else "ABOVE llama.cpp's"))
        pair = result.get("paired_q8_minus_llama_cpp")
        if pair:
            lines.append(f"Per chunk, Parrot q8's mean NLL - llama.cpp's (from its running PPLs): "
                         f"{pair['mean_nll_difference']:+.5f} +/- {pair['standard_error']:.5f} nats per token "
                         f"over {pair['chunks']} chunks")
    kl = result["kl"]["parrot_q8"]
    lines += ["", f"KL(Parrot float32 || Parrot q8), mean over the scored tokens: {kl['mean']:.6f} "
                  f"(max {kl['max']:.4f}); same top token {100 * kl['same_top']:.2f}%"
                  + (f" ({kl['note']})" if kl.get("note") else "")]
    theirs_kl = (result.get("llama_cpp") or {}).get("kl_from_parrot_float32")
    if theirs_kl and theirs_kl.get("mean_kl") is not None and kl.get("mean_llama_way") is not None:
        error = kl.get("mean_llama_way_error") or 0.0
        ratio = f"{systems['llama_cpp']['ratio_to_float32']:.4f}x" if "llama_cpp" in systems else "—"
        lines += ["", ("Divergence from Parrot float32, both taken as llama-perplexity --kl-divergence takes it "
                       "(from float32's stored 16-bit rows, over the tokens whose log-probability there is above -16):"),
                  "| system | mean KL | same top token | PPL / Parrot float32 (above) |", "|---|---:|---:|---:|",
                  (f"| Parrot q8 | {kl['mean_llama_way']:.6f} +/- {error:.6f} | {100 * kl['same_top']:.2f}% | "
                   f"{systems['parrot_q8']['ratio_to_float32']:.4f}x |"),
                  (f"| llama.cpp | {theirs_kl['mean_kl']:.6f} +/- {theirs_kl['mean_kl_error']:.6f} | "
                   f"{100 * (theirs_kl['same_top'] or 0):.2f}% | {ratio} |"),
                  "Parrot q8's divergence " + ("at or below" if kl["mean_llama_way"] <= theirs_kl["mean_kl"] else "ABOVE")
                  + " llama.cpp's. (llama.cpp's own PPL(Q)/PPL(base) there reads the base's clipped 16-bit rows, "
                  "so the ratio above is taken from the plain runs.)"]
    elif theirs_kl:
        lines.append(f"llama.cpp's KL run gave no result (exit {theirs_kl['returncode']}): {theirs_kl['command']}")
    backend = result["parrot"]["q8"]
    lines.append(f"Parrot backend: {backend['backend']} ({backend['details'].get('summary', '')})")
    if result.get("llama_cpp"):
        lines.append(f"llama.cpp: {result['llama_cpp']['command']}")
        if tokens.get("agree") is False:
            lines.append(f"TOKEN COUNTS DIFFER: Parrot {tokens['parrot']}, llama.cpp {tokens.get('llama_cpp')}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
