"""GGUF block weights (Q4_1, Q8_0): read from the file, checked, cached, de-quantised.

A decoding pass over a few tokens is bound by reading the weights: the embedded model's float32
weights are 540 MB, its GGUF blocks 76 MB. The compiled kernels (kernels.py, csrc/kernels.cpp)
multiply float32 activations by the blocks directly, expanding each block in registers exactly
as the GGUF defines it.

Exactness: the blocks are taken from the GGUF file, put in the row order transformers uses (it
un-permutes the q and k projections of Llama GGUFs), and checked at conversion time: every
block matrix, de-quantised here, must equal transformers' float32 weight bit for bit, or it is
not used. The kernels then differ from a float32 matmul of the same weights only in the order
of their additions (about 1e-6 relative), like any two BLAS libraries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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


@dataclass
class BlockWeight:
    """One weight matrix [N, K] in Q4_1 (qs [N, K/2] uint8, d and m [N, K/32]) or Q8_0 (qs int8, d)."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return (n, self.qs.shape[1] * 2) if self.kind == "q4_1" else (n, self.qs.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weights, computed as the GGUF reference does (d * q, then + m)."""
        n, k = self.shape
        if self.kind == "q8_0":
            return (self.d[:, :, None] * self.qs.view(n, k // 32, 32).float()).reshape(n, k)
        assert self.m is not None
        packed = self.qs.view(n, k // 32, 16)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # low nibbles are values 0..15
        return (self.d[:, :, None] * q + self.m[:, :, None]).reshape(n, k)

    def rows(self, index: torch.Tensor) -> "BlockWeight":
        return BlockWeight(self.kind, self.qs[index].contiguous(), self.d[index].contiguous(),
                           None if self.m is None else self.m[index].contiguous())

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        kinds = {p.kind for p in parts}
        assert len(kinds) == 1
        m = None if parts[0].m is None else torch.cat([p.m for p in parts if p.m is not None])
        return BlockWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.qs": self.qs, f"{prefix}.d": self.d}
        if self.m is not None:
            out[f"{prefix}.m"] = self.m
        return out


def _from_gguf_tensor(tensor: Any) -> BlockWeight | None:
    """Unpack a GGUF tensor of type Q4_1 or Q8_0 (None for other types)."""
    kind = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    n = data.shape[0]
    if kind == "Q4_1":  # 20-byte blocks: d (f16), m (f16), 16 bytes of nibbles
        blocks = data.reshape(n, -1, 20)
        d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
        qs = np.ascontiguousarray(blocks[:, :, 4:]).reshape(n, -1)
        return BlockWeight("q4_1", torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m))
    if kind == "Q8_0":  # 34-byte blocks: d (f16), 32 signed bytes
        blocks = data.reshape(n, -1, 34)
        d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(n, -1)
        return BlockWeight("q8_0", torch.from_numpy(qs), torch.from_numpy(d))
    return None


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order transformers gives Llama q/k projections read from a GGUF (reverse of the permute)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def read_gguf_blocks(gguf_path: str, hf_model: Any) -> dict[str, BlockWeight]:
    """Block weights of a Llama GGUF under transformers' parameter names, verified bit for bit
    against ``hf_model``'s float32 weights (a matrix that does not match is left out)."""
    from gguf import GGUFReader

    config = hf_model.config
    params = dict(hf_model.named_parameters(remove_duplicate=False))  # tied lm_head too
    reader = GGUFReader(gguf_path)
    blocks: dict[str, BlockWeight] = {}
    for tensor in reader.tensors:
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
            if parts[2] in ("attn_q", "attn_k"):
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

    tensors: dict[str, torch.Tensor] = {}
    kinds = {}
    for name, weight in blocks.items():
        tensors.update(weight.tensors(name))
        kinds[name] = weight.kind
    save_file(tensors, path, metadata={"kinds": ",".join(f"{k}={v}" for k, v in kinds.items())})


def load_blocks(path: str) -> dict[str, BlockWeight]:
    from safetensors import safe_open

    blocks = {}
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        for entry in filter(None, metadata.get("kinds", "").split(",")):
            name, kind = entry.split("=")
            m = f.get_tensor(f"{name}.m") if kind == "q4_1" else None
            blocks[name] = BlockWeight(kind, f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.d"), m)
    return blocks
