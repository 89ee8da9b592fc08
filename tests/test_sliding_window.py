"""Models with sliding-window attention (Gemma 3's local layers) on the transformers forward:
a draft rejected after the window has filled is cropped back, and greedy output with drafting
equals plain greedy decoding, on a tiny random Gemma 3 whose window (8) every sequence outruns."""

from __future__ import annotations

import torch

from parrot.config import DraftingConfig
from parrot.engine.engine import Engine
from parrot.engine.hf_runner import HFForward
from parrot.engine.sampling import SamplingParams
from tests.test_engine import _corrupt, _generate, _prompt
from tests.tiny import TinyTokenizer

VOCAB = 64


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                              max_position_embeddings=256,
                              layer_types=["sliding_attention"] * 3 + ["full_attention"])
    return Gemma3ForCausalLM(config).eval()


def test_a_rejected_draft_is_cropped_after_the_window_filled():
    model = tiny_gemma3()
    tokens = torch.randint(1, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        whole = model(torch.tensor([tokens])).logits[0]
    forward = HFForward(model, 256)
    cache = forward.new_cache(64)
    rows = [forward.forward([(cache, tokens[:20], 20)])[0]]
    forward.forward([(cache, [1, 2, 3, 4, 5], 5)])  # a draft of 5, all rejected
    cache.crop(20)
    rows += [forward.forward([(cache, [t], 1)])[0] for t in tokens[20:]]
    torch.testing.assert_close(torch.cat(rows), whole, rtol=0, atol=1e-5)


def test_greedy_output_with_drafting_equals_plain_decoding_past_the_window():
    engine = Engine(HFForward(tiny_gemma3(), 256), TinyTokenizer(VOCAB), DraftingConfig(adaptive=False, max_draft=8),  # type: ignore[arg-type]
                    None)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    accepted = drafted = 0
    for seed in range(3):
        prompt = _prompt(seed)
        plain = _generate(engine, prompt, params, spec=False)
        spec = _generate(engine, prompt, params, context=[_corrupt(plain.token_ids, 5)])
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats.drafted_tokens
        accepted += spec.stats.accepted_tokens
    assert accepted > 30 and drafted > accepted  # drafts were made, accepted and rejected
