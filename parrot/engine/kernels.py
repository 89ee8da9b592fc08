"""Parrot's compiled CPU kernels (``csrc/``: ``kernels.cpp`` and the headers it includes), one
library per instruction set.

The same source is compiled for AVX-512, for AVX2 + FMA and for a portable target (plain C++
vectors the compiler maps to SSE2, NEON, ...), each into its own shared library with a C
interface loaded through ctypes. ``kernels()`` returns the best set the CPU can run;
``kernels(isa)`` a given one (tests run every set the machine can run). Every set is
batch-invariant on its own: a row's result never depends on the rows computed with it. Two sets
need not agree with each other bit for bit (their vectors add in different orders).

A library is built once per machine with the system C++ compiler (a few seconds per set, cached
under the Parrot cache directory, keyed by the source and the compiler). A set uses the
extensions the CPU has among its EXTENSIONS (the avx512 set: VNNI, VBMI), with the same results.
``PARROT_KERNELS`` picks a set (``amx``, ``avx512``, ``avx2``, ``portable``) or turns them off
(``0``): then Parrot uses float32 weights and SDPA attention, as it does where there is no
compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from parrot.engine.paths import cache_root
from parrot.engine.quant import FORMATS, Format

if TYPE_CHECKING:
    from parrot.engine.quant import BlockWeight

log = logging.getLogger("parrot.engine")

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# The compiled file first; every file here is hashed into the library's cache key.
SOURCES = [os.path.join(_CSRC, name) for name in (
    "kernels.cpp", "formats.h", "tiles.h", "packed.h", "amx.h", "linear.h", "attention.h", "model.h", "simd.h", "pool.h")]
# Instruction sets, best first: compiler flags and the /proc/cpuinfo flags they need.
ISAS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "amx": (["-DPARROT_AVX512", "-DPARROT_AMX", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
            ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c", "amx_tile", "amx_int8")),
    "avx512": (["-DPARROT_AVX512", "-mavx512f", "-mavx512bw", "-mfma", "-mf16c"], ("avx512f", "avx512bw", "fma", "f16c")),
    "avx2": (["-DPARROT_AVX2", "-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
    "portable": ([], ()),
}
# Extensions a set is built with where the CPU has them (its /proc/cpuinfo flag and compiler
# flag): the same results, faster. AVX-512 VNNI's `vpdpbusd` adds 4 byte products into a 32-bit
# lane, which the AVX-512 set's K-quant tiles use for their steps (packed.h, kpairs); with VBMI's
# `vpermb` their loads put the weights' bytes in that order themselves (simd.h, vnni_pairs).
EXTENSIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "avx512": (("avx512_vnni", "-mavx512vnni"), ("avx512vbmi", "-mavx512vbmi"))}
# Tuning by CPU vendor and set (/proc/cpuinfo's vendor_id; the same results): on AMD cores a
# decoding pass fetches its weights ahead into L2 only (csrc/packed.h, fetch_ahead), where Intel's
# were 6-10% faster with the fetch into L1 as well. On a Zen 4 the avx512 set's one-token pass was
# 4-22% faster so, the avx2 set's (as on an EPYC whose hypervisor hides AVX-512) 42-46 -> 31-37 ms.
# And there the avx512 set's calls over 1 or 2 rows (passes over 1 or 2 tokens) take the 256-bit
# steps, not the 512-bit pairs (csrc/packed.h, PARROT_NARROW_ROWS): 3-9% off the Zen 4's
# one-token pass, 2-3% off its two-token one, where the pairs had taken 12% off the Xeon's.
TUNING: dict[tuple[str, str], tuple[str, ...]] = {
    ("AuthenticAMD", "avx512"): ("-DPARROT_NEAR_FETCH=0", "-DPARROT_NARROW_ROWS=2"),
    ("AuthenticAMD", "avx2"): ("-DPARROT_NEAR_FETCH=0",)}
# Block formats by their number in the library (their place in quant.FORMATS and csrc/formats.h).
KIND = {name: i for i, name in enumerate(FORMATS)}


def _cpuinfo(field: str) -> str:
    """The first value of ``field`` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.split(":")[0].strip() == field), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def available_isas() -> list[str]:
    """The instruction sets this CPU can run, best first (``portable`` always)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = _cpu_flags()
    return [isa for isa, (_, needs) in ISAS.items() if not needs or (x86 and all(f in flags for f in needs))]


def _extensions(isa: str, only: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The compiler flags of ``isa``'s extensions this CPU has (EXTENSIONS); ``only``: of those,
    the ones with these /proc/cpuinfo flags."""
    flags = _cpu_flags()
    return tuple(option for flag, option in EXTENSIONS.get(isa, ()) if flag in flags and (only is None or flag in only))


