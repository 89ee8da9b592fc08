"""Parrot's own forward pass for Llama-family and Gemma 3 models, with a preallocated KV cache
per sequence.

Why not call the transformers model: on CPUs a transformers forward spends much of its time
outside the arithmetic (`DynamicCache` re-concatenates the whole cache every step, and MKL's
`sgemm` repacks every weight on every call; docs/ARCHITECTURE.md, "The forward pass", has the measurements).
Here:

- with GGUF blocks for every linear layer (the usual case on CPU), every pass, prompt chunks
  included (in pieces of PIECE rows), is one call of the compiled kernels (kernels.py,
  csrc/model.h: norms, block linears, RoPE, attention, SiLU or GELU, residuals), which computes
  every row on its own, so a token's logits and KV are the same bit for bit alone, with a draft,
  or however its prompt was chunked (what the prefix cache relies on);
- otherwise (no blocks, or not on CPU) sequences feeding up to 32 tokens go through the block
  kernels where there are some and the attention kernel, and longer prompt chunks through
  float32 weights, fused (q|k|v, gate|up) and, on CPU, packed once for oneDNN, and SDPA;
- the KV cache is one tensor per sequence, written in place; cropping it is setting a length.
  Sliding-window layers keep every position too (the window is applied when attending), so a
  cache crops back to any length after a rejected draft.

The weights, rotary tables and normalisation come from the loaded transformers model, so the
arithmetic is the same as transformers' up to the order of additions (same RMSNorm formula, the
model's own rotary tables). Several sequences can be fed in one pass: the linear layers run over
all their new tokens together and attention runs per sequence. How a model type's layers differ
from Llama's is one row of ``FAMILIES``.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from parrot.engine.backend import KVLayout
from parrot.engine.kernels import ACTIVATIONS, Kernels, LayerDesc, ModelDesc, SeqDesc, mats
from parrot.engine.kernels import kernels as load_kernels
from parrot.engine.quant import BlockWeight


@dataclass(frozen=True)
class Family:
    """How a transformers model type's decoder differs from Llama's, as far as this forward runs it."""

    # RMSNorm multiplies by 1 + w, in float32, before casting back (Gemma), rather than by w
    # after casting back (Llama).
    norm_plus_one: bool = False
    # Norms on attention's and the MLP's outputs before their residuals (post_attention_layernorm
    # and post_feedforward_layernorm), and pre_feedforward_layernorm before the MLP; without them
    # post_attention_layernorm is the norm before the MLP (Llama).
    output_norms: bool = False
    qk_norms: bool = False  # an RMSNorm over each q and k head before RoPE (q_norm, k_norm)
    embed_scale: bool = False  # token rows times sqrt(hidden_size), cast to the model's dtype
    # config.layer_types picks each layer's attention: "sliding_attention" (config.sliding_window
    # positions, RoPE by rope_parameters["sliding_attention"]) or "full_attention"
    # (rope_parameters["full_attention"]).
    layer_types: bool = False


LLAMA = Family()
GEMMA3 = Family(norm_plus_one=True, output_norms=True, qk_norms=True, embed_scale=True, layer_types=True)
# transformers model types the forward runs (a Gemma 3 GGUF converts to "gemma3_text")
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma3_text": GEMMA3}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# Layer types, by transformers' names: attention over every position before a query, or over a
# sliding window of config.sliding_window positions. Models without config.layer_types have FULL
# layers only.
FULL = "full_attention"
SLIDING = "sliding_attention"
# Rows per sequence up to which the block kernels beat float32 GEMM (measured on the embedded
# model): for models without the whole compiled pass, longer prompt chunks go through GEMM.
SMALL_ROWS = 32
# Where the whole pass is compiled, every row goes through it (a row's arithmetic must not depend
# on how its prompt was chunked: with 8-bit activations GEMM rows differ by ~1 logit), longer
# chunks in pieces of PIECE rows per sequence: the vector tiles keep a piece's x in L2 while
# they stream the weights (Qwen2.5-Coder-1.5B, a 512-token chunk on AVX-512, Intel Xeon:
# 3.24-3.35 s in pieces of 64, 3.41-3.54 s in one). The amx kernel set (csrc/amx.h) expands each
# weight block once per call and passes every row through it, so it takes the whole chunk
# (2.07-2.12 s; pieces of 256: 2.19-2.31 s, of 128: 2.30-2.39 s). The attention kernel bounds its
# own scratch (64 rows a call).
PIECE = 64
PIECE_BY_KERNELS = {"amx": 512}


def activation(config: Any) -> str:
    """The gated MLP's activation, by its transformers name (Gemma's configs say hidden_activation)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


