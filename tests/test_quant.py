"""GGUF block weights and their compiled kernels: exact weights, float32-level products, invariance.

The kernel tests run every kernel set this CPU can run (kernels.available_isas(): an AVX-512
machine tests AVX-512, AVX2 and portable; an AVX2 machine AVX2 and portable), so none is skipped
for lack of a CPU feature.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parrot.engine.kernels import _extensions, available_isas, kernels
from parrot.engine.quant import FORMATS, BlockWeight, _unpermute_rows
from parrot.gguf_file import GGML_TYPES


def _random_q4_1(n: int, k: int, seed: int = 0) -> BlockWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g, dtype=torch.uint8)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2).contiguous()
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # scales are float16 in GGUF
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return BlockWeight.pack("q4_1", qs, d, m)


def _random_q8_0(n: int, k: int, seed: int = 0) -> BlockWeight:
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    return BlockWeight.pack("q8_0", qs, d)


def _random_blocks(kind: str, rows: int, k: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """Random blocks of any format (any bytes are valid blocks; float formats get random floats,
    since random bytes would be mostly NaN rows) and the reference's de-quantisation of them."""
    f = FORMATS[kind]
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, k // f.block_weights * f.block_bytes), generator=generator, dtype=torch.uint8)
    if kind in ("f32", "f16", "bf16"):
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind]
        data = (torch.randn(rows, k, generator=generator) * 100).to(dtype).view(torch.uint8)
    w = BlockWeight(kind, data)
    return w, w.dequantize()


def test_q4_1_dequantization_follows_the_gguf_layout():
    w = _random_q4_1(3, 64)
    dense = w.dequantize()
    for row in range(3):
        for block in range(2):
            raw = w.data[row, block * 20 : block * 20 + 20]
            byte = raw[4 + 5].item()
            d, m = raw[0:4].view(torch.float16).float().tolist()
            assert dense[row, block * 32 + 5].item() == pytest.approx(d * (byte & 15) + m, abs=0)
            assert dense[row, block * 32 + 21].item() == pytest.approx(d * (byte >> 4) + m, abs=0)