def _extension_name(flag: str) -> str:
    return flag.removeprefix("avx512").lstrip("_")  # avx512_vnni: vnni, avx512vbmi: vbmi


def cpu_description() -> str:
    """The CPU's model name and the kernel sets it can run, for logs and benchmark results."""
    name = _cpuinfo("model name") or platform.processor() or platform.machine()
    flags = _cpu_flags()  # a set with extensions as avx512+vnni+vbmi
    sets = [isa + "".join(f"+{_extension_name(flag)}" for flag, _ in EXTENSIONS.get(isa, ()) if flag in flags)
            for isa in available_isas()]
    return f"{name} ({', '.join(sets)})"


class Mat(ctypes.Structure):
    pass


Mat._fields_ = [("kind", ctypes.c_int32), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("next", ctypes.POINTER(Mat)), ("packed", ctypes.c_void_p)]


class LayerDesc(ctypes.Structure):
    """csrc/model.h's Layer: a null pointer (None) is a norm the model does not have."""

    _fields_ = [("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat),
                ("input_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("attn_post_norm", ctypes.c_void_p), ("ffn_post_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("window", ctypes.c_int64)]


# csrc/model.h's Activation: the gated MLP's activation by its transformers name
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


class ModelDesc(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
        ("vocab", ctypes.c_int64), ("max_positions", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("embed_scale", ctypes.c_float),
        ("threads", ctypes.c_int32), ("q8", ctypes.c_int32), ("kv16", ctypes.c_int32), ("act", ctypes.c_int32),
        ("embed", ctypes.c_void_p), ("embed_blocks", ctypes.POINTER(Mat)), ("final_norm", ctypes.c_void_p),
        ("lm_head", Mat), ("layers", ctypes.POINTER(LayerDesc)),
    ]


class SeqDesc(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("capacity", ctypes.c_int64),
                ("start", ctypes.c_int64), ("n", ctypes.c_int64), ("num_logits", ctypes.c_int64)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def mats(parts: "Sequence[BlockWeight]", bias: torch.Tensor | None = None) -> list[Mat]:
    """The library's view of a layer made of ``parts`` along N (each in one block format),
    chained through ``next``: pass the first; keep the list (and the tensors) alive meanwhile."""
    chain, offset = [], 0
    for part in parts:
        n, k = part.shape
        chain.append(Mat(KIND[part.kind], n, k, _ptr(part.data), _ptr(None if bias is None else bias[offset : offset + n]),
                         None, _ptr(part.packed)))
        offset += n
    for a, b in zip(chain, chain[1:]):
        a.next = ctypes.pointer(b)
    return chain


class FormatTableMismatch(Exception):
    """A kernel library whose table of block formats is not quant.FORMATS: a format's number
    would name another format in it. Not an error to fall back from quietly (the sources and the
    Python table disagree), so kernels() lets it through."""


def declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of the library's C interface."""
    lib.parrot_format_count.restype = ctypes.c_int32
    lib.parrot_format_info.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int32),
                                       ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    lib.parrot_linear.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_int]
    lib.parrot_attention.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.parrot_attention_supports.argtypes = [ctypes.c_int64] * 3
    lib.parrot_forward.argtypes = [ctypes.POINTER(ModelDesc), ctypes.c_int64, ctypes.POINTER(SeqDesc),
                                   ctypes.c_void_p, ctypes.c_void_p]
    lib.parrot_rows.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.parrot_packed_bytes.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]
    lib.parrot_packed_bytes.restype = ctypes.c_int64
    lib.parrot_pack.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p]
    lib.parrot_isa.restype = ctypes.c_char_p
    lib.parrot_amx_ready.restype = ctypes.c_int
    lib.parrot_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.parrot_read.restype = ctypes.c_float


def library_formats(lib: ctypes.CDLL) -> list[Format]:
    """The library's table of block formats (csrc/formats.h's PARROT_FORMATS), in its order."""
    name, ggml, size, weights = ctypes.c_char_p(), ctypes.c_int32(), ctypes.c_int64(), ctypes.c_int64()
    formats = []
    for i in range(lib.parrot_format_count()):
        lib.parrot_format_info(i, ctypes.byref(name), ctypes.byref(ggml), ctypes.byref(size), ctypes.byref(weights))
        formats.append(Format(name.value.decode() if name.value else "", ggml.value, size.value, weights.value))
    return formats


