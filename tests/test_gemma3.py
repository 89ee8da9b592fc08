"""Gemma 3's text model on Parrot's own forward (llama.py's GEMMA3 row; csrc/model.h on the kernels).

What differs from Llama, each checked against transformers' ``Gemma3ForCausalLM`` over the same
weights: token rows times sqrt(hidden); RMSNorm by 1 + w (with random w here: transformers
initialises w to 0, which would hide a wrong convention), norms on attention's and the MLP's
outputs; q and k norms per head before RoPE; scores scaled by query_pre_attn_scalar ** -0.5
(24 here, not head_dim's 32); sliding-window layers (a window of 8, which every sequence here
outruns) with their own RoPE base beside global layers; GELU (tanh); the tied LM head.

A tiny random model (4 layers: local, local, global, local) on the torch path and on the compiled
pass, and a tiny synthetic Gemma 3 GGUF (``make_synthetic_gguf --arch gemma3 --params tiny``:
5 local layers and a global one, as llama.cpp and transformers lay out every Gemma 3 file) loaded
onto the kernels as ``parrot serve`` loads it. On the kernels, for every kernel set this CPU runs:
a token's logits do not depend on the draft fed with it, and greedy output with drafting equals
plain greedy decoding, with drafts accepted.
"""

from __future__ import annotations

import os

import pytest
import torch

from parrot.config import DraftingConfig, ModelConfig
from parrot.engine.engine import Engine, GenerationRequest
from parrot.engine.kernels import available_isas
from parrot.engine.llama import LlamaForward, RotaryTables, native_support
from parrot.engine.sampling import SamplingParams
from tests.test_native_forward import _q4_1
from tests.tiny import TinyTokenizer

VOCAB = 64
WINDOW = 8
each_isa = pytest.mark.parametrize("isa", available_isas())
each_activations = pytest.mark.parametrize("activations", ["q8", "float32"])


def tiny_gemma3(seed: int = 0, quantize: bool = False):
    """A random Gemma 3 (every weight, norms included, about N(0, 0.3)); ``quantize``: its
    matrices (the tied embedding too) replaced by their Q4_1 de-quantisation. Returns the model
    and the blocks by parameter name. A tied head over large random token rows predicts the
    current token again, and an output that repeats one token has no wrong drafts: small token
    rows (N(0, 0.02)) and a large final norm (1 + w about 5) make its greedy output varied."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                              sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-6,
                              layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"])
    model = Gemma3ForCausalLM(config).eval()
    blocks = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.02 if "embed_tokens" in name else 0.3)
            if name == "model.norm.weight":
                parameter.normal_(4.0, 1.0)
            if quantize and parameter.dim() == 2:
                name = "lm_head.weight" if "embed_tokens" in name else name  # tied: the head's blocks
                blocks[name] = _q4_1(parameter.data)
                parameter.copy_(blocks[name].dequantize())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, blocks


@pytest.fixture(scope="module")
def quantized():
    return tiny_gemma3(quantize=True)


def _tokens(length: int, seed: int = 1) -> list[int]:
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _reference(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


def _prefill_crop_decode(forward, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of ``tokens`` (60) as the engine feeds them: a 40-token prompt
    chunk (longer than the window and than the kernels' few-row paths), a 5-token draft that is
    rejected and cropped, a 4-token verifying pass, then one token at a time."""
    cache = forward.new_cache(64)
    rows = [forward.forward([(cache, tokens[:40], 40)])[0]]
    forward.forward([(cache, [1, 2, 3, 4, 5], 5)])
    cache.crop(40)
    rows.append(forward.forward([(cache, tokens[40:44], 4)])[0])
    rows += [forward.forward([(cache, [t], 1)])[0] for t in tokens[44:]]
    return torch.cat(rows)


