"""GGUFs of the other families that share the Llama architecture, loaded onto the kernels.

Two-layer synthetic files (``loadtests/make_synthetic_gguf.py --params tiny``, Q8_0, the
embedded model's tokenizer; llama.cpp loads both) stand in for what users download:

- Llama 3.1 and later: RoPE scaled ("llama3"), which llama.cpp's converter writes as
  ``rope_freqs.weight`` (one divisor per frequency) and transformers does not read back from a
  GGUF. Parrot's logits must equal transformers' over the same weights with the llama3
  rope_scaling in its config (its own implementation of the scaling), and differ materially
  from plain RoPE's, so that the check cannot pass without the factors.
- Qwen2: q, k and v biases, and q/k rows in the checkpoint's order (llama.cpp permutes them for
  the LLaMA architecture only). Parrot's logits must equal transformers' reading of the file,
  and differ materially without the biases.

On both, the kernels' exactness contract: a token's logits are the same bit for bit alone or in
a pass with drafts after it.
"""

from __future__ import annotations

import os

import pytest
import torch

from loadtests.make_synthetic_gguf import LLAMA3_ROPE, write
from parrot.config import ModelConfig
from parrot.engine.backends.native import load_onto_kernels
from parrot.engine.hf_loading import load_transformers
from parrot.engine.source import resolve_source

PROMPT = torch.randint(100, 40000, (600,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("families")
    out = {}
    for arch, rope_freqs in (("llama", True), ("qwen2", False)):
        path = os.path.join(directory, f"{arch}.gguf")
        write(path, "tiny", "Q8_0", seed=1, arch=arch, rope_freqs=rope_freqs)
        out[arch] = path
    return out


@pytest.fixture(autouse=True, scope="module")
def _cache(tmp_path_factory: pytest.TempPathFactory):
    # Converted configs of the temporary files go to a temporary cache, not the user's.
    saved = os.environ.get("PARROT_CACHE_DIR")
    os.environ["PARROT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        os.environ.pop("PARROT_CACHE_DIR", None)
    else:
        os.environ["PARROT_CACHE_DIR"] = saved


def _native(path: str):
    loaded = load_onto_kernels(resolve_source(path), ModelConfig(source=path, activations="float32"))
    assert loaded is not None and loaded.forward.native is not None  # the whole pass on the kernels
    return loaded.forward


def _native_logits(forward, tokens: list[int]) -> torch.Tensor:
    cache = forward.new_cache(len(tokens))
    return forward.forward([(cache, tokens, len(tokens))])[0]


def _reference(path: str):
    """transformers' own reading of the file (float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@torch.inference_mode()
def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the logits' scale."""
    return float((a - b).abs().max() / b.abs().max())


def test_llama3_rope_scaling_from_rope_freqs(files):
    forward = _native(files["llama"])
    factor, low, high, original = LLAMA3_ROPE
    reference = _reference(files["llama"])
    plain_rope = reference.model.rotary_emb
    plain = _reference_logits(reference, PROMPT)
    reference.config.rope_parameters = {**reference.config.rope_parameters, "rope_type": "llama3", "factor": factor,
                                        "low_freq_factor": low, "high_freq_factor": high,
                                        "original_max_position_embeddings": original}
    reference.model.rotary_emb = type(plain_rope)(config=reference.config)
    ours = _native_logits(forward, PROMPT)
    expected = _reference_logits(reference, PROMPT)
    error = _close(ours, expected)
    print(f"llama3 rope: relative difference to transformers {error:.2e}, plain RoPE's {_close(plain, expected):.2e}")
    assert error < 1e-5
    # Plain RoPE is far further off (random weights attend almost evenly, so positions move the
    # logits less than a trained model's would; still 100 times the tolerance).
    assert _close(plain, expected) > 1e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    # The transformers path (CUDA, backend = "hf") scales the same frequencies.
    _, _, hf_model = load_transformers(ModelConfig(source=files["llama"], backend="hf"))
    torch.testing.assert_close(hf_model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_qwen2_biases_and_row_order(files):
    forward = _native(files["qwen2"])
    reference = _reference(files["qwen2"])
    assert reference.config.model_type == "qwen2"
    assert reference.model.layers[0].self_attn.q_proj.bias is not None
    ours = _native_logits(forward, PROMPT[:200])
    expected = _reference_logits(reference, PROMPT[:200])
    print(f"qwen2: relative difference to transformers {_close(ours, expected):.2e}")
    assert _close(ours, expected) < 1e-5
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))
    with torch.no_grad():
        for layer in reference.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    unbiased = _close(_reference_logits(reference, PROMPT[:200]), expected)
    print(f"qwen2 without its biases: {unbiased:.2e}")
    assert unbiased > 1e-2  # the biases matter


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_do_not_depend_on_the_batch(files, arch):
    loaded = load_onto_kernels(resolve_source(files[arch]), ModelConfig(source=files[arch]))  # 8-bit activations
    assert loaded is not None and loaded.forward.native is not None
    forward = loaded.forward
    prefix, drafts = PROMPT[:300], PROMPT[300:308]
    together = forward.new_cache(320)
    forward.forward([(together, prefix, 1)])
    batch = forward.forward([(together, drafts, len(drafts))])[0]
    alone = forward.new_cache(320)
    forward.forward([(alone, prefix, 1)])
    rows = [forward.forward([(alone, [token], 1)])[0][0] for token in drafts]
    assert torch.equal(batch, torch.stack(rows))


@pytest.mark.parametrize("how, backend, kernels_off, expected", [
    ("auto: the kernels", "auto", False, "native"),
    ("native without kernels: transformers' weights under Parrot's forward", "native", True, "native"),
    ("hf: transformers' forward", "hf", False, "hf"),
])
def test_every_way_the_registry_loads_a_gguf_computes_what_transformers_does(files, monkeypatch, how, backend,
                                                                             kernels_off, expected):
    from parrot.engine.loader import load_model

    if kernels_off:
        monkeypatch.setenv("PARROT_KERNELS", "0")
    path = files["qwen2"]
    loaded = load_model(ModelConfig(source=path, backend=backend, activations="float32"))
    assert loaded.backend == expected and loaded.details["summary"]
    if expected == "native":
        assert (loaded.forward.native is None) == kernels_off
    cache = loaded.forward.new_cache(64)
    ours = loaded.forward.forward([(cache, PROMPT[:50], 50)])[0]
    reference = _reference_logits(_reference(path), PROMPT[:50])
    print(f"{how}: relative difference to transformers {_close(ours, reference):.2e}")
    assert _close(ours, reference) < 1e-5