class Kernels:
    """One loaded kernel library. Tensors passed in are float32, contiguous, on the CPU."""

    def __init__(self, isa: str, lib: ctypes.CDLL) -> None:
        self.isa = isa
        self._lib = lib
        declare(lib)
        assert lib.parrot_isa().decode() == isa
        # Mat.kind is a format's place in the table: the library's must be quant.FORMATS.
        self.formats = library_formats(lib)
        if self.formats != list(FORMATS.values()):
            ours, theirs = set(FORMATS.values()), set(self.formats)
            raise FormatTableMismatch(
                f"the {isa} kernel library's block formats are not quant.FORMATS (library only: "
                f"{sorted(theirs - ours)}; Python only: {sorted(ours - theirs)}; or in another order)")

    @property
    def amx_ready(self) -> bool:
        """Whether K-quant layers over 32 or more rows run on AMX tiles (the amx set, when the OS
        grants the tile registers; csrc/amx.h)."""
        return bool(self._lib.parrot_amx_ready())

    @staticmethod
    def threads() -> int:
        return torch.get_num_threads()

    def linear(self, x: torch.Tensor, weight: "BlockWeight | Sequence[BlockWeight]",
               bias: torch.Tensor | None = None, q8: bool = False, fine: bool = False) -> torch.Tensor:
        """``x @ W.T (+ bias)``: x [M, K] float32, W in GGUF blocks (or parts of W along N, each
        in its own format); returns [M, N]. ``q8``: quantise x to 8 bits per 32 for the parts in
        integer formats (the faster path; see csrc/packed.h); ``fine`` (with q8): the K-quant
        parts' x with a multiplier per unit of 32 too, as the LM head rounds it (csrc/simd.h,
        quantize256_fine)."""
        parts = [weight] if not isinstance(weight, Sequence) else list(weight)
        if q8:
            for part in parts:
                self.pack(part)
        k = parts[0].shape[1]
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or any(p.shape[1] != k for p in parts):
            raise ValueError(f"x must be a float32 matrix with {k} columns, got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        y = x.new_empty(x.shape[0], sum(p.shape[0] for p in parts))
        if x.shape[0]:
            chain = mats(parts, bias)
            self._lib.parrot_linear(ctypes.byref(chain[0]), x.data_ptr(), x.shape[0], y.data_ptr(), self.threads(), (2 if fine else 1) if q8 else 0)
        return y

    def pack(self, weight: "BlockWeight") -> None:
        """Give ``weight`` its packed copy for the 8-bit path (8 weight rows interleaved; see
        csrc/packed.h), once; formats without one are left as they are."""
        if weight.packed is not None:
            return
        n, k = weight.shape
        size = self._lib.parrot_packed_bytes(KIND[weight.kind], n, k)
        if size:
            packed = torch.empty(size, dtype=torch.uint8)
            self._lib.parrot_pack(ctypes.byref(mats([weight])[0]), packed.data_ptr())
            weight.packed = packed

    def rows(self, weight: "BlockWeight", rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64) of ``weight``, de-quantised: [len(rows), K] float32."""
        index = rows.to(torch.int64).contiguous()
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < weight.shape[0]):
            raise ValueError(f"row index out of range for {weight.shape[0]} rows")
        out = torch.empty(index.numel(), weight.shape[1])
        chain = mats([weight])
        self._lib.parrot_rows(ctypes.byref(chain[0]), index.data_ptr(), index.numel(), out.data_ptr())
        return out

    def attention_supports(self, head_dim: int, heads: int, kv_heads: int) -> bool:
        return bool(self._lib.parrot_attention_supports(head_dim, heads, kv_heads))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int, scale: float,
                  window: int = 0) -> torch.Tensor:
        """Causal attention of q [n, heads, D] (positions end - n .. end - 1) over k, v
        [kv_heads, capacity, D] holding ``end`` positions; returns [n, heads * D]. ``window`` > 0:
        each query sees only the last ``window`` positions up to its own (sliding-window layers)."""
        n, heads, dim = q.shape
        kv_heads, capacity, _ = k.shape
        if not (self.attention_supports(dim, heads, kv_heads) and k.shape == v.shape and k.shape[2] == dim):
            raise ValueError(f"unsupported attention shape q {tuple(q.shape)}, k {tuple(k.shape)}")
        if not (1 <= n <= end <= capacity) or not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"bad query count {n} or cache length {end} (capacity {capacity})")
        if not q.dtype == k.dtype == v.dtype == torch.float32:  # the library reads float32 (a float16 cache is the compiled pass's)
            raise ValueError(f"attention reads float32 tensors, not q {q.dtype}, k {k.dtype}, v {v.dtype}")
        q = q.contiguous()
        out = q.new_empty(n, heads * dim)
        self._lib.parrot_attention(q.data_ptr(), n, heads, dim, k.data_ptr(), v.data_ptr(), kv_heads, capacity, end,
                                   max(0, window), scale, out.data_ptr(), self.threads())
        return out

    def read_bandwidth(self, megabytes: int = 256, repeats: int = 3) -> float:
        """Bytes per second this process reads from memory with its threads (the best of
        ``repeats`` reads of a buffer far larger than the caches): the bandwidth a decoding pass
        that streams its weights can reach."""
        data = torch.ones(megabytes * 2**20 // 4)
        self._lib.parrot_read(data.data_ptr(), data.numel() * 4, 1, self.threads())  # touch every page
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self._lib.parrot_read(data.data_ptr(), data.numel() * 4, 1, self.threads())
            best = min(best, time.perf_counter() - start)
        return data.numel() * 4 / best

    def forward(self, model: ModelDesc, seqs: Sequence[SeqDesc], ids: torch.Tensor, logits: torch.Tensor) -> None:
        """One decoding pass of ``model`` (see ``csrc/model.h``): ids int64 [sum n],
        logits float32 [sum num_logits, vocab] written in place."""
        array = (SeqDesc * len(seqs))(*seqs)
        model.threads = self.threads()
        self._lib.parrot_forward(ctypes.byref(model), len(seqs), array, ids.data_ptr(), logits.data_ptr())


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _compile_flags(isa: str, extensions: tuple[str, ...] | None = None) -> list[str]:
    """The compiler flags of ``isa``'s library on this CPU: the set's, its extensions the CPU has
    (only these /proc/cpuinfo flags' with ``extensions``), and its TUNING for the CPU's vendor."""
    return ["-O3", "-std=c++20", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", *ISAS[isa][0],
            *_extensions(isa, extensions), *TUNING.get((_cpuinfo("vendor_id"), isa), ())]


def _build(isa: str, format_header: str | None = None, extensions: tuple[str, ...] | None = None) -> str:
    """Compile the library for ``isa`` (once; cached by source, flags and compiler), with the
    extensions this CPU has (``extensions``: only those of these /proc/cpuinfo flags). For tests
    only: ``format_header``, a header of extra block formats to compile in (csrc/formats.h's
    PARROT_EXTRA_FORMAT_HEADER), cached by its contents."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = _compile_flags(isa, extensions)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256(" ".join([cxx, *version, *flags]).encode())
    for path in SOURCES + ([format_header] if format_header is not None else []):
        with open(path, "rb") as f:
            digest.update(f.read())
    if format_header is not None:
        flags.append(f'-DPARROT_EXTRA_FORMAT_HEADER="{os.path.abspath(format_header)}"')
    directory = os.path.join(cache_root(), "kernels")
    target = os.path.join(directory, f"libparrot_{isa}_{digest.hexdigest()[:12]}.so")
    if os.path.isfile(target):
        return target
    os.makedirs(directory, exist_ok=True)
    log.info("compiling the %s kernels (once per machine, a few seconds)", isa)
    fd, staging = tempfile.mkstemp(dir=directory, suffix=".so")
    os.close(fd)
    done = subprocess.run([cxx, *flags, SOURCES[0], "-o", staging], capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(staging)
        raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
    os.replace(staging, target)
    return target


@lru_cache(maxsize=None)
def _load(isa: str, extensions: tuple[str, ...] | None = None) -> Kernels:
    return Kernels(isa, ctypes.CDLL(_build(isa, extensions=extensions)))


def kernels(isa: str | None = None, *, extensions: tuple[str, ...] | None = None) -> Kernels | None:
    """The kernel set ``isa``, or by default the best this CPU runs and this compiler builds
    (``PARROT_KERNELS`` to pick one); None, with the reason logged, when kernels are off or none
    can be built. FormatTableMismatch when a library's formats are not quant.FORMATS.
    ``extensions``: the set built with only those of its EXTENSIONS (/proc/cpuinfo flags; ``()``
    for none), which tests compare."""
    if isa is None:
        chosen = os.environ.get("PARROT_KERNELS", "")
        if chosen == "0":
            _log_once("compiled kernels disabled by PARROT_KERNELS=0 (float32 weights, SDPA attention)")
            return None
        candidates = [chosen] if chosen else available_isas()
    else:
        candidates = [isa]
    for candidate in candidates:
        if candidate not in available_isas():
            raise ValueError(f"kernel set {candidate!r} is not one this CPU runs ({', '.join(available_isas())})")
        try:
            return _load(candidate, extensions)
        except (OSError, RuntimeError) as exc:  # no compiler, a failed build, ...: say so, try the next
            _log_once(f"could not build the {candidate} kernels ({exc})")
    _log_once("no compiled kernels: using float32 weights and SDPA attention")
    return None


@lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    log.warning(message)