def _without_window(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits with the sliding layers seeing everything (their RoPE unchanged)."""
    saved = model.config.sliding_window
    model.config.sliding_window = 4096
    try:
        return _reference(model, tokens)
    finally:
        model.config.sliding_window = saved


@pytest.mark.parametrize("kernels", ["attention kernel for few rows", "no kernels (SDPA)"])
def test_torch_path_logits_follow_transformers_past_the_window_and_after_a_crop(kernels, monkeypatch):
    if kernels.startswith("no"):
        monkeypatch.setenv("PARROT_KERNELS", "0")
    model, _ = tiny_gemma3()
    forward = LlamaForward(model, 256)
    assert forward.native is None and (forward.attention_kernel is None) == kernels.startswith("no")
    tokens = _tokens(60)
    ours = _prefill_crop_decode(forward, tokens)
    expected = _reference(model, tokens)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
    assert (_without_window(model, tokens) - expected).abs().max() > 0.1  # the window matters


@each_isa
def test_compiled_pass_logits_follow_transformers_past_the_window_and_after_a_crop(quantized, isa):
    model, blocks = quantized
    forward = LlamaForward(model, 256, blocks, isa=isa, activations="float32")
    assert forward.native is not None and forward.embed is None  # token rows from the tied head's blocks
    tokens = _tokens(60)
    ours = _prefill_crop_decode(forward, tokens)
    expected = _reference(model, tokens)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
    assert (_without_window(model, tokens) - expected).abs().max() > 0.1


@each_isa
@each_activations
def test_logits_of_a_token_do_not_depend_on_its_draft_or_on_other_sequences(quantized, isa, activations):
    model, blocks = quantized
    forward = LlamaForward(model, 256, blocks, isa=isa, activations=activations)
    prompt, other = _tokens(100), _tokens(40, seed=2)
    verify, plain, neighbour = forward.new_cache(128), forward.new_cache(128), forward.new_cache(64)
    for cache in (verify, plain):
        forward.forward([(cache, prompt[:90], 1)])
    forward.forward([(neighbour, other[:30], 1)])
    together, _ = forward.forward([(verify, prompt[90:98], 8), (neighbour, other[30:33], 3)])
    for i, token in enumerate(prompt[90:98]):
        assert torch.equal(forward.forward([(plain, [token], 1)])[0][0], together[i])


def _greedy_with_and_without_drafting(forward, prompt: list[int], max_tokens: int = 60):
    tokenizer = TinyTokenizer(forward.vocab_size)
    cost = [0.0] + [1.0 + 0.02 * t for t in range(DraftingConfig().max_draft + 1)]
    drafting = Engine(forward, tokenizer, DraftingConfig(), cost)  # type: ignore[arg-type]
    plain = Engine(forward, tokenizer, DraftingConfig(enabled=False))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    without = plain.generate(GenerationRequest(prompt, params))
    # The plain output as drafting context (as Predicted Outputs give it): long runs of right
    # drafts, and wrong ones from the prompt.
    with_drafts = drafting.generate(GenerationRequest(prompt, params, draft_context=[without.token_ids[:45]]))
    return without, with_drafts


@each_isa
@each_activations
def test_greedy_output_identical_with_and_without_drafting(quantized, isa, activations):
    model, blocks = quantized
    forward = LlamaForward(model, 256, blocks, isa=isa, activations=activations)
    without, with_drafts = _greedy_with_and_without_drafting(forward, _tokens(30, seed=3))
    assert with_drafts.token_ids == without.token_ids
    assert without.stats.drafted_tokens == 0
    assert with_drafts.stats.accepted_tokens > 20 and with_drafts.stats.drafted_tokens > with_drafts.stats.accepted_tokens


def test_rotary_tables_of_each_layer_type_are_transformers_bit_for_bit(quantized):
    # A GGUF on the kernels computes the tables without transformers' modules (weightless_model).
    model, _ = quantized
    rotary = model.model.rotary_emb
    positions = torch.arange(300)[None]
    for kind in ("sliding_attention", "full_attention"):
        ours = RotaryTables(model.config, kind)(torch.zeros(1), positions)
        theirs = rotary(torch.zeros(1), positions, kind)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    local, whole = (RotaryTables(model.config, kind).inv_freq for kind in ("sliding_attention", "full_attention"))
    assert not torch.equal(local, whole)  # 10,000 and 1,000,000


@pytest.mark.parametrize("change, named", [
    ({"final_logit_softcapping": 30.0}, "final logit softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn logit softcapping"),
    ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "bidirectional attention"),
])
def test_what_the_forward_does_not_run_is_refused_by_name(change, named):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, **change)
    model = Gemma3ForCausalLM(config)
    assert named in (native_support(model) or "")
    with pytest.raises(ValueError, match=named):
        LlamaForward(model, 256)


# The synthetic GGUF, loaded as ``parrot serve`` loads it.


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory):
    from loadtests.make_synthetic_gguf import write
    from parrot.engine.kernels import kernels

    path = os.path.join(tmp_path_factory.mktemp("gemma3"), "gemma3-tiny.gguf")
    write(path, "tiny", "Q4_K_M", seed=1, arch="gemma3")  # Q5_0, Q8_0, Q4_K and Q6_K, as the real file
    # Converted configs of the temporary file go to a temporary cache, not the user's (the
    # kernels are loaded first, from the user's cache: built there once, not in every run).
    for isa in available_isas():
        kernels(isa)
    saved = os.environ.get("PARROT_CACHE_DIR")
    os.environ["PARROT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield path
    if saved is None:
        os.environ.pop("PARROT_CACHE_DIR", None)
    else:
        os.environ["PARROT_CACHE_DIR"] = saved


def _on_kernels(path: str, activations: str = "q8") -> LlamaForward:
    from parrot.engine.backends.native import load_onto_kernels
    from parrot.engine.source import resolve_source

    loaded = load_onto_kernels(resolve_source(path), ModelConfig(source=path, activations=activations))
    assert loaded is not None and isinstance(loaded.forward, LlamaForward) and loaded.forward.native is not None
    return loaded.forward


def test_a_gemma3_gguf_is_served_on_the_kernels_by_default(gguf):
    from parrot.engine.loader import load_model

    loaded = load_model(ModelConfig(source=gguf))
    assert loaded.backend == "native" and loaded.details["whole_pass_compiled"]
    assert loaded.forward.embed is None  # no float32 copy of the 262k-row embedding of a real file
    assert [layer.window for layer in loaded.forward.layers] == [8] * 5 + [0]


def test_a_gemma3_gguf_on_the_kernels_follows_transformers_reading_of_the_file(gguf):
    from transformers import AutoModelForCausalLM

    forward = _on_kernels(gguf, "float32")
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                     dtype=torch.float32).eval()
    assert reference.config.layer_types[-1] == "full_attention" and reference.config.sliding_window == WINDOW
    tokens = _tokens(60)
    ours = _prefill_crop_decode(forward, tokens)
    expected = _reference(reference, tokens)
    error = float((ours - expected).abs().max() / expected.abs().max())
    print(f"gemma3 GGUF: relative difference to transformers {error:.2e}")
    assert error < 1e-5
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    assert float((_without_window(reference, tokens) - expected).abs().max() / expected.abs().max()) > 1e-3


def test_a_gemma3_gguf_on_the_kernels_computes_what_the_transformers_path_does_bit_for_bit(gguf):
    # The file's norms hold 1 + w; both ways in read w (subtracting 1, as transformers does) and
    # multiply by 1 + w: the same float32 factors, so the same logits bit for bit.
    from parrot.engine.hf_loading import gguf_blocks, load_transformers

    direct = _on_kernels(gguf)
    source, _, hf_model = load_transformers(ModelConfig(source=gguf))
    through_transformers = LlamaForward(hf_model, 256, gguf_blocks(source, hf_model))
    assert through_transformers.native is not None
    tokens = _tokens(60)
    assert torch.equal(_prefill_crop_decode(direct, tokens), _prefill_crop_decode(through_transformers, tokens))


@each_activations
def test_greedy_output_of_the_gguf_identical_with_and_without_drafting(gguf, activations):
    forward = _on_kernels(gguf, activations)
    without, with_drafts = _greedy_with_and_without_drafting(forward, _tokens(30, seed=4))
    assert with_drafts.token_ids == without.token_ids
    assert with_drafts.stats.accepted_tokens > 20 and with_drafts.stats.drafted_tokens > with_drafts.stats.accepted_tokens


@pytest.fixture(scope="module")
def scaled_gguf(gguf) -> str:
    """The tiny GGUF with linear RoPE scaling of its global layers in the metadata, as llama.cpp
    writes Gemma 3 4B's (factor 8), which transformers' GGUF reader does not read."""
    from loadtests.make_synthetic_gguf import write

    path = os.path.join(os.path.dirname(gguf), "gemma3-tiny-rope8.gguf")
    write(path, "tiny", "Q8_0", seed=2, arch="gemma3", rope_linear=8.0)
    return path


@pytest.mark.parametrize("backend, kernels_off, expected", [
    ("auto", False, "native"),  # the kernels
    ("native", True, "native"),  # Parrot's forward over transformers' weights
    ("hf", False, "hf"),  # transformers' forward
])
def test_every_way_a_gemma3_gguf_loads_scales_rope_as_its_metadata_says(scaled_gguf, monkeypatch, backend,
                                                                         kernels_off, expected):
    from transformers import AutoModelForCausalLM

    from parrot.engine.loader import load_model

    if kernels_off:
        monkeypatch.setenv("PARROT_KERNELS", "0")
    loaded = load_model(ModelConfig(source=scaled_gguf, backend=backend, activations="float32"))
    assert loaded.backend == expected
    if expected == "native":
        assert (loaded.forward.native is None) == kernels_off
    tokens = torch.randint(5, 500, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = loaded.forward.forward([(loaded.forward.new_cache(320), tokens, len(tokens))])[0]
    reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(scaled_gguf),
                                                     gguf_file=os.path.basename(scaled_gguf), dtype=torch.float32).eval()
    unscaled = _reference(reference, tokens)  # what transformers reads from the file alone
    parameters = reference.config.rope_parameters
    parameters["full_attention"] = {**parameters["full_attention"], "rope_type": "linear", "factor": 8.0}
    reference.model.rotary_emb = type(reference.model.rotary_emb)(config=reference.config)
    expected_logits = _reference(reference, tokens)
    scale = expected_logits.abs().max()
    error = float((ours - expected_logits).abs().max() / scale)
    print(f"{backend}: relative difference {error:.2e}; unscaled RoPE's {float((unscaled - expected_logits).abs().max() / scale):.2e}")
    assert error < 1e-5
    assert float((unscaled - expected_logits).abs().max() / scale) > 1e-3
