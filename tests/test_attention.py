"""Attention of decoding passes (csrc/attention.h): float32-level results and batch invariance,
for every kernel set this CPU runs.

The property that matters to speculative decoding: a token's logits are the same bit for bit
whether it is fed alone or with a draft after it, so verifying a draft can never pick another
token than plain decoding would.
"""

from __future__ import annotations

import pytest
import torch

from parrot.engine.kernels import available_isas, kernels
from parrot.engine.llama import LlamaForward
from tests.tiny import tiny_hf_model

each_isa = pytest.mark.parametrize("isa", available_isas())


def _cache(kv_heads: int, capacity: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(kv_heads, capacity, dim, generator=g), torch.randn(kv_heads, capacity, dim, generator=g)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, window: int = 0) -> torch.Tensor:
    """float64 causal attention; query t of n sits at position end - n + t; head h reads kv head h // group;
    ``window`` > 0: position i sees keys j with i - window < j <= i (transformers' sliding window)."""
    n, heads, dim = q.shape
    group = heads // k.shape[0]
    keys = k[:, :end].double().repeat_interleave(group, 0)
    values = v[:, :end].double().repeat_interleave(group, 0)
    scores = torch.einsum("nhd,hjd->hnj", q.double(), keys) * dim**-0.5
    visible = torch.ones(n, end, dtype=torch.bool).tril(end - n)
    if window:
        visible &= ~torch.ones(n, end, dtype=torch.bool).tril(end - n - window)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnj,hjd->nhd", weights, values).reshape(n, heads * dim)


@each_isa
# Groups of 1 to 12 query heads per key/value head: 6 (Qwen2.5-1.5B) goes through a chunk in one
# block of rows in every build (two keys at a time with 16 vector registers, each row's query
# loaded as it is used), 5 two keys at a time there with the queries held, 7 in one block in the
# AVX-512 builds and in two elsewhere; 12 in two blocks everywhere.
@pytest.mark.parametrize("dim,heads,kv_heads", [(16, 4, 2), (64, 9, 3), (64, 4, 4), (128, 4, 1), (256, 4, 1),
                                                (128, 12, 2), (64, 5, 1), (32, 7, 1), (64, 12, 1)])
@pytest.mark.parametrize("n,end", [(1, 1), (1, 300), (3, 17), (8, 256), (8, 600), (17, 520)])
def test_decode_attention_equals_float64_causal_attention(isa, dim, heads, kv_heads, n, end):
    # Ends around the 256-position chunks the kernel splits the cache into.
    k, v = _cache(kv_heads, 640, dim, seed=n + end)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(end)) * 2
    out = kernels(isa).attention(q, k, v, end, dim**-0.5)
    torch.testing.assert_close(out.double(), _reference(q, k, v, end), atol=1e-5, rtol=1e-5)


@each_isa
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 4, 2), (256, 4, 1)])
@pytest.mark.parametrize("n,end,window", [
    (1, 1, 8), (1, 300, 8), (3, 17, 8), (8, 600, 8),  # windows inside one 256-position chunk
    (17, 520, 8),  # a window across a chunk boundary for some rows, not for others
    (8, 600, 300), (1, 600, 512),  # windows over two and three chunks (the first: chunk 0 skipped)
    (5, 40, 512),  # a window longer than the sequence: plain causal attention
])
def test_sliding_window_attention_equals_float64_windowed_attention(isa, dim, heads, kv_heads, n, end, window):
    k, v = _cache(kv_heads, 640, dim, seed=n + end)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(end)) * 2
    out = kernels(isa).attention(q, k, v, end, dim**-0.5, window)
    expected = _reference(q, k, v, end, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    if end > window:  # the window matters here: the whole causal attention is another result
        assert not torch.allclose(_reference(q, k, v, end).float(), expected.float(), atol=1e-3)


@each_isa
@pytest.mark.parametrize("window", [0, 200])
def test_more_rows_than_one_attention_piece_equal_the_reference_and_their_rows_alone(isa, window):
    # The kernel takes 64 rows at a time (csrc/attention.h, ATTENTION_ROWS): 150 rows are three
    # pieces, the last partial. Each row equals the float64 reference, and bit for bit the same
    # row computed in a call of its own.
    k, v = _cache(2, 640, 64, seed=5)
    q = torch.randn(150, 4, 64, generator=torch.Generator().manual_seed(5)) * 2
    end = 620
    out = kernels(isa).attention(q, k, v, end, 64**-0.5, window)
    torch.testing.assert_close(out.double(), _reference(q, k, v, end, window), atol=1e-5, rtol=1e-5)
    for row in (0, 63, 64, 100, 149):
        alone = kernels(isa).attention(q[row : row + 1], k, v, end - 149 + row, 64**-0.5, window)
        assert torch.equal(alone[0], out[row])


@each_isa
def test_a_rows_windowed_result_does_not_depend_on_the_rest_of_the_pass(isa):
    # Rows of one pass see different windows (and the pass visits chunks some rows do not see).
    k, v = _cache(1, 1024, 256, seed=1)
    q = torch.randn(12, 4, 256, generator=torch.Generator().manual_seed(2))
    end, window = 700, 200
    together = kernels(isa).attention(q, k, v, end, 0.0625, window)
    for t in range(12):
        alone = kernels(isa).attention(q[t : t + 1], k, v, end - 12 + t + 1, 0.0625, window)
        assert torch.equal(alone[0], together[t])


@each_isa
def test_a_rows_result_does_not_depend_on_the_rest_of_the_pass(isa):
    k, v = _cache(3, 1024, 64, seed=1)
    q = torch.randn(12, 9, 64, generator=torch.Generator().manual_seed(2))
    end = 700
    together = kernels(isa).attention(q, k, v, end, 0.125)
    for t in range(12):
        # token t alone: the cache then ends at its own position
        alone = kernels(isa).attention(q[t : t + 1], k, v, end - 12 + t + 1, 0.125)
        assert torch.equal(alone[0], together[t])


@each_isa
def test_unsupported_head_shapes_are_declined(isa):
    supports = kernels(isa).attention_supports
    assert supports(64, 9, 3) and supports(16, 4, 2) and supports(128, 32, 8) and supports(256, 4, 1)
    assert not supports(24, 4, 2)  # a head size the kernels have no tile for
    assert not supports(64, 9, 2)  # heads not a multiple of kv heads


def test_a_float16_cache_is_refused_not_read_as_float32():
    # The library's attention entry reads float32; float16 keys read as float32 gave values of 1e27.
    q = torch.randn(4, 4, 64)
    k = v = torch.randn(2, 8, 64)
    kernel = kernels()
    assert kernel is not None
    kernel.attention(q, k, v, 8, 0.125)
    with pytest.raises(ValueError, match="float32"):
        kernel.attention(q, k.half(), v.half(), 8, 0.125)


@each_isa
def test_forward_logits_of_a_token_do_not_depend_on_the_draft_fed_with_it(isa):
    # float32 weights (no GGUF blocks): oneDNN linears and the attention kernel
    forward = LlamaForward(tiny_hf_model(5), 512, isa=isa)
    assert forward.attention_kernel is not None
    prompt = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    verify, plain = forward.new_cache(400), forward.new_cache(400)
    forward.forward([(verify, prompt[:290], 1)])
    forward.forward([(plain, prompt[:290], 1)])
    together = forward.forward([(verify, prompt[290:298], 8)])[0]
    for i, token in enumerate(prompt[290:298]):
        assert torch.equal(forward.forward([(plain, [token], 1)])[0][0], together[i])
