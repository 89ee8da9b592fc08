"""Parrot's own forward pass for Llama-family models, with a preallocated KV cache per sequence.

Why not call the transformers model: on these 2-core CPUs a transformers forward spends most
of its time outside the arithmetic (measured with the torch profiler on SmolLM2-135M, fp32,
600-token cache: `DynamicCache` re-concatenates the whole cache every step, 14% of the time, and
MKL's `sgemm` repacks every weight on every call, so 2 tokens cost 2x one token). Here:

- weights are fused (q|k|v, gate|up) and, on CPU, packed once for oneDNN, which makes the cost of
  a pass nearly flat in the number of tokens (1 token 40 ms, 8 tokens 49 ms, 16 tokens 68 ms in
  the same measurement) and the result of each row independent of how many rows are computed
  together (the linear layers and RMSNorm are batch-invariant bit for bit);
- the KV cache is one tensor per sequence, written in place; cropping it is setting a length.

The weights, rotary tables and normalisation come from the loaded transformers model, so the
arithmetic is the same as transformers' (same RMSNorm formula, the model's own rotary module).
Several sequences can be fed in one pass: the linear layers run over all their new tokens
together and attention runs per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def native_support(hf_model: Any) -> str | None:
    """None when ``LlamaForward`` can run this model, else the reason it cannot."""
    config = hf_model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (native forward covers {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _cat_linear(modules: Sequence[torch.nn.Linear]) -> PackedLinear:
    weight = torch.cat([m.weight for m in modules])
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(modules, biases)])
    return PackedLinear(weight, bias)


class _Layer:
    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _cat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = PackedLinear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = _cat_linear([mlp.gate_proj, mlp.up_proj])
        self.down = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.input_norm = layer.input_layernorm.weight.detach()
        self.post_norm = layer.post_attention_layernorm.weight.detach()


class KVCache:
    """Keys and values of one sequence: ``[layers, kv_heads, capacity, head_dim]``, grown on demand."""

    def __init__(self, forward: "LlamaForward", capacity: int) -> None:
        self._forward = forward
        self.length = 0
        capacity = max(1, min(capacity, forward.max_positions))
        shape = (forward.num_layers, forward.num_kv_heads, capacity, forward.head_dim)
        self.k = torch.empty(shape, dtype=forward.dtype, device=forward.device)
        self.v = torch.empty(shape, dtype=forward.dtype, device=forward.device)

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
    """Forward passes of a Llama-family transformers model over ``KVCache`` objects."""

    def __init__(self, hf_model: Any, max_positions: int) -> None:
        reason = native_support(hf_model)
        if reason is not None:
            raise ValueError(f"native forward does not support {reason}")
        config = hf_model.config
        inner = hf_model.model
        self.device = inner.embed_tokens.weight.device
        self.dtype = inner.embed_tokens.weight.dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.max_positions = max_positions
        self.vocab_size = config.vocab_size
        with torch.inference_mode():
            self.embed = inner.embed_tokens.weight.detach()
            self.layers = [_Layer(layer) for layer in inner.layers]
            self.final_norm = inner.norm.weight.detach()
            self.lm_head = PackedLinear(hf_model.lm_head.weight)
            # The model's own rotary module computes the tables (it knows the rope scaling type).
            positions = torch.arange(max_positions, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [positions, head_dim]

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self, capacity)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The transformers LlamaRMSNorm formula, in the same order of operations (fp32 inside).
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[KVCache, Sequence[int], int]]) -> list[torch.Tensor]:
        """Feed ``tokens`` to each ``cache`` in one pass; return each one's last ``num_logits`` logits.

        Each entry is ``(cache, tokens, num_logits)``. The caches grow by ``len(tokens)``.
        Returns one ``[num_logits, vocab]`` float tensor per entry.
        """
        lengths = [len(tokens) for _, tokens, _ in batch]
        starts = [cache.length for cache, _, _ in batch]
        for (cache, _, _), start, n in zip(batch, starts, lengths):
            cache.reserve(start + n)
        ids = torch.tensor([t for _, tokens, _ in batch for t in tokens], device=self.device)
        positions = torch.cat([torch.arange(s, s + n, device=self.device) for s, n in zip(starts, lengths)])
        cos = self.cos[positions][:, None, :]  # [tokens, 1, head_dim]
        sin = self.sin[positions][:, None, :]
        num_tokens = ids.shape[0]
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim

        # Causal masks, one per sequence, shared by every layer: query i (position start + i)
        # sees keys 0..start + i. None where SDPA's own modes cover it (one query, or from 0).
        masks = [
            None if n == 1 or start == 0
            else torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
            for start, n in zip(starts, lengths)
        ]
        hidden = self.embed[ids]  # [tokens, hidden]
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = layer.qkv(x)  # [tokens, (heads + 2 * kv_heads) * head_dim]
            q = self._rope(qkv[:, :q_width].view(num_tokens, self.num_heads, self.head_dim), cos, sin)
            k = self._rope(qkv[:, q_width : q_width + kv_width].view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
            v = qkv[:, q_width + kv_width :].view(num_tokens, self.num_kv_heads, self.head_dim)
            outputs = []
            offset = 0
            for (cache, _, _), start, n, mask in zip(batch, starts, lengths, masks):
                end = start + n
                cache.k[index, :, start:end] = k[offset : offset + n].transpose(0, 1)
                cache.v[index, :, start:end] = v[offset : offset + n].transpose(0, 1)
                outputs.append(self._attention(q[offset : offset + n], cache, index, end, mask))
                offset += n
            hidden = hidden + layer.o(torch.cat(outputs) if len(outputs) > 1 else outputs[0])
            x = self._rms_norm(hidden, layer.post_norm)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)

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
        logits = self.lm_head(self._rms_norm(hidden[rows], self.final_norm)).float()
        return list(logits.split([num_logits for _, _, num_logits in batch]))

    def _attention(self, q: torch.Tensor, cache: KVCache, layer: int, end: int, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of ``q`` ([n, heads, head_dim], positions end-n..end-1) over the cache."""
        n = q.shape[0]
        keys = cache.k[layer, :, :end][None]  # [1, kv_heads, end, head_dim]
        values = cache.v[layer, :, :end][None]
        query = q.transpose(0, 1)[None]  # [1, heads, n, head_dim]
        if mask is not None:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        else:  # one query sees everything; a sequence fed from position 0 is plain causal
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=n > 1, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