def layer_types(config: Any) -> list[str]:
    """Each layer's attention type: FULL or SLIDING (config.layer_types for the families that read it)."""
    family = FAMILIES.get(config.model_type, LLAMA)
    if family.layer_types and getattr(config, "layer_types", None):
        return list(config.layer_types)
    return [FULL] * config.num_hidden_layers


def native_support(hf_model: Any) -> str | None:
    """None when ``LlamaForward`` can run this model, else what it does not run."""
    config = hf_model.config
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"model type {config.model_type!r} (native forward covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if activation(config) not in ACTIVATIONS:
        return f"activation {activation(config)!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name.replace('_', ' ')} ({getattr(config, name)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if not family.layer_types:
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return "sliding-window attention"
        return None
    kinds = layer_types(config)
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {FULL, SLIDING}:
        return f"layer types {sorted(set(kinds))} for {config.num_hidden_layers} layers"
    if SLIDING in kinds and not getattr(config, "sliding_window", None):
        return "sliding-window layers without a window size"
    return None


class RotaryTables:
    """transformers' default rotary embedding for a Llama-family config (or one layer type of a
    Gemma 3 config): the same float32 operations, so the same tables bit for bit (tested),
    without importing transformers' modelling code (34 MB resident that a GGUF on the kernels
    does not use). The power, cosine and sine go through torch, whose kernels decide their last
    bits; the divisions and products, correctly rounded in any library, through NumPy: each torch
    operation a process first runs pages in its code, and these would add 3 MB to the resident
    memory."""

    rope_type = "default"

    def __init__(self, config: Any, layer_type: str | None = None) -> None:
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = _rope_parameters(config, layer_type)["rope_theta"]
        # 1 / base ** (arange(0, dim, 2) / dim), as transformers writes it in torch
        exponents = torch.from_numpy(np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        self.inv_freq = torch.from_numpy(np.float32(1.0) / torch.pow(base, exponents).numpy())
        self.original_inv_freq = torch.from_numpy(self.inv_freq.numpy().copy())

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.cpu().numpy()[..., None].astype(np.float32) * self.inv_freq.cpu().numpy()
        emb = torch.from_numpy(np.concatenate((freqs, freqs), axis=-1)).to(x.device)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE's parameters; ``layer_type``: those of one layer type where the config has them per
    type (Gemma 3: rope_parameters["sliding_attention"] and ["full_attention"])."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        parameters = dict(parameters[layer_type])
    parameters.setdefault("rope_type", "default")
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return parameters


Rotary = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (x, positions) -> cos, sin


def _rotaries(config: Any, rotary: Any) -> dict[str, Rotary]:
    """The rotary tables' function of each layer type the model has, from its rotary module:
    transformers' (Gemma 3's takes the layer type), or ``weightless_model``'s dict of
    RotaryTables by layer type."""
    kinds = sorted(set(layer_types(config)))
    if isinstance(rotary, dict):
        return {kind: rotary[kind] for kind in kinds}
    if FAMILIES[config.model_type].layer_types:
        return {kind: functools.partial(rotary, layer_type=kind) for kind in kinds}
    return {kind: rotary for kind in kinds}


# Rope types whose tables depend on the range of positions asked for (transformers picks the
# frequencies from the longest position): their tables are computed whole, at start-up.
RANGE_DEPENDENT_ROPE = ("dynamic", "longrope")


def _untouched(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor; on CPU an anonymous memory mapping, whose pages
    take no memory until written (a heap allocation may land on pages resident already)."""
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=dtype, device=device)
    count = rows * cols
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(rows, cols)  # keeps buffer alive


def weightless_model(config: Any, small: dict[str, torch.Tensor]) -> Any:
    """What ``LlamaForward`` reads of a transformers model, for a GGUF whose matrices are all
    blocks: the config, shapes (meta tensors), norms and biases (``small``, by transformers'
    parameter names) and rotary tables. None where the config scales RoPE its own way (then
    transformers' modules are needed for the tables)."""
    from types import SimpleNamespace as Node

    kinds = sorted(set(layer_types(config)))
    per_type = FAMILIES[config.model_type].layer_types
    if any(_rope_parameters(config, kind if per_type else None)["rope_type"] != "default" for kind in kinds):
        return None
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads

    def linear(name: str, rows: int, cols: int) -> Any:
        return Node(weight=torch.empty(rows, cols, device="meta"), bias=small.get(f"{name}.bias"), out_features=rows)

    def norm(name: str) -> Any:
        return Node(weight=small[name]) if name in small else None

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = Node(q_proj=linear(p + "self_attn.q_proj", heads * head_dim, hidden),
                    k_proj=linear(p + "self_attn.k_proj", kv_heads * head_dim, hidden),
                    v_proj=linear(p + "self_attn.v_proj", kv_heads * head_dim, hidden),
                    o_proj=linear(p + "self_attn.o_proj", hidden, heads * head_dim),
                    q_norm=norm(p + "self_attn.q_norm.weight"), k_norm=norm(p + "self_attn.k_norm.weight"))
        mlp = Node(gate_proj=linear(p + "mlp.gate_proj", config.intermediate_size, hidden),
                   up_proj=linear(p + "mlp.up_proj", config.intermediate_size, hidden),
                   down_proj=linear(p + "mlp.down_proj", hidden, config.intermediate_size))
        layers.append(Node(self_attn=attn, mlp=mlp, input_layernorm=norm(p + "input_layernorm.weight"),
                           post_attention_layernorm=norm(p + "post_attention_layernorm.weight"),
                           pre_feedforward_layernorm=norm(p + "pre_feedforward_layernorm.weight"),
                           post_feedforward_layernorm=norm(p + "post_feedforward_layernorm.weight")))
    rotary: Any = ({kind: RotaryTables(config, kind) for kind in kinds} if per_type else RotaryTables(config))
    inner = Node(embed_tokens=Node(weight=torch.empty(config.vocab_size, hidden, device="meta")), layers=layers,
                 norm=Node(weight=small["model.norm.weight"]), rotary_emb=rotary)
    return Node(config=config, model=inner, lm_head=linear("lm_head", config.vocab_size, hidden))


class PackedLinear:
    """``y = x @ W.T + b`` with the weight packed once for oneDNN on CPU (plain matmul elsewhere)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach().contiguous()
        self.bias = bias.detach().contiguous() if bias is not None else None
        self.packed = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
        if self.packed:
            try:
                # The batch-size hint only guides the blocked layout; any row count works.
                self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
            except RuntimeError:
                self.packed = False
        if not self.packed:
            self.weight = weight
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Linear:
    """A linear layer with float32 packed weights and, when available, GGUF block weights.

    ``rows(x, small)``: the block kernel for ``small`` row groups (few tokens of a sequence, where
    reading the weights dominates), float32 GEMM otherwise. Which one a row goes through depends
    only on how many tokens its own sequence feeds, never on the rest of the batch.
    """

    def __init__(self, names: Sequence[str], modules: Sequence[torch.nn.Linear], blocks: dict[str, BlockWeight],
                 kernels: Kernels | None, q8: bool = False, fine: bool = False) -> None:
        biases = [m.bias for m in modules]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([b if b is not None else m.weight.new_zeros(m.out_features)
                                   for m, b in zip(modules, biases)]).detach().contiguous()
        # The float32 weights, packed for GEMM when first needed (never, where every pass is
        # compiled: LlamaForward then drops the modules and the model's float32 weights can go).
        self.modules: Sequence[torch.nn.Linear] | None = modules
        self._dense: PackedLinear | None = None
        self.kernels = kernels
        self.q8 = q8
        self.fine = fine  # with q8: x rounded with a factor per 32 too, as the compiled pass rounds the LM head's
        # Block weights, as parts along N, each as the GGUF has it (q, k, v may differ in format:
        # Q4_K_M files keep v in Q6_K on some layers). Not concatenated: that would copy them;
        # the kernels run every part of a layer in one parallel job.
        self.blocks: list[BlockWeight] | None = None
        parts = [blocks[name] for name in names if name in blocks]
        if kernels is not None and len(parts) == len(names):
            self.blocks = parts
        self._mats: list[Any] = []

    @property
    def dense(self) -> PackedLinear:
        if self._dense is None:
            assert self.modules is not None, "float32 weights were dropped"
            weight = torch.cat([m.weight for m in self.modules]) if len(self.modules) > 1 else self.modules[0].weight
            self._dense = PackedLinear(weight, self.bias)
        return self._dense

    def __call__(self, x: torch.Tensor, small: bool = False) -> torch.Tensor:
        if small and self.blocks is not None and self.kernels is not None:
            return self.kernels.linear(x, self.blocks, self.bias, q8=self.q8, fine=self.fine)
        return self.dense(x)

    def mat(self) -> Any:
        """The head of this layer's chain of block matrices for the kernels (kept alive here)."""
        assert self.blocks is not None
        if self.q8 and self.kernels is not None:
            for part in self.blocks:
                self.kernels.pack(part)
        self._mats = mats(self.blocks, self.bias)
        return self._mats[0]


class _Layer:
    def __init__(self, index: int, layer: Any, blocks: dict[str, BlockWeight], kernels: Kernels | None,
                 q8: bool, family: Family, kind: str, window: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        p = f"model.layers.{index}."
        names = {n: f"{p}{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        self.qkv = Linear([names["self_attn.q_proj"], names["self_attn.k_proj"], names["self_attn.v_proj"]],
                          [attn.q_proj, attn.k_proj, attn.v_proj], blocks, kernels, q8)
        self.o = Linear([names["self_attn.o_proj"]], [attn.o_proj], blocks, kernels, q8)
        self.gate_up = Linear([names["mlp.gate_proj"], names["mlp.up_proj"]], [mlp.gate_proj, mlp.up_proj], blocks,
                              kernels, q8)
        self.down = Linear([names["mlp.down_proj"]], [mlp.down_proj], blocks, kernels, q8)
        self.kind = kind  # FULL or SLIDING: which rotary tables
        self.window = window  # positions a query sees, itself included; 0: all
        # Norm weights as the factors the normalised values are multiplied by (read in place by
        # the kernels); None where the family has no such norm.
        norm = functools.partial(_norm_factor, family=family)
        self.input_norm = norm(layer.input_layernorm)
        self.attn_post_norm = self.ffn_post_norm = self.q_norm = self.k_norm = None
        if family.output_norms:
            self.ffn_norm = norm(layer.pre_feedforward_layernorm)
            self.attn_post_norm = norm(layer.post_attention_layernorm)
            self.ffn_post_norm = norm(layer.post_feedforward_layernorm)
        else:
            self.ffn_norm = norm(layer.post_attention_layernorm)
        if family.qk_norms:
            self.q_norm, self.k_norm = norm(attn.q_norm), norm(attn.k_norm)


def _norm_factor(module: Any, family: Family) -> torch.Tensor:
    """A norm's weight as the factor it multiplies by: Gemma's 1 + w (in float32, as transformers
    computes it), Llama's w."""
    if module is None or module.weight is None:
        raise ValueError("a norm weight the model type has is missing")
    weight = module.weight.detach()
    return (1.0 + weight.float()).contiguous() if family.norm_plus_one else weight.contiguous()


class _Route:
    """Sends each sequence's rows through the block kernel (few rows) or float32 GEMM (many)."""

    def __init__(self, all_small: bool | None, small_rows: torch.Tensor | None = None,
                 large_rows: torch.Tensor | None = None) -> None:
        self.all_small = all_small  # True / False: every row one way; None: mixed
        self.small_rows = small_rows
        self.large_rows = large_rows

    @staticmethod
    def of(lengths: Sequence[int], small: Sequence[bool], device: torch.device) -> "_Route":
        if all(small) or not any(small):
            return _Route(all(small))
        small_rows: list[int] = []
        large_rows: list[int] = []
        offset = 0
        for n, is_small in zip(lengths, small):
            (small_rows if is_small else large_rows).extend(range(offset, offset + n))
            offset += n
        return _Route(None, torch.tensor(small_rows, device=device), torch.tensor(large_rows, device=device))

    def apply(self, linear: "Linear", x: torch.Tensor) -> torch.Tensor:
        if self.all_small is not None:
            return linear(x, small=self.all_small)
        assert self.small_rows is not None and self.large_rows is not None
        a = linear(x[self.small_rows], small=True)
        b = linear(x[self.large_rows], small=False)
        out = a.new_empty(x.shape[0], a.shape[1])
        out[self.small_rows] = a
        out[self.large_rows] = b
        return out


class KVCache:
    """Keys and values of one sequence: ``[layers, kv_heads, capacity, head_dim]``, grown on demand."""

    def __init__(self, forward: "LlamaForward", capacity: int) -> None:
        self._forward = forward
        self.length = 0
        capacity = max(1, min(capacity, forward.max_positions))
        shape = (forward.num_layers, forward.num_kv_heads, capacity, forward.head_dim)
        self.k = torch.empty(shape, dtype=forward.kv_dtype, device=forward.device)
        self.v = torch.empty(shape, dtype=forward.kv_dtype, device=forward.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, length: int) -> None:
        if length > self._forward.max_positions:
            raise ValueError(f"sequence of {length} tokens exceeds the context window ({self._forward.max_positions})")
        if length <= self.capacity:
            return
        capacity = min(max(length, 2 * self.capacity), self._forward.max_positions)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on (rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length


class LlamaForward:
    """Forward passes of a Llama-family or Gemma 3 transformers model over ``KVCache`` objects."""

    def __init__(self, hf_model: Any, max_positions: int, blocks: dict[str, BlockWeight] | None = None,
                 isa: str | None = None, activations: str = "q8") -> None:
        """``blocks``: GGUF block weights by parameter name (see quant.py), used for small passes
        when the compiled kernels are available on this CPU; ``isa``: which kernel set (default:
        the best this CPU runs, see kernels.py); ``activations``: "q8" to round the block
        kernels' inputs to 8 bits (faster), "float32" to keep them."""
        reason = native_support(hf_model)
        if reason is not None:
            raise ValueError(f"native forward does not support {reason}")
        config = hf_model.config
        inner = hf_model.model
        self.family = FAMILIES[config.model_type]
        self.device = inner.embed_tokens.weight.device
        if self.device.type == "meta":  # a weightless model (backends/native.py, load_onto_kernels): blocks only
            self.device = torch.device("cpu")
        self.dtype = inner.embed_tokens.weight.dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.max_positions = max_positions
        self.vocab_size = config.vocab_size
        kernels = None
        if self.device.type == "cpu" and self.dtype == torch.float32:
            kernels = load_kernels(isa)
        self.kernels = kernels
        # Attention of decoding passes through the compiled kernel where it covers the head
        # shape; prompt chunks and everything else through SDPA.
        self.attention_kernel = None
        if kernels is not None and kernels.attention_supports(self.head_dim, self.num_heads, self.num_kv_heads):
            self.attention_kernel = kernels
        # Gemma scales scores by query_pre_attn_scalar ** -0.5 (its 270M: head_dim ** -0.5 too)
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.activation = activation(config)
        # Token rows times sqrt(hidden) where the family scales them; transformers casts the
        # factor to the model's dtype first (Gemma 3 in bfloat16 multiplies by 25.25, not 25.298).
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5 if self.family.embed_scale else 1.0).to(self.dtype)
        if activations not in ("q8", "float32"):
            raise ValueError(f"activations must be q8 or float32, got {activations!r}")
        self.activations = activations
        q8 = activations == "q8"
        blocks = blocks or {}
        self._embed_blocks = blocks.get("model.embed_tokens.weight") if kernels is not None else None
        kinds = layer_types(config)
        window = int(getattr(config, "sliding_window", None) or 0)
        with torch.inference_mode():
            self.embed: torch.Tensor | None = inner.embed_tokens.weight.detach().contiguous()
            self.layers = [_Layer(i, layer, blocks, kernels, q8, self.family, kind, window if kind == SLIDING else 0)
                           for i, (layer, kind) in enumerate(zip(inner.layers, kinds))]
            self.final_norm = _norm_factor(inner.norm, self.family)
            self.lm_head = Linear(["lm_head.weight"], [hf_model.lm_head], blocks, kernels, q8, fine=True)
            # Rotary tables [positions, head_dim] per layer type, computed by the model's own
            # rotary module (it knows the rope scaling type) as far as sequences reach (_fill_rope).
            self._rotaries = _rotaries(config, inner.rotary_emb)
            self._tables = {kind: (_untouched(max_positions, self.head_dim, self.dtype, self.device),
                                   _untouched(max_positions, self.head_dim, self.dtype, self.device))
                            for kind in self._rotaries}
            self._rope_rows = 0
            per_type = self.family.layer_types
            whole = any(_rope_parameters(config, kind if per_type else None)["rope_type"] in RANGE_DEPENDENT_ROPE
                        or getattr(inner.rotary_emb, "rope_type", "default") in RANGE_DEPENDENT_ROPE
                        for kind in self._rotaries)
            self._fill_rope(max_positions if whole else 1)
        self.block_kernels = kernels is not None and all(
            linear.blocks is not None for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        # The whole decoding pass in one kernel call, where every linear layer has blocks.
        # The 8-bit path keeps its KV cache in float16, as llama.cpp does by default: a one-token
        # pass at 1,000 tokens of context reads half the cache's bytes. Elsewhere the model's dtype.
        self.native: ModelDesc | None = None
        self.kv_dtype = self.dtype
        if self.block_kernels and self.attention_kernel is not None and self.lm_head.blocks is not None:
            self.kv_dtype = torch.float16 if q8 else self.dtype
            self.native = self._describe(config)
            for linear in self._linears():
                linear.modules = None
                # Passes read the packed copies (8-bit path), and token rows of a tied embedding
                # are rebuilt from them too: the blocks they were made from can go.
                for part in linear.blocks or []:
                    if part.packed is not None:
                        part.release_blocks()
            if self.native.embed_blocks:  # the tied LM head's blocks serve the embedding too
                self.embed = None
        # Only the compiled pass computes every row on its own (prompt chunks too): the torch path
        # sends chunks of over SMALL_ROWS rows through GEMM and SDPA, whose results depend on the
        # chunk's shape, so there a position's KV depends on how its prompt was chunked.
        self.kv_layout: KVLayout | None = None
        if self.native is not None:
            self.kv_layout = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def cos(self) -> torch.Tensor:
        """The rotary cosines of full-attention layers (Llama's only table)."""
        return self._tables[FULL][0] if FULL in self._tables else next(iter(self._tables.values()))[0]

    @property
    def sin(self) -> torch.Tensor:
        return self._tables[FULL][1] if FULL in self._tables else next(iter(self._tables.values()))[1]

    def _describe(self, config: Any) -> ModelDesc:
        """The kernel library's view of the model; its pointers stay valid while self lives.
        With tied embeddings in one block format, token rows are expanded from the LM head's
        blocks (the GGUF's token_embd), and no float32 embedding is kept."""
        embed = self._embed_blocks
        tied = getattr(config, "tie_word_embeddings", False) and self.lm_head.blocks is not None and len(self.lm_head.blocks) == 1
        if embed is None and tied and self.lm_head.blocks:
            embed = self.lm_head.blocks[0]
        lm_head = self.lm_head.mat()  # packs it first: a tied embedding's rows come from the packed copy
        self._embed_mats = mats([embed]) if embed is not None else []

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self._layer_descs = (LayerDesc * self.num_layers)(*[
            LayerDesc(layer.qkv.mat(), layer.o.mat(), layer.gate_up.mat(), layer.down.mat(),
                      ptr(layer.input_norm), ptr(layer.ffn_norm), ptr(layer.attn_post_norm), ptr(layer.ffn_post_norm),
                      ptr(layer.q_norm), ptr(layer.k_norm),
                      self._tables[layer.kind][0].data_ptr(), self._tables[layer.kind][1].data_ptr(), layer.window)
            for layer in self.layers
        ])
        return ModelDesc(
            num_layers=self.num_layers, hidden=config.hidden_size, heads=self.num_heads, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=config.intermediate_size, vocab=self.vocab_size,
            max_positions=self.max_positions, eps=self.eps, scale=self.scale, embed_scale=float(self.embed_scale),
            threads=1, q8=int(self.activations == "q8"), kv16=int(self.kv_dtype == torch.float16),
            act=ACTIVATIONS[self.activation],
            embed=None if self._embed_mats or self.embed is None else self.embed.data_ptr(),
            embed_blocks=ctypes.pointer(self._embed_mats[0]) if self._embed_mats else None,
            final_norm=self.final_norm.data_ptr(), lm_head=lm_head, layers=self._layer_descs,
        )

    def _fill_rope(self, positions: int) -> None:
        """Have the rotary tables hold their first ``positions`` rows. Rows are computed when a
        sequence first reaches them, 256 at a time (about 80 us); the operations are elementwise,
        so the rows are the ones a whole table gives, bit for bit (tested). A whole table costs
        4 MB for the embedded model's 8k context window and 64 MB for a 128k one, resident from
        start-up though few requests reach that far."""
        if positions <= self._rope_rows:
            return
        end = min(self.max_positions, -(-positions // 256) * 256)
        # On one thread: the first torch.cos of a process, split over two OpenMP threads, now and
        # then gave the second thread's half errors up to 1.5e-4 instead of 4e-8 (torch 2.13.0,
        # Intel Xeon, 2 threads: 4 processes of 20; later calls were exact). Rows 128-255 of the
        # table, computed at load, then stayed wrong for the process's life, so the same prompt's
        # logits differed between two server starts.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                rows = torch.from_numpy(np.arange(self._rope_rows, end)).to(self.device)[None]
                for kind, rotary in self._rotaries.items():
                    cos, sin = rotary(torch.empty(1, dtype=self.dtype, device=self.device), rows)
                    self._tables[kind][0][self._rope_rows : end] = cos[0]
                    self._tables[kind][1][self._rope_rows : end] = sin[0]
        finally:
            torch.set_num_threads(threads)
        self._rope_rows = end

    def _linears(self) -> list[Linear]:
        return [linear for layer in self.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def pass_report(self, context: int) -> dict[str, float]:
        """What a one-token decoding pass at ``context`` cached positions must read (the block
        weights, or float32 ones without them, and the KV cache), the memory bandwidth measured
        now, and their ratio: the floor of the pass's time."""
        linears = self._linears()
        weight_bytes = sum(sum(b.nbytes for b in lin.blocks) if lin.blocks is not None else lin.dense.nbytes
                           for lin in linears)
        # a sliding-window layer reads its window's positions only
        positions = sum(min(context, layer.window) if layer.window else context for layer in self.layers)
        kv_bytes = 2 * positions * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize
        bandwidth = self.kernels.read_bandwidth() if self.kernels is not None else float("nan")
        total = weight_bytes + kv_bytes
        return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes_per_pass": total,
                "bandwidth": bandwidth, "floor_ms": 1e3 * total / bandwidth}

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self, capacity)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), computed in float32.
        # One fused kernel instead of six small ones (they cost ~3 ms per pass on 2 cores).
        # Gemma's multiplies by its factor (1 + w, float32) before casting back.
        if self.family.norm_plus_one:
            return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * weight).to(x.dtype)
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * weight

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[KVCache, Sequence[int], int]]) -> list[torch.Tensor]:
        """Feed ``tokens`` to each ``cache`` in one pass; return each one's last ``num_logits`` logits.

        Each entry is ``(cache, tokens, num_logits)``. The caches grow by ``len(tokens)``.
        Returns one ``[num_logits, vocab]`` float tensor per entry. Where the model has the
        compiled pass, every sequence goes through it (longer ones in pieces: PIECE);
        otherwise through torch, few-token sequences on the block and attention kernels. Either
        way a sequence's result depends only on its own tokens.
        """
        self._fill_rope(max(cache.length + len(tokens) for cache, tokens, _ in batch))
        if self.native is None:
            return self._torch_forward(batch)
        # Pieces of at most PIECE tokens per sequence, one compiled pass per round of pieces;
        # each piece asks for the logits of its rows among the sequence's last num_logits.
        piece = PIECE_BY_KERNELS.get(self.kernels.isa, PIECE) if self.kernels is not None else PIECE
        done = [0] * len(batch)
        results: list[list[torch.Tensor]] = [[] for _ in batch]
        while True:
            round_: list[tuple[int, Sequence[int], int]] = []
            for i, (_, tokens, num_logits) in enumerate(batch):
                if done[i] < len(tokens):
                    start, end = done[i], min(done[i] + piece, len(tokens))
                    round_.append((i, tokens[start:end], end - max(start, min(end, len(tokens) - num_logits))))
                    done[i] = end
            if not round_:
                break
            for (i, _, _), logits in zip(round_, self._native_forward([(batch[i][0], p, k) for i, p, k in round_])):
                results[i].append(logits)
        return [torch.cat(r) if len(r) > 1 else r[0] for r in results]

    def _native_forward(self, batch: Sequence[tuple[KVCache, Sequence[int], int]]) -> list[torch.Tensor]:
        assert self.native is not None and self.kernels is not None
        seqs = []
        for cache, tokens, num_logits in batch:
            cache.reserve(cache.length + len(tokens))
            seqs.append(SeqDesc(cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, cache.length, len(tokens), num_logits))
        ids = torch.tensor([t for _, tokens, _ in batch for t in tokens], dtype=torch.int64)
        counts = [num_logits for _, _, num_logits in batch]
        logits = torch.empty(sum(counts), self.vocab_size, dtype=torch.float32)
        self.kernels.forward(self.native, seqs, ids, logits)
        for cache, tokens, _ in batch:
            cache.length += len(tokens)
        return list(logits.split(counts))

    def _torch_forward(self, batch: Sequence[tuple[KVCache, Sequence[int], int]]) -> list[torch.Tensor]:
        lengths = [len(tokens) for _, tokens, _ in batch]
        starts = [cache.length for cache, _, _ in batch]
        for (cache, _, _), start, n in zip(batch, starts, lengths):
            cache.reserve(start + n)
        ids = torch.tensor([t for _, tokens, _ in batch for t in tokens], device=self.device)
        positions = torch.cat([torch.arange(s, s + n, device=self.device) for s, n in zip(starts, lengths)])
        # [tokens, 1, head_dim] per layer type
        rope = {kind: (cos[positions][:, None, :], sin[positions][:, None, :]) for kind, (cos, sin) in self._tables.items()}
        num_tokens = ids.shape[0]
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim

        # Per window size (0: full attention), per sequence: the first cached position its
        # queries see and SDPA's mask over the positions from there, shared by the layers of
        # that window.
        masks = {window: self._masks(starts, lengths, window) for window in {layer.window for layer in self.layers}}
        # Which rows go through the block kernel: those of sequences feeding few tokens.
        small = [n <= SMALL_ROWS for n in lengths]
        route = _Route.of(lengths, small, self.device)
        assert self.embed is not None
        hidden = self.embed[ids]  # [tokens, hidden]
        if self.family.embed_scale:
            hidden = hidden * self.embed_scale
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = route.apply(layer.qkv, x)  # [tokens, (heads + 2 * kv_heads) * head_dim]
            # Rotate q and k together: [tokens, heads + kv_heads, head_dim].
            qk = qkv[:, : q_width + kv_width].view(num_tokens, -1, self.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat((self._rms_norm(qk[:, : self.num_heads], layer.q_norm),
                                self._rms_norm(qk[:, self.num_heads :], layer.k_norm)), dim=1)
            qk = self._rope(qk, *rope[layer.kind])
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, q_width + kv_width :].view(num_tokens, self.num_kv_heads, self.head_dim)
            outputs = []
            offset = 0
            for (cache, _, _), start, n, (first, mask) in zip(batch, starts, lengths, masks[layer.window]):
                end = start + n
                cache.k[index, :, start:end] = k[offset : offset + n].transpose(0, 1)
                cache.v[index, :, start:end] = v[offset : offset + n].transpose(0, 1)
                outputs.append(self._attention(q[offset : offset + n], cache, index, end, layer.window, first, mask))
                offset += n
            attended = route.apply(layer.o, torch.cat(outputs) if len(outputs) > 1 else outputs[0])
            if layer.attn_post_norm is not None:
                attended = self._rms_norm(attended, layer.attn_post_norm)
            hidden = hidden + attended
            x = self._rms_norm(hidden, layer.ffn_norm)
            gate, up = route.apply(layer.gate_up, x).chunk(2, dim=-1)
            gated = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
            mlp = route.apply(layer.down, gated * up)
            if layer.ffn_post_norm is not None:
                mlp = self._rms_norm(mlp, layer.ffn_post_norm)
            hidden = hidden + mlp

        for (cache, _, _), n in zip(batch, lengths):
            cache.length += n
        # Logits only where the caller needs them (a prefill needs one row, not thousands).
        rows: list[int] = []
        offset = 0
        for (_, _, num_logits), n in zip(batch, lengths):
            rows.extend(range(offset + n - num_logits, offset + n))
            offset += n
        if not rows:
            return [hidden.new_empty(0, self.vocab_size, dtype=torch.float32) for _ in batch]
        counts = [num_logits for _, _, num_logits in batch]
        head_route = _Route.of(counts, [c <= SMALL_ROWS for c in counts], self.device)
        logits = head_route.apply(self.lm_head, self._rms_norm(hidden[rows], self.final_norm)).float()
        return list(logits.split(counts))

    def _masks(self, starts: Sequence[int], lengths: Sequence[int], window: int) -> list[tuple[int, torch.Tensor | None]]:
        """Per sequence, for layers attending to ``window`` positions (0: all): the first cached
        position any of its queries sees, and SDPA's mask over the positions from there (query i,
        at position start + i, sees p with start + i - window < p <= start + i). The mask is None
        where SDPA's own modes cover it (one query; a causal block from the first position seen)
        and where the attention kernel runs (it needs none; building one costs ~50 us)."""
        out: list[tuple[int, torch.Tensor | None]] = []
        for start, n in zip(starts, lengths):
            first = max(0, start + 1 - window) if window else 0
            if self._attention_kernel_for(n) is not None or n == 1 or (start == first and (not window or n <= window)):
                out.append((first, None))
                continue
            query = torch.arange(start, start + n, device=self.device)[:, None]
            key = torch.arange(first, start + n, device=self.device)[None]
            mask = key <= query
            if window:
                mask &= key > query - window
            out.append((first, mask))
        return out

    def _attention_kernel_for(self, n: int) -> Any | None:
        """The attention kernel for a sequence feeding ``n`` tokens; None: SDPA."""
        return self.attention_kernel if n <= SMALL_ROWS else None

    def _attention(self, q: torch.Tensor, cache: KVCache, layer: int, end: int, window: int, first: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of ``q`` ([n, heads, head_dim], positions end-n..end-1) over the cache
        (``window`` > 0: each query over the last ``window`` positions up to its own; SDPA reads
        the positions from ``first`` on, under ``mask``)."""
        n = q.shape[0]
        kernel = self._attention_kernel_for(n)
        if kernel is not None:
            return kernel.attention(q, cache.k[layer], cache.v[layer], end, self.scale, window)
        keys = cache.k[layer, :, first:end][None]  # [1, kv_heads, end - first, head_dim]
        values = cache.v[layer, :, first:end][None]
        query = q.transpose(0, 1)[None]  # [1, heads, n, head_dim]
        if mask is not None:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
        else:  # one query sees every key given; a block fed from the first position seen is plain causal
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=n > 1, scale=self.scale,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
