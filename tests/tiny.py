"""A tiny deterministic Llama model and tokenizer for fast engine tests.

The model is a real transformers ``LlamaForCausalLM`` (2 layers, hidden 64) with weights drawn
from a fixed seed, so both the native forward and the transformers fallback can run it. The
"tokenizer" maps token i to a short string; it has the interface the engine uses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from parrot.drafting import DraftSizer
from parrot.config import DraftingConfig
from parrot.engine.engine import Engine
from parrot.engine.hf_runner import HFForward
from parrot.engine.llama import LlamaForward

EOS = 0


class TinyTokenizer:
    """Token i decodes to letters: 1..26 -> 'a'..'z', others -> '<i>'; EOS (0) decodes to ''.
    Encoding reads letters only (enough for the HTTP routes to run on the tiny model), and a
    chat is its messages' contents, one after the other."""

    eos_token_ids = frozenset({EOS})

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.hf = self  # the routes ask ``tokenizer.hf`` for token strings (logprobs)

    def __len__(self) -> int:  # as transformers' tokenizers: the vocabulary's size
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:  # it has none to add
        return [ord(ch) - ord("a") + 1 for ch in text if "a" <= ch <= "z"]

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                    tools: object = None) -> list[int]:
        return [t for m in messages for t in self.encode(m["content"])]  # tools are not shown

    def convert_ids_to_tokens(self, token: int) -> str:
        return self.piece(token)

    def piece(self, token: int) -> str:
        if token == EOS:
            return ""
        return chr(ord("a") + token - 1) if token <= 26 else f"<{token}>"

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.piece(t) for t in ids)


def tiny_hf_model(seed: int = 0, vocab_size: int = 64, max_positions: int = 512, logit_scale: float = 4.0) -> LlamaForCausalLM:
    """A random 2-layer Llama. ``logit_scale`` sharpens the output so greedy ties are far apart."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.mul_(logit_scale)
    return model


def tiny_engine(
    backend: str = "native",
    drafting: DraftingConfig | None = None,
    cost: list[float] | None = None,
    seed: int = 0,
    vocab_size: int = 64,
    prefill_chunk: int = 512,
    logit_scale: float = 4.0,
    sizer: DraftSizer | None = None,
) -> Engine:
    """An engine over the tiny model. Adaptive drafting gets a flat synthetic cost curve."""
    model = tiny_hf_model(seed, vocab_size, logit_scale=logit_scale)
    forward = LlamaForward(model, 512) if backend == "native" else HFForward(model, 512)
    drafting = drafting or DraftingConfig()
    if cost is None and drafting.adaptive:
        cost = [0.0] + [1.0 + 0.02 * t for t in range(drafting.max_draft + 1)]
    return Engine(forward, TinyTokenizer(vocab_size), drafting, cost, prefill_chunk, sizer=sizer)  # type: ignore[arg-type]


class SlowForward:
    """A forward that sleeps ``delay_s`` before every pass, so that a request on the tiny model
    stays in flight long enough for a test to act while it runs (disconnect, fault, drain)."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def forward(self, batch: Any) -> Any:
        time.sleep(self.delay_s)
        return self.inner.forward(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def chi_square_below_quantile(expected: torch.Tensor, observed: torch.Tensor) -> tuple[float, float]:
    """(chi-square, its 1 - 1e-6 quantile), cells pooled smallest first to expect >= 5 each."""
    order = torch.argsort(expected)
    cells_e, cells_o, acc_e, acc_o = [], [], 0.0, 0.0
    for i in order.tolist():
        acc_e += float(expected[i])
        acc_o += float(observed[i])
        if acc_e >= 5:
            cells_e.append(acc_e)
            cells_o.append(acc_o)
            acc_e = acc_o = 0.0
    if acc_e:
        cells_e[-1] += acc_e
        cells_o[-1] += acc_o
    chi2 = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    dof = len(cells_e) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-6 (z = 4.75).
    return chi2, dof * (1 - 2 / (9 * dof) + 4.75 * math.sqrt(2 / (9 * dof))) ** 3


def sampled_pairs(generate: Any, vocab: int, n: int) -> torch.Tensor:
    """Counts [vocab, vocab] of the first two tokens of ``generate(seed)`` for seeds 0..n-1,
    asserting that drafts were made, some kept and some rejected (so a sampling test over them
    checks verification, not plain sampling)."""
    counts = torch.zeros(vocab, vocab)
    drafted = accepted = 0
    for seed in range(n):
        res = generate(seed)
        a, b = res.token_ids[:2]
        counts[a, b] += 1
        drafted += res.stats.drafted_tokens
        accepted += res.stats.accepted_tokens
    assert drafted > n and 0 < accepted < drafted
    return counts
