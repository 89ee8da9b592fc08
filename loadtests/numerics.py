"""Parrot's logits against transformers float32 over the same de-quantised GGUF weights.

A numerics check, not the exactness contract (that is drafting on = drafting off, which the
kernels guarantee bit for bit): Parrot's kernels add in other orders than transformers' GEMMs,
and with 8-bit activations (model.activations = q8, the default) round each layer's input to 8
bits per 32 values as llama.cpp does, so logits differ (float32: in their low bits; q8: by up to
about 1 on the embedded model) and greedy outputs can part where the two tokens are within that
difference. For each prompt: Parrot greedy with drafting (the engine as served) against
transformers greedy; the largest |logit difference| between Parrot's decoding passes and one
transformers forward over the same tokens; at the first divergence, transformers' gap between
the two tokens, a near-tie when it is at most twice that prompt's largest logit difference
(each logit moved by at most that much, so their gap by at most twice).

    python -m loadtests.numerics --per-task 2
    python -m loadtests.numerics --model gemma-3-270m-q4_k_m.gguf --completion --max-tokens 48

``--model``: another model (a GGUF is loaded onto the kernels as ``parrot serve`` loads it, and
transformers reads the same file for the reference); ``--completion``: prompts as plain
completions (the vocabulary's BOS, no chat template: for files without one).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from loadtests.bench_engine import DATA

TASKS = ["summarization", "context_qa", "grammar", "code_edit", "open_chat"]


def compare(prompts: list[str], max_tokens: int = 64, activations: str = "q8", model: str | None = None,
            completion: bool = False) -> dict[str, Any]:
    from parrot.config import DraftingConfig, ModelConfig
    from parrot.engine.costmodel import measure_cost_curve
    from parrot.engine.engine import Engine, GenerationRequest
    from parrot.engine.hf_loading import gguf_blocks, load_transformers
    from parrot.engine.loader import load_model, prepare
    from parrot.engine.sampling import SamplingParams

    config = ModelConfig() if model is None else ModelConfig(source=model, activations=activations)
    source, tokenizer, hf_model = load_transformers(config)
    if model is None:  # the embedded model: Parrot's forward over the same loaded weights
        loaded = prepare(hf_model, tokenizer, source.display_name, blocks=gguf_blocks(source, hf_model),
                         activations=activations)
    else:
        loaded = load_model(ModelConfig(source=model, backend="native", activations=activations))
    forward = loaded.forward
    drafting = DraftingConfig()
    engine = Engine(forward, tokenizer, drafting, measure_cost_curve(forward, drafting.max_draft + 1, repeats=3))
    rows = []
    for prompt in prompts:
        if completion:
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        ours = engine.generate(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens))).token_ids
        inputs = torch.tensor([ids])
        with torch.inference_mode():
            reference = hf_model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_tokens,
                                          do_sample=False)[0, len(ids):].tolist()
            # Logits of Parrot's one-token decoding passes over its own output, against one
            # transformers forward over the same tokens.
            full = ids + ours
            hf_logits = hf_model(torch.tensor([full])).logits[0, len(ids) - 1 : len(full) - 1]
            cache = forward.new_cache(len(full))
            parrot_logits = [forward.forward([(cache, ids, 1)])[0][0]]
            for token in ours[:-1]:
                parrot_logits.append(forward.forward([(cache, [token], 1)])[0][0])
            max_diff = float((torch.stack(parrot_logits) - hf_logits).abs().max()) if ours else 0.0
        row: dict[str, Any] = {"tokens": len(ours), "identical": ours == reference, "max_logit_diff": max_diff}
        if ours != reference:
            at = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
            if at is None:
                row.update(divergence=min(len(ours), len(reference)), gap=None, near_tie=False)
            else:
                with torch.inference_mode():
                    logits = hf_model(torch.tensor([ids + reference[:at]])).logits[0, -1]
                gap = abs(float(logits[reference[at]] - logits[ours[at]]))
                row.update(divergence=at, gap=gap, near_tie=gap <= 2 * max_diff)
        rows.append(row)
    diverged = [r for r in rows if not r["identical"]]
    return {
        "prompts": len(rows), "identical": len(rows) - len(diverged), "near_ties": sum(r["near_tie"] for r in diverged),
        "max_logit_diff": max(r["max_logit_diff"] for r in rows), "activations": activations,
        "divergence_gaps": [r["gap"] for r in diverged], "backend": loaded.details or loaded.backend, "rows": rows,
    }


def prompts_per_task(n: int) -> list[str]:
    out = []
    for task in TASKS:
        with open(DATA / f"{task}.jsonl") as f:
            out += [json.loads(line)["prompt"] for _, line in zip(range(n), f)]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--activations", default="q8", choices=("q8", "float32"))
    parser.add_argument("--model", help="a model other than the embedded one (a GGUF file, a directory)")
    parser.add_argument("--completion", action="store_true", help="plain completions, no chat template")
    parser.add_argument("--rows", action="store_true", help="print every prompt's row too")
    args = parser.parse_args(argv)
    result = compare(prompts_per_task(args.per_task), args.max_tokens, args.activations, args.model, args.completion)
    print(json.dumps({k: v for k, v in result.items() if args.rows or k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
