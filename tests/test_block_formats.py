"""The block formats are one table: csrc/formats.h's PARROT_FORMATS in the compiled libraries,
quant.FORMATS in Python. Every library this CPU runs carries Python's table, and a format defined
outside the repository (a toy header compiled in through PARROT_EXTRA_FORMAT_HEADER) runs through
the library's linear layers and row expansion with no file of the repository edited: a format
is its struct and its row.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from parrot.engine import kernels as kernel_sets
from parrot.engine.kernels import FormatTableMismatch, Kernels, Mat, available_isas, declare, library_formats
from parrot.engine.quant import FORMATS, Format

# 32 signed bytes after one float32 scale; weight = d * q. Float path only (NoBytes): the library
# runs it as it runs F16, without an 8-bit path or a packed copy.
TOY_FORMAT = r"""
struct Toy8W : Layout<36, 32>, NoBytes {
  static Scales scales(const uint8_t* blk, int64_t) {
    float d;
    std::memcpy(&d, blk, 4);
    return plain(d);
  }
  static F part(const uint8_t* blk, int64_t, int s, const Scales& c) {
    return mul(set1(c.d0), to_float(load_i8(blk + 4 + s * L)));
  }
};
#define PARROT_EXTRA_FORMATS(X) X(TOY8, "toy8", -1, Toy8W)
"""
TOY = Format("toy8", -1, 36, 32)


@pytest.mark.parametrize("isa", available_isas())
def test_each_librarys_format_table_is_the_python_table(isa):
    assert kernel_sets.kernels(isa).formats == list(FORMATS.values())


@pytest.fixture(scope="module")
def toy_library(tmp_path_factory) -> ctypes.CDLL:
    directory = tmp_path_factory.mktemp("toy-format")
    header = directory / "toy8.h"
    header.write_text(TOY_FORMAT)
    lib = ctypes.CDLL(kernel_sets._build("portable", format_header=str(header)))  # cached by the header's contents
    declare(lib)
    return lib


def _toy_blocks(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random toy blocks [rows, k / 32 * 36] and their weights d * q in float32."""
    rng = np.random.default_rng(seed)
    d = (rng.random((rows, k // 32, 1)) * 0.1).astype(np.float32)
    q = rng.integers(-128, 128, (rows, k // 32, 32)).astype(np.int8)
    data = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(data)), torch.from_numpy((d * q.astype(np.float32)).reshape(rows, k))


def test_a_format_from_outside_the_repository_runs_in_the_kernels(toy_library):
    table = library_formats(toy_library)
    assert table == [*FORMATS.values(), TOY]  # the built-in formats keep their numbers
    kind = table.index(TOY)
    n, k = 70, 576  # 70 weight rows: not a multiple of any tile
    data, weights = _toy_blocks(n, k, seed=1)

    def linear(x: torch.Tensor, bias: torch.Tensor | None = None, q8: int = 0) -> torch.Tensor:
        mat = Mat(kind, n, k, data.data_ptr(), None if bias is None else bias.data_ptr(), None, None)
        y = torch.empty(x.shape[0], n)
        toy_library.parrot_linear(ctypes.byref(mat), x.contiguous().data_ptr(), x.shape[0], y.data_ptr(), 2, q8)
        return y

    # Times the identity, the kernel gives back its expansion of the weights: d * q, bit for bit.
    assert torch.equal(linear(torch.eye(k)).T, weights)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    y = linear(x, bias)
    torch.testing.assert_close(y.double(), x.double() @ weights.double().T + bias.double(), atol=1e-4, rtol=1e-5)
    assert torch.equal(linear(x, bias, q8=1), y)  # no 8-bit path: q8 leaves it on the float path
    assert toy_library.parrot_packed_bytes(kind, n, k) == 0

    rows = torch.tensor([69, 0, 7, 7])
    out = torch.empty(len(rows), k)
    mat = Mat(kind, n, k, data.data_ptr(), None, None, None)
    toy_library.parrot_rows(ctypes.byref(mat), rows.data_ptr(), len(rows), out.data_ptr())
    assert torch.equal(out, weights[rows])


def test_a_library_whose_table_is_not_pythons_is_refused(toy_library):
    with pytest.raises(FormatTableMismatch, match="toy8"):
        Kernels("portable", toy_library)
