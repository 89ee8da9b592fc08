"""GGUF block weights in the formats the kernels run (FORMATS), kept in the file's own block
layout: read, checked, cached.

A decoding pass over a few tokens is bound by reading the weights: the embedded model's float32
weights are 540 MB, its GGUF blocks 96 MB. The compiled kernels (kernels.py, csrc/formats.h)
multiply float32 activations by the blocks directly, expanding each block in registers exactly
as the GGUF defines it.

Exactness: the blocks are taken from the GGUF file and put in the row order transformers uses
(it un-permutes the q and k projections of Llama GGUFs). On the transformers path
(``read_gguf_blocks``) every block matrix, de-quantised here, must equal transformers' float32
weight bit for bit, or it is not used; the direct path (``read_gguf_native``) has no float32
weights to check against, and rests on the kernels expanding every format as the gguf
package's reference does (tests/test_quant.py) and on giving the transformers path's logits
bit for bit on the embedded model (tests/test_loading.py). The kernels then differ from a float32 matmul of the same weights only in the order
of their additions (about 1e-6 relative), like any two BLAS libraries.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from parrot.gguf_file import GGUFFile, GGUFTensor, drop_pages

log = logging.getLogger("parrot.engine")

_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class Format(NamedTuple):
    """A block format the kernels run: a GGUF block as ggml defines it (ggml.h's type id, bytes
    of one block, weights it holds) under Parrot's name for it (the GGML type's, in lower case)."""

    name: str
    ggml_type: int
    block_bytes: int
    block_weights: int


# The block formats the kernels run, by name, in the order of csrc/formats.h's PARROT_FORMATS
# (which has their layouts): a format's number in the kernel library is its place here, and
# kernels.py checks that the library's table is this one when it loads it.
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("f32", 0, 4, 1), Format("f16", 1, 2, 1), Format("bf16", 30, 2, 1),
    Format("q4_0", 2, 18, 32), Format("q4_1", 3, 20, 32), Format("q5_0", 6, 22, 32), Format("q5_1", 7, 24, 32),
    Format("q8_0", 8, 34, 32), Format("q4_k", 12, 144, 256), Format("q5_k", 13, 176, 256), Format("q6_k", 14, 210, 256),
)}
GGUF_KINDS = {name.upper(): name for name in FORMATS}  # GGML type name -> format name


@dataclass
class BlockWeight:
    """One weight matrix [N, K] in the GGUF's own blocks: ``data`` uint8 [N, K / weights per block
    * bytes per block], the file's bytes as they are."""

    kind: str
    data: torch.Tensor
    # The 8-bit path's copy with 8 weight rows interleaved (Kernels.pack), where the format has one.
    packed: torch.Tensor | None = None
    # ``data`` is a view of a memory-mapped file (read_gguf_native), whose pages can be let go.
    mapped: bool = False
    # ``data`` is a copy made for this weight alone (read_gguf_native's reordered q and k rows),
    # which can be dropped once packed; blocks that callers may share are never dropped.
    private: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        f = FORMATS[self.kind]
        return self.data.shape[0], self.data.shape[1] // f.block_bytes * f.block_weights

    @property
    def nbytes(self) -> int:
        return getattr(self, "_nbytes", self.data.numel())

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, by the gguf package's reference de-quantisation."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        with np.errstate(invalid="ignore", over="ignore"):  # any bytes are blocks: inf and NaN scales too
            values = dequantize(self.data.numpy(), GGMLQuantizationType[self.kind.upper()])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    def release_blocks(self) -> None:
        """Let go of ``data``'s memory once the packed copy serves every pass: the pages of a
        memory-mapped file are handed back (madvise MADV_DONTNEED; they are read from the file
        again if ``data`` is touched), and a private copy in memory (the q and k projections,
        whose rows were reordered) is dropped: ``data`` then keeps its shape but no bytes, and
        only the packed copy may be used. Shared blocks in memory are left as they are."""
        if self.mapped:
            drop_pages(self.data.data_ptr(), self.data.data_ptr() + self.data.numel())
        elif self.private and self.packed is not None:
            self._nbytes = self.data.numel()
            self.data = torch.zeros(1, dtype=torch.uint8).expand(self.data.shape)

    def rows(self, index: torch.Tensor) -> "BlockWeight":
        return BlockWeight(self.kind, torch.from_numpy(self.data.numpy()[index.numpy()]))

    @staticmethod
    def pack(kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> "BlockWeight":
        """Q4_1 or Q8_0 blocks from their parts: qs ([N, K / 2] uint8 nibbles for Q4_1, [N, K] int8
        for Q8_0) and d, m ([N, K / 32], rounded to float16 as the GGUF stores them)."""
        n, blocks = d.shape
        fields = [d.half().contiguous().view(torch.uint8).view(n, blocks, 2)]
        if kind == "q4_1":
            assert m is not None
            fields.append(m.half().contiguous().view(torch.uint8).view(n, blocks, 2))
        fields.append(qs.contiguous().view(torch.uint8).view(n, blocks, -1))
        return BlockWeight(kind, torch.cat(fields, dim=-1).reshape(n, -1).contiguous())


def release_file_pages(blocks: dict[str, BlockWeight]) -> None:
    """Hand back every page of the file's tensor data once the mapped blocks are packed (or are
    read no more): :meth:`BlockWeight.release_blocks` keeps the pages a tensor shares with its
    neighbours, and reading a page back maps up to 64 KB around it, so about 3 MB of the embedded
    model's file stayed resident. A page touched later is read from the file again."""
    mapped = [b.data for b in blocks.values() if b.mapped]
    if mapped:
        drop_pages(min(d.data_ptr() for d in mapped), max(d.data_ptr() + d.numel() for d in mapped))


def _from_gguf_tensor(tensor: GGUFTensor) -> BlockWeight | None:
    """The blocks of a GGUF tensor of a type and shape the kernels run (None for others)."""
    kind = GGUF_KINDS.get(tensor.type)
    if kind is None or len(tensor.shape) != 2:
        return None
    with warnings.catch_warnings():  # a read-only memory map: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        weight = BlockWeight(kind, torch.from_numpy(np.ascontiguousarray(tensor.data)))
    return weight if weight.shape[1] % 32 == 0 else None  # the kernels read rows in units of 32 weights


def permuted_qk(config: Any) -> bool:
    """Whether a GGUF's q and k rows are in llama.cpp's permuted order: its converter permutes
    them for the LLaMA architecture (Llama, Mistral) only; a Qwen2 file keeps the checkpoint's
    order (llama.cpp rotates it NeoX-style instead), as transformers reads both."""
    return getattr(config, "model_type", "llama") in ("llama", "mistral")


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order transformers gives Llama q/k projections read from a GGUF (reverse of the permute)."""
    dim = n_rows // n_head // 2
    return torch.from_numpy(np.arange(n_rows).reshape(n_head, dim, 2).transpose(0, 2, 1).reshape(-1))


def read_gguf_blocks(gguf_path: str, hf_model: Any) -> dict[str, BlockWeight]:
    """Block weights of a Llama GGUF under transformers' parameter names, verified bit for bit
    against ``hf_model``'s float32 weights (a matrix that does not match is left out)."""
    config = hf_model.config
    params = dict(hf_model.named_parameters(remove_duplicate=False))  # tied lm_head too
    blocks: dict[str, BlockWeight] = {}
    for tensor in GGUFFile(gguf_path).tensors:
        weight = _from_gguf_tensor(tensor)
        if weight is None:
            continue
        parts = tensor.name.split(".")
        if tensor.name == "token_embd.weight":
            # The embedding lookup reads float32 rows; the blocks serve a tied output projection.
            names = ["lm_head.weight"] if getattr(config, "tie_word_embeddings", False) else []
        elif tensor.name == "output.weight":
            names = ["lm_head.weight"]
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            names = [f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"]
            if parts[2] in ("attn_q", "attn_k") and permuted_qk(config):
                heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
                weight = weight.rows(_unpermute_rows(weight.shape[0], heads))
        else:
            continue
        for name in names:
            reference = params.get(name)
            if reference is None or reference.dtype != torch.float32 or tuple(reference.shape) != weight.shape:
                continue
            if torch.equal(weight.dequantize(), reference.detach()):
                blocks[name] = weight
            else:
                log.warning("GGUF blocks of %s do not reproduce transformers' weights; using float32", name)
    return blocks


def save_blocks(blocks: dict[str, BlockWeight], path: str) -> None:
    from safetensors.torch import save_file

    tensors = {name: weight.data for name, weight in blocks.items()}
    kinds = ",".join(f"{name}={weight.kind}" for name, weight in blocks.items())
    save_file(tensors, path, metadata={"kinds": kinds})


def load_blocks(path: str) -> dict[str, BlockWeight]:
    from safetensors import safe_open

    blocks = {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for entry in filter(None, metadata.get("kinds", "").split(",")):
            name, kind = entry.split("=")
            blocks[name] = BlockWeight(kind, f.get_tensor(name))
    return blocks


# read_gguf_native's key for the file's rope_freqs.weight (no transformers parameter holds it)
ROPE_FACTORS = "rope_freqs.weight"

# A layer's norm weights in a GGUF, under transformers' names, by transformers model type (the
# rest of a layer is block matrices and biases). Llama's ffn_norm is its post_attention_layernorm
# (the norm before the MLP); Gemma 3 has a norm on attention's output (post_attention_norm) and
# on the MLP's (post_ffw_norm), and one per q and k head.
_GGUF_SMALL = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GGUF_NORMS = {
    "gemma3_text": {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
# Model types whose norm weights llama.cpp's converter stores as 1 + w (Gemma's RMSNorm multiplies
# by 1 + w; the file holds the factor): transformers subtracts the 1 when it reads them back
# (its Gemma2TensorProcessor), and so does read_gguf_native, so that both hold the same w.
NORMS_PLUS_ONE = ("gemma3_text",)
_GGUF_BIASES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}


def read_gguf_native(gguf_path: str, config: Any) -> tuple[dict[str, BlockWeight], dict[str, torch.Tensor]]:
    """A Llama-architecture (or Gemma 3) GGUF read for the compiled kernels without any float32 copy of its
    matrices: (block matrices under transformers' names, views of the memory-mapped file except
    the q and k projections, whose rows are put in transformers' order; the norms and biases as
    float32 tensors, and the RoPE factors under ``ROPE_FACTORS`` if the file has them). Raises ValueError for a matrix in a format the kernels do not run."""
    blocks: dict[str, BlockWeight] = {}
    small: dict[str, torch.Tensor] = {}
    model_type = getattr(config, "model_type", "llama")
    norms = _GGUF_NORMS.get(model_type, _GGUF_SMALL)
    plus_one = model_type in NORMS_PLUS_ONE
    gguf = GGUFFile(gguf_path)
    gguf.release_header()  # read once: the vocabulary's strings need not stay resident
    for tensor in gguf.tensors:
        parts = tensor.name.split(".")
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output.weight":
            name = "lm_head.weight"
        elif tensor.name == "output_norm.weight":
            small["model.norm.weight"] = _norm_weight(tensor, plus_one)
            continue
        elif tensor.name == "rope_freqs.weight":  # see gguf_rope_factors
            small[ROPE_FACTORS] = _floats(tensor)
            continue
        elif parts[0] == "blk" and parts[2] in norms and parts[3] == "weight":
            small[f"model.layers.{parts[1]}.{norms[parts[2]]}.weight"] = _norm_weight(tensor, plus_one)
            continue
        elif parts[0] == "blk" and parts[2] in _GGUF_BIASES and parts[3] == "bias":
            bias = _floats(tensor)
            if parts[2] in ("attn_q", "attn_k") and permuted_qk(config):
                heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
                bias = bias[_unpermute_rows(bias.shape[0], heads)]
            small[f"model.layers.{parts[1]}.{_GGUF_BIASES[parts[2]]}.bias"] = bias
            continue
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES and parts[3] == "weight":
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
        else:
            continue
        kind = GGUF_KINDS.get(tensor.type)
        if kind is None or len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name} is {tensor.type}, which the kernels do not run")
        if tensor.shape[1] % 32:  # the kernels read rows in units of 32 weights
            raise ValueError(f"{tensor.name} has rows of {tensor.shape[1]} weights, which the kernels do not run")
        with warnings.catch_warnings():  # a read-only memory map: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            weight = BlockWeight(kind, torch.from_numpy(tensor.data), mapped=True)
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k") and permuted_qk(config):
            heads = config.num_attention_heads if parts[2] == "attn_q" else config.num_key_value_heads
            mapped, weight = weight, weight.rows(_unpermute_rows(weight.shape[0], heads))
            weight.private = True
            mapped.release_blocks()  # the file's pages, read once for the copy
        blocks[name] = weight
    return blocks, small


def gguf_rope_factors(gguf_path: str) -> torch.Tensor | None:
    """The file's ``rope_freqs.weight``, or None. Llama 3.1 and later scale RoPE ("llama3" in
    transformers' configs); llama.cpp's converter writes that scaling as one factor per
    frequency, which the frequency is divided by, and no metadata that transformers reads back."""
    tensor = GGUFFile(gguf_path).tensor(ROPE_FACTORS)
    return None if tensor is None else _floats(tensor)


def gguf_rope_scaling(gguf_path: str) -> dict[str, Any] | None:
    """The RoPE scaling a GGUF's metadata states (``{arch}.rope.scaling.type`` and ``.factor``),
    as transformers' rope parameters, or None. llama.cpp's converter writes Gemma 3's linear
    scaling of its global layers (4B and larger: factor 8) this way, and transformers' GGUF reader
    does not read it back."""
    gguf = GGUFFile(gguf_path)
    kind = gguf.get(f"{gguf.architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": kind, "factor": float(gguf.get(f"{gguf.architecture}.rope.scaling.factor", 1.0))}


def apply_rope_scaling(config: Any, scaling: dict[str, Any]) -> bool:
    """Put a GGUF's RoPE scaling (gguf_rope_scaling) into a Gemma 3 config that lacks it: on its
    global layers, as transformers' Gemma 3 configs and llama.cpp scale them (the sliding-window
    layers keep theirs). True if the config changed; other model types are left as they are."""
    if getattr(config, "model_type", None) != "gemma3_text":
        return False
    if scaling["rope_type"] != "linear":
        raise ValueError(f"the GGUF scales RoPE by {scaling['rope_type']!r}; Gemma 3 files scale it linearly")
    parameters = {kind: dict(values) for kind, values in (getattr(config, "rope_parameters", None) or {}).items()}
    full = parameters.setdefault("full_attention", {"rope_type": "default"})
    if full.get("rope_type", "default") != "default":
        return False  # the config has a scaling of its own
    full.update(scaling)
    config.rope_parameters = parameters
    return True


def apply_rope_factors(rotary: Any, factors: torch.Tensor) -> None:
    """Divide a transformers rotary module's frequencies by a GGUF's ``rope_freqs`` factors."""
    if getattr(rotary, "rope_type", "default") != "default":
        raise ValueError(f"rope_freqs on top of {rotary.rope_type} rope scaling")
    if tuple(factors.shape) != tuple(rotary.inv_freq.shape):
        raise ValueError(f"rope_freqs has {factors.numel()} factors for {rotary.inv_freq.numel()} frequencies")
    inv_freq = rotary.inv_freq / factors.to(rotary.inv_freq)
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq.clone()


def _norm_weight(tensor: GGUFTensor, plus_one: bool) -> torch.Tensor:
    """A norm's weight as transformers holds it: the file's, less 1 where the file stores 1 + w
    (the float32 subtraction transformers makes; its forward adds the 1 back)."""
    return _floats(tensor) - 1 if plus_one else _floats(tensor)


def _floats(tensor: GGUFTensor) -> torch.Tensor:
    raw = np.asarray(tensor.data)
    if tensor.type == "F32":
        values = raw.view(np.float32)
    else:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(raw, GGMLQuantizationType[tensor.type])
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1))