def test_unpermuted_rows_match_transformers_reverse_permute():
    # transformers: w.reshape(n_head, dim, 2, ...).swapaxes(2, 1).reshape(w.shape)
    n_head, rows = 3, 12
    w = torch.arange(rows * 2).reshape(rows, 2)
    expected = w.reshape(n_head, rows // n_head // 2, 2, 2).swapaxes(2, 1).reshape(w.shape)
    assert torch.equal(w[_unpermute_rows(rows, n_head)], expected)


def test_format_table_agrees_with_the_gguf_reader_and_the_gguf_package():
    """The GGUF reader sizes every GGML type from its own table (importing the gguf package costs
    1.4 MB resident), and the kernels' formats name theirs: every row must be the package's."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for f in FORMATS.values():
        kind = GGMLQuantizationType(f.ggml_type)
        assert (kind.name.lower(), *GGML_QUANT_SIZES[kind]) == (f.name, f.block_weights, f.block_bytes)
        assert GGML_TYPES[f.ggml_type] == (kind.name, f.block_weights, f.block_bytes)
    package = {kind.value: (kind.name, *GGML_QUANT_SIZES[kind]) for kind in GGMLQuantizationType if kind in GGML_QUANT_SIZES}
    both = GGML_TYPES.keys() & package.keys()
    assert len(both) >= 30 and all(GGML_TYPES[i] == package[i] for i in both)


def test_float_matrices_are_read_only_with_rows_of_whole_units_of_32():
    # A float format's GGUF block is one weight, but the kernels read rows 32 weights at a time:
    # a matrix with rows of 40 is left to float32 (it would otherwise lose its last 8 columns).
    from parrot.engine.quant import _from_gguf_tensor
    from parrot.gguf_file import GGUFTensor

    def tensor(k: int) -> GGUFTensor:  # as the reader gives it: the rows' bytes
        return GGUFTensor("blk.0.ffn_up.weight", "F16", (4, k), np.ones((4, k), dtype=np.float16).view(np.uint8))

    assert _from_gguf_tensor(tensor(40)) is None
    weight = _from_gguf_tensor(tensor(64))
    assert weight is not None and weight.shape == (4, 64) and torch.equal(weight.dequantize(), torch.ones(4, 64))


def test_a_cpu_vendors_tuning_is_in_its_build_flags(monkeypatch):
    """The avx512 and avx2 sets on AMD cores build without the decoding pass's fetch into L1
    (csrc/packed.h, fetch_ahead); the portable set and other vendors keep it. A fetch changes no
    result, so every build computes the same. The avx512 set on AMD also runs one-row calls on
    the 256-bit steps (PARROT_NARROW_ROWS), with the same sums: see the test below."""
    from parrot.engine import kernels as module

    info = {"vendor_id": "AuthenticAMD", "flags": "avx512f avx512bw avx2 fma f16c"}
    monkeypatch.setattr(module, "_cpuinfo", lambda field: info.get(field, ""))
    assert "-DPARROT_NEAR_FETCH=0" in module._compile_flags("avx512")
    assert "-DPARROT_NEAR_FETCH=0" in module._compile_flags("avx2")
    assert "-DPARROT_NARROW_ROWS=2" in module._compile_flags("avx512")  # 1-2 rows on 256-bit steps
    assert not any("NEAR_FETCH" in flag for flag in module._compile_flags("portable"))
    info["vendor_id"] = "GenuineIntel"
    assert not any("NEAR_FETCH" in flag or "NARROW" in flag for flag in module._compile_flags("avx512"))
    assert not any("NEAR_FETCH" in flag for flag in module._compile_flags("avx2"))


def test_every_cpu_runs_the_portable_kernels():
    isas = available_isas()
    assert isas[-1] == "portable" and kernels("portable") is not None
    with pytest.raises(ValueError, match="not one this CPU runs"):
        kernels("no-such-isa")


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("make", [_random_q4_1, _random_q8_0])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 70, 131])
def test_block_kernel_equals_float32_matmul_of_the_dequantized_weights(isa, make, rows):
    w = make(70, 576)  # 70 output rows: not a multiple of the kernels' 4-, 3- or 2-row weight tiles
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(70)
    y = kernels(isa).linear(x, w, bias)
    expected = x.double() @ w.dequantize().double().T + bias.double()
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("make", [_random_q4_1, _random_q8_0])
def test_block_kernel_rows_do_not_depend_on_the_rest_of_the_batch(isa, make):
    w = make(64, 1536)
    x = torch.randn(140, 1536, generator=torch.Generator().manual_seed(1))
    together = kernels(isa).linear(x, w)
    # every tile shape of every kernel set: 1..8 rows in one tile, and 9..15 rows in two, and
    # prompt-sized calls cut at other rows
    for start, stop in ((0, 1), (3, 5), (2, 5), (3, 7), (3, 8), (4, 10), (1, 9), (6, 13), (5, 20), (2, 12), (0, 15),
                        (60, 70), (1, 140), (0, 129)):
        assert torch.equal(kernels(isa).linear(x[start:stop], w), together[start:stop])


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("q8", [False, True])
def test_block_kernel_results_do_not_depend_on_the_number_of_threads(isa, q8):
    # A layer's tiles are split into pieces the threads claim as they come free: which thread
    # computes a tile, and how many threads there are, must not change a bit of it.
    parts = [_random_q4_1(200, 1536, seed=5), _random_q8_0(72, 1536, seed=6), _random_blocks("q4_k", 40, 1536, 7)[0]]
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(8))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(kernels(isa).linear(x, parts, q8=q8))
    finally:
        torch.set_num_threads(before)
    assert results[0].isfinite().any()
    assert all(torch.equal(r.view(torch.int32), results[0].view(torch.int32)) for r in results[1:])  # NaNs of random blocks too


@pytest.mark.parametrize("isa", available_isas())
def test_a_layer_of_parts_in_different_formats_equals_its_parts(isa):
    # Q4_K_M files fuse q and k in Q4_K with v in Q6_K, say: one call over the parts must give
    # each part's own outputs, side by side, with each part's slice of the bias.
    parts = [_random_q4_1(40, 576, seed=1), _random_q8_0(24, 576, seed=2), _random_q4_1(8, 576, seed=3)]
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(72)
    together = kernels(isa).linear(x, parts, bias)
    apart = torch.cat([kernels(isa).linear(x, p) for p in parts], dim=1) + bias
    assert torch.equal(together, apart)


def test_embedded_model_uses_block_kernels_with_exact_weights(embedded_engine):
    # Every block matrix was checked bit for bit against transformers' weights when the GGUF
    # was converted; a mismatch would leave that layer on float32 weights.
    forward = embedded_engine.forward
    assert forward.block_kernels and forward.lm_head.blocks is not None and forward.native is not None


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_kernels_expand_every_block_format_as_the_gguf_reference_does(isa, kind):
    # Any bytes are valid blocks. The kernel times the identity gives back its expansion of the
    # weights exactly (one product of 1.0, the rest zeros), which must equal the reference's
    # de-quantisation bit for bit. Rows with a non-finite weight are left out (0 * inf is NaN).
    k = 2 * max(FORMATS[kind].block_weights, 64)
    blocks, reference = _random_blocks(kind, 64, k, seed=3)
    data = blocks.data
    finite = reference.isfinite().all(dim=1)
    assert finite.sum() >= 32
    w = BlockWeight(kind, data[finite].contiguous())
    expanded = kernels(isa).linear(torch.eye(k), w).T
    assert torch.equal(expanded, reference[finite])


def _quantized_rows(x: torch.Tensor, unit: int = 32) -> torch.Tensor:
    """x rounded as the q8 kernels round it: per unit of 32 values (256 for the K-quant formats),
    d = max |x| / 127, q = round(x / d)."""
    units = x.reshape(x.shape[0], -1, unit)
    top = units.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    return (torch.round(units * inverse) * (top / 127.0)).reshape(x.shape)


def _fine_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the LM head's K-quant tiles round it (csrc/simd.h, quantize256_fine): per
    super-block of 256, d = max |x| / (127 x 8); per unit of 32, f = ceil(8 max_unit / max) in 1..8
    and q = round(x / (d f))."""
    blocks = x.reshape(x.shape[0], -1, 8, 32)
    top = blocks.abs().amax(dim=(-1, -2), keepdim=True)
    unit = blocks.abs().amax(-1, keepdim=True)
    levels = torch.where(top > 0, torch.ceil(unit * 8 / top).clamp(1, 8), torch.ones_like(unit))
    inverse = torch.where(top > 0, torch.tensor(127.0 * 8) / top, torch.zeros_like(top))
    return (torch.round(blocks * (inverse / levels)) * levels * (top / (127.0 * 8))).reshape(x.shape)


# The wide K-quant kernels this CPU runs, checked against the avx2 build; on an AVX2-only CPU the
# avx2 build's tiles against its own one-row passes. Where the avx512 set is built with VNNI, also
# the same set without it ("avx512-16bit": the 16-bit steps an AVX-512 CPU without VNNI runs), and
# where with VBMI as well, with VNNI only ("avx512-vnni": the shuffles a CPU without VBMI runs).
WIDE = [isa for isa in ("avx512", "amx") if isa in available_isas()] or [isa for isa in ("avx2",) if isa in available_isas()]
if "avx512" in available_isas() and _extensions("avx512", ("avx512_vnni",)):
    WIDE.append("avx512-16bit")
    if _extensions("avx512", ("avx512vbmi",)):
        WIDE.append("avx512-vnni")
WIDE_SETS = {"avx512-16bit": ("avx512", ()), "avx512-vnni": ("avx512", ("avx512_vnni",))}


@pytest.mark.skipif("avx512" not in available_isas(), reason="the CPU has no AVX-512")
@pytest.mark.parametrize("narrow", [0, 2])
@pytest.mark.parametrize("extensions", [None, ()], ids=["cpu", "none"])
def test_few_row_calls_on_either_avx512_path_equal_the_avx2_steps(monkeypatch, narrow, extensions):
    # A call over 1 or 2 rows of x (a pass over 1 or 2 tokens) runs kpairs' 512-bit step pairs (2
    # rows with VNNI: kptile2), or with PARROT_NARROW_ROWS=2 (kernels.TUNING, AMD) the 256-bit
    # steps with x in their order, not VNNI's: both builds on every AVX-512 CPU, with its
    # extensions and with none, against the avx2 set, bit for bit; and 3 and 9 rows (past the
    # narrow calls, whose last tile has one row of x) too.
    import ctypes

    from parrot.engine import kernels as module

    vendor = module._cpuinfo("vendor_id")
    tuned = tuple(f for f in module.TUNING.get((vendor, "avx512"), ()) if "NARROW" not in f)
    monkeypatch.setitem(module.TUNING, (vendor, "avx512"), (*tuned, f"-DPARROT_NARROW_ROWS={narrow}"))
    wide_set = module.Kernels("avx512", ctypes.CDLL(module._build("avx512", extensions=extensions)))
    generator = torch.Generator().manual_seed(8)
    for kind in ("q4_k", "q5_k", "q6_k"):
        blocks, _ = _random_blocks(kind, 24, 3 * 256, seed=8)
        for rows in (1, 2, 3, 9):
            x = torch.randn(rows, 3 * 256, generator=generator) * 3
            x[:, 100] = 80.0  # an outlier (taken out of the rounding, added in float32)
            for fine in (False, True):
                wide = wide_set.linear(x, BlockWeight(kind, blocks.data.clone()), q8=True, fine=fine)
                steps = torch.cat([kernels("avx2").linear(x[i : i + 1], BlockWeight(kind, blocks.data.clone()), q8=True, fine=fine)
                                   for i in range(rows)])
                assert wide.isfinite().sum() > rows * 10
                assert torch.equal(wide.nan_to_num(), steps.nan_to_num()), (kind, rows, fine)


@pytest.mark.parametrize("isa", WIDE)
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("fine", [False, True])
def test_wide_k_quant_kernels_equal_the_avx2_steps(isa, kind, fine):
    # The AVX-512 build takes two steps of the packed K-quant layout per instruction (packed.h,
    # kpairs; with VNNI, a 32-bit sum per row and group, times the scales per block), and the amx set
    # runs K-quant layers over 32 or more rows on AMX tiles with the scales folded into the weights
    # (Q4_K, Q5_K) or split into three digits (Q6_K; amx.h); with VNNI, tiles of 2-8 rows scale
    # two rows of x per vector (packed.h, kptile2, Q6_K's offsets where its block sums start).
    # All sum the same integers as the avx2
    # steps, so every output is bit for bit the avx2 build's: one row of x (decoding), tiles of
    # several, and (amx) whole and partial tiles of 16 rows and pairs of them, with 8-row groups of
    # weights not filling one. With `fine` (the LM head's rounding) every set runs packed.h's tiles:
    # the AVX-512 pairs against the avx2 steps. Units of 32 of different sizes, so that the fine
    # multipliers take every value 1 .. 8.
    if isa == "amx" and not kernels("amx").amx_ready:
        pytest.skip("the OS did not grant the AMX tile registers")
    blocks, _ = _random_blocks(kind, 40, 5 * 256, seed=6)
    generator = torch.Generator().manual_seed(6)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 40, 49, 81):
        units = torch.rand(rows, 5 * 8, 1, generator=generator).pow(2)
        x = (torch.randn(rows, 5 * 8, 32, generator=generator) * 3 * units).reshape(rows, 5 * 256)
        x[::3, 100] = 80.0  # outliers (taken out of plain rounding and added in float32)
        x[1::4, 700:720] = -90.0
        wide_set = kernels(WIDE_SETS[isa][0], extensions=WIDE_SETS[isa][1]) if isa in WIDE_SETS else kernels(isa)
        wide = wide_set.linear(x, BlockWeight(kind, blocks.data.clone()), q8=True, fine=fine)
        if isa == "avx2":
            narrow = torch.cat([kernels("avx2").linear(x[i : i + 1], BlockWeight(kind, blocks.data.clone()), q8=True, fine=fine)
                                for i in range(rows)])
        else:
            narrow = kernels("avx2").linear(x, BlockWeight(kind, blocks.data.clone()), q8=True, fine=fine)
        assert wide.isfinite().sum() > rows * 20
        assert torch.equal(wide.nan_to_num(), narrow.nan_to_num())


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("fine", [False, True])
def test_q8_kernels_are_exact_products_of_the_rounded_rows(isa, kind, fine):
    # With 8-bit activations, each output is the product of the row rounded to 8 bits per 32
    # (per super-block of 256 for the K-quant formats) and the reference's weights, to float32 rounding of the sum (integer sums are exact); float
    # formats keep float32 inputs. Rows 1..11 cover every tile; K of 21 units an odd last pair.
    # `fine`: the K-quant formats' rows rounded with a multiplier per unit of 32 as well (_fine_rows);
    # the 32-weight formats are rounded per 32 either way.
    weights = FORMATS[kind].block_weights
    k = 3 * weights if weights == 256 else 21 * 32
    blocks, reference = _random_blocks(kind, 128, k, seed=4)
    generator = torch.Generator().manual_seed(4)
    usable = reference.isfinite().all(dim=1)
    assert usable.sum() >= 8
    w = BlockWeight(kind, blocks.data[usable].contiguous())
    weight = reference[usable].double()
    for rows in (1, 2, 3, 5, 8, 11):
        x = torch.randn(rows, k, generator=generator)
        y = kernels(isa).linear(x, w, q8=True, fine=fine).double()
        if kind in ("f32", "f16", "bf16"):
            rounded = x.double()
        else:
            rounded = (_fine_rows(x) if fine and weights == 256 else _quantized_rows(x, min(weights, 256))).double()
        bound = 1e-5 * (rounded.abs() @ weight.abs().T)
        assert ((y - rounded @ weight.T).abs() <= bound).all()
    x = torch.randn(13, k, generator=generator)
    together = kernels(isa).linear(x, w, q8=True, fine=fine)
    for start, stop in ((0, 1), (2, 4), (3, 7), (1, 9), (4, 13)):
        assert torch.equal(kernels(isa).linear(x[start:stop], w, q8=True, fine=fine), together[start:stop])


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", sorted(k for k in FORMATS if k.upper() not in ("F32", "F16", "BF16")))
def test_rows_from_the_packed_copy_are_the_file_rows_bit_for_bit(isa, kind):
    # A tied embedding's token rows come from the LM head's packed copy once the file's pages
    # are handed back: every block is rebuilt from it byte for byte, so the rows are the file's,
    # NaN payloads included. 21 rows: three groups of 8, the last one padded.
    w, _ = _random_blocks(kind, 21, 2 * max(FORMATS[kind].block_weights, 64), seed=6)
    index = torch.tensor([20, 0, 7, 8, 15, 20, 3])
    before = kernels(isa).rows(w, index)
    kernels(isa).pack(w)
    assert w.packed is not None
    only_packed = BlockWeight(kind, torch.zeros_like(w.data))  # the file's blocks gone
    only_packed.packed = w.packed
    after = kernels(isa).rows(only_packed, index)
    assert torch.equal(before.view(torch.int32), after.view(torch.int32))


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_rows_of_every_block_format_are_the_gguf_reference_rows(isa, kind):
    # The embedding of a tied model is read from the LM head's blocks, one token row at a time.
    w, dense = _random_blocks(kind, 40, 2 * max(FORMATS[kind].block_weights, 64), seed=5)
    index = torch.tensor([7, 0, 39, 7, 12])
    ours, reference = kernels(isa).rows(w, index), dense[index]
    assert torch.equal(ours.nan_to_num(), reference.nan_to_num())  # random bytes hold NaN weights too
    with pytest.raises(ValueError, match="out of range"):
        kernels(isa).rows(w, torch.tensor([40]))


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_fine_rounding_keeps_small_units_beside_a_large_value(isa, kind):
    # A hidden state with a few large channels (as Qwen2.5's have) rounds every other value of
    # their super-blocks to steps of max / 127 under one multiplier; with a multiplier per unit of
    # 32 (the LM head's rounding) the units without them keep 8 times that resolution here (their
    # values are under an eighth of the large one). The units holding the large values keep
    # their step, 1 unit in 8: the squared error should fall to about 1/8 + 7/8 / 64 = 0.14 of
    # plain rounding's.
    blocks, reference = _random_blocks(kind, 64, 4 * 256, seed=9)
    usable = reference.isfinite().all(dim=1)
    w = BlockWeight(kind, blocks.data[usable].contiguous())
    weight = reference[usable].double()
    x = torch.randn(6, 4 * 256, generator=torch.Generator().manual_seed(9))
    # Four large channels at the start of each super-block: 16 in a row of 1,024, too many to be
    # the row's outliers (over 8 times its root mean square), which plain rounding takes out.
    x[:, torch.arange(4 * 256) % 256 < 4] = 40.0
    exact = x.double() @ weight.T
    plain = (kernels(isa).linear(x, w, q8=True).double() - exact).pow(2).mean()
    fine = (kernels(isa).linear(x, w, q8=True, fine=True).double() - exact).pow(2).mean()
    assert fine < 0.2 * plain


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
def test_q8_rounding_takes_a_rows_outliers_out(isa, kind):
    # A value over 8 times its row's root mean square (at most the 16 largest of a row) would set
    # the rounding step of its whole super-block: the K-quant layers' rows are rounded without
    # them (per super-block of 256, as _quantized_rows) and each is added back times its weights
    # in float32. Row 0 has 3, row 1 none, row 2 20 (the 16 largest are taken, the other 4 are
    # rounded with their super-blocks), and 49 rows run a prompt chunk's tiles (AMX where it is).
    blocks, reference = _random_blocks(kind, 40, 8 * 256, seed=11)
    usable = reference.isfinite().all(dim=1)
    w = BlockWeight(kind, blocks.data[usable].contiguous())
    weight = reference[usable].double()
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(49, 8 * 256, generator=generator)
    x[0, [5, 300, 1901]] = torch.tensor([60.0, -45.0, 70.0])
    x[2, 40:60] = torch.arange(20) + 100.0  # all over the bound (about 79)
    x[3:, 17] = 50.0
    taken = torch.zeros_like(x, dtype=torch.bool)
    taken[0, [5, 300, 1901]] = True
    taken[2, 44:60] = True  # the 16 largest of row 2's 20
    taken[3:, 17] = True
    for rows in (1, 3, 49):
        y = kernels(isa).linear(x[:rows], w, q8=True).double()
        rest = torch.where(taken[:rows], 0.0, x[:rows])
        rounded = _quantized_rows(rest, 256).double()
        outliers = torch.where(taken[:rows], x[:rows], 0.0).double()
        expected = rounded @ weight.T + outliers @ weight.T
        bound = 1e-5 * ((rounded.abs() + outliers.abs()) @ weight.abs().T)
        assert ((y - expected).abs() <= bound).all()
        # and not as plain rounding would have it, with the outliers in their super-blocks
        assert not ((y - _quantized_rows(x[:rows], 256).double() @ weight.T).abs() <= bound).all()
    # Rows do not depend on the rest of the batch.
    assert torch.equal(kernels(isa).linear(x[2:3], w, q8=True), kernels(isa).linear(x, w, q8=True)[2:3])
