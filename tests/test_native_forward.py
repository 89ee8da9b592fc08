"""The whole decoding pass in one kernel call (csrc/model.h, ``parrot_forward``), on the tiny
model with its weights quantised to GGUF blocks, for every kernel set this CPU runs.

Properties: a token's logits do not depend on the draft fed with it, nor on the other sequences
in the pass (the exactness of greedy drafting rests on this); the logits follow transformers'
float32 forward of the same (de-quantised) weights to float32 rounding; greedy decoding with
drafting equals greedy decoding without, with drafts accepted.
"""

from __future__ import annotations

import pytest
import torch

from parrot.config import DraftingConfig
from parrot.engine.engine import Engine, GenerationRequest
from parrot.engine.kernels import available_isas
from parrot.engine.llama import LlamaForward
from parrot.engine.quant import BlockWeight
from parrot.engine.sampling import SamplingParams
from tests.tiny import TinyTokenizer, tiny_hf_model

each_isa = pytest.mark.parametrize("isa", available_isas())
each_activations = pytest.mark.parametrize("activations", ["q8", "float32"])


def _q4_1(weight: torch.Tensor) -> BlockWeight:
    """Round-to-nearest Q4_1 of a float32 matrix (blocks of 32 along its rows)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // 32, 32)
    low, high = blocks.min(-1).values, blocks.max(-1).values
    d = ((high - low) / 15).half().float().clamp_min(1e-4)
    m = low.half().float()
    q = ((blocks - m[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.uint8)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2).contiguous()
    return BlockWeight.pack("q4_1", qs, d, m)


def quantized_tiny_model(seed: int = 5):
    """The tiny model with every linear weight replaced by its Q4_1 de-quantisation, and the blocks."""
    model = tiny_hf_model(seed)
    blocks = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name:
                blocks[name] = _q4_1(parameter.data)
                parameter.copy_(blocks[name].dequantize())
    return model, blocks


@pytest.fixture(scope="module")
def quantized():
    return quantized_tiny_model()


def _prompt(length: int, seed: int = 5) -> list[int]:
    return torch.randint(1, 64, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@each_isa
def test_the_whole_pass_runs_in_the_kernels(quantized, isa):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa)
    assert forward.native is not None and forward.kernels is not None and forward.kernels.isa == isa
    # The 8-bit path caches keys and values in float16 (as llama.cpp does); float32 activations
    # keep a float32 cache.
    assert forward.new_cache(8).k.dtype == torch.float16
    assert LlamaForward(model, 512, blocks, isa=isa, activations="float32").new_cache(8).k.dtype == torch.float32


@each_isa
@each_activations
def test_logits_of_a_token_do_not_depend_on_its_draft_or_on_other_sequences(quantized, isa, activations):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa, activations=activations)
    prompt, other = _prompt(300), _prompt(40, seed=6)
    verify, plain, neighbour = forward.new_cache(400), forward.new_cache(400), forward.new_cache(100)
    for cache in (verify, plain):
        forward.forward([(cache, prompt[:290], 1)])
    forward.forward([(neighbour, other[:30], 1)])
    # the draft pass shares its kernel call with another sequence feeding 3 tokens
    together, _ = forward.forward([(verify, prompt[290:298], 8), (neighbour, other[30:33], 3)])
    for i, token in enumerate(prompt[290:298]):
        assert torch.equal(forward.forward([(plain, [token], 1)])[0][0], together[i])


@each_isa
@each_activations
def test_rows_without_logits_fill_the_cache_as_rows_with_them(quantized, isa, activations):
    # A prompt chunk asks for the logits of its last rows only (or none, before a prompt's last
    # chunk), and the last layer then runs attention and the MLP for those rows alone: the caches
    # and the logits asked for must be what a pass asking for every row's logits gives.
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa, activations=activations)
    prompts = [_prompt(120), _prompt(40, seed=6), _prompt(70, seed=7)]
    every = [forward.new_cache(200) for _ in prompts]
    full = [forward.forward([(cache, prompt, len(prompt))])[0] for cache, prompt in zip(every, prompts)]
    few = [forward.new_cache(200) for _ in prompts]
    logits = forward.forward([(few[0], prompts[0], 3), (few[1], prompts[1], 0), (few[2], prompts[2], 1)])
    assert torch.equal(logits[0], full[0][-3:]) and logits[1].shape[0] == 0 and torch.equal(logits[2], full[2][-1:])
    for a, b, prompt in zip(every, few, prompts):
        assert a.length == b.length == len(prompt)
        assert torch.equal(a.k[:, :, : a.length], b.k[:, :, : b.length])
        assert torch.equal(a.v[:, :, : a.length], b.v[:, :, : b.length])
        assert torch.equal(forward.forward([(a, [9], 1)])[0], forward.forward([(b, [9], 1)])[0])


@each_isa
@pytest.mark.parametrize("activations, atol", [("float32", 5e-4), ("q8", 3.0)])
def test_logits_follow_transformers_float32(quantized, isa, activations, atol):
    # float32 inputs: float32 rounding. q8 rounds each layer's input to 8 bits per 32 values
    # (up to 1/254 of the unit's largest value), as llama.cpp does: the logits of this random
    # model (up to ~30) move by up to ~1.5 (the embedded model's by 1.2 of 37). That each q8
    # linear layer is exact given its rounded input is tested in test_quant.py.
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa, activations=activations)
    prompt = _prompt(300)
    cache = forward.new_cache(400)
    forward.forward([(cache, prompt[:290], 1)])
    ours = forward.forward([(cache, prompt[290:298], 8)])[0]
    with torch.no_grad():
        reference = model(torch.tensor([prompt[:298]])).logits[0, 290:298]
    torch.testing.assert_close(ours, reference, atol=atol, rtol=1e-4)


@each_isa
@each_activations
def test_greedy_output_identical_with_and_without_drafting(quantized, isa, activations):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa, activations=activations)
    tokenizer = TinyTokenizer(64)
    cost = [0.0] + [1.0 + 0.02 * t for t in range(DraftingConfig().max_draft + 1)]
    drafting = Engine(forward, tokenizer, DraftingConfig(), cost)  # type: ignore[arg-type]
    plain = Engine(forward, tokenizer, DraftingConfig(enabled=False))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    without = plain.generate(GenerationRequest(_prompt(90), params))
    # The plain output, given as drafting context (as Predicted Outputs do), so that the drafter
    # proposes long runs that are right, mixed with wrong ones from the prompt.
    with_drafts = drafting.generate(GenerationRequest(_prompt(90), params, draft_context=[without.token_ids[:45]]))
    assert with_drafts.token_ids == without.token_ids
    assert with_drafts.stats.accepted_tokens > 0 and without.stats.drafted_tokens == 0
