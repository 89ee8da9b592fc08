"""The native backend: Parrot's own forward (``llama.py``) for Llama-family and Gemma 3 models.

Two ways in, tried in this order:
- a GGUF file straight onto the compiled kernels (CPU, float32 activations, kernels built): the
  blocks stay in the memory-mapped file, no float32 copy of a matrix is made, and a weightless
  transformers-shaped model supplies config, norms and rotary tables;
- any other source the forward runs (CUDA, bfloat16, a transformers directory, a GGUF with a
  tensor format the kernels lack): transformers loads the weights (``hf_loading.py``), and a GGUF's
  blocks, checked bit for bit against them, still serve the small passes.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from parrot.config import ModelConfig
from parrot.engine.backend import LoadedModel, context_window
from parrot.engine.backends.registry import BackendDeclined, register_backend
from parrot.engine.hf_loading import gguf_blocks, gguf_tokenizer_and_config, load_transformers, transformers_config
from parrot.engine.kernels import kernels as load_kernels
from parrot.engine.llama import LlamaForward, native_support, weightless_model
from parrot.engine.memory import gguf_load_bytes
from parrot.engine.source import ModelSource, choose_device, choose_dtype
from parrot.gguf_file import GGUFFile

log = logging.getLogger("parrot.engine")

# GGUF architectures (general.architecture) whose transformers model types the native forward
# runs (llama.SUPPORTED_MODEL_TYPES): llama.cpp writes Mistral's files as "llama", and Gemma 3's
# text model as "gemma3" (transformers' "gemma3_text").
NATIVE_GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")


def _on_kernels(source: ModelSource, config: ModelConfig) -> bool:
    """Whether the GGUF goes straight onto the compiled kernels (no float32 copy)."""
    return (source.gguf_file is not None and choose_device(config.device).type == "cpu"
            and choose_dtype(config.dtype, torch.device("cpu")) == torch.float32 and load_kernels() is not None)


class NativeBackend:
    name = "native"

    def unsupported(self, source: ModelSource, config: ModelConfig) -> str | None:
        if source.gguf_path is not None:
            try:
                architecture = GGUFFile(source.gguf_path).architecture
            except (OSError, ValueError) as exc:
                return f"cannot read the GGUF ({exc})"
            if architecture not in NATIVE_GGUF_ARCHITECTURES:
                return f"the native forward does not run the {architecture} architecture"
            return None  # the rest of the config is read on loading (the conversion gives it)
        try:
            model_config = transformers_config(source)
        except (OSError, ValueError) as exc:
            return f"transformers cannot read its config ({str(exc).splitlines()[0][:200]})"
        reason = native_support(SimpleNamespace(config=model_config))
        return None if reason is None else f"the native forward does not run {reason}"

    def memory_needed(self, source: ModelSource, config: ModelConfig) -> tuple[int, str] | None:
        if source.gguf_path is None:
            return None
        return gguf_load_bytes(source.gguf_path, float32=not _on_kernels(source, config))

    def load(self, source: ModelSource, config: ModelConfig) -> LoadedModel:
        if _on_kernels(source, config):
            loaded = load_onto_kernels(source, config)
            if loaded is not None:
                return loaded
        source, tokenizer, hf_model = load_transformers(config, source)
        reason = native_support(hf_model)
        if reason is not None:
            raise BackendDeclined(f"the native forward does not run {reason}")
        forward = LlamaForward(hf_model, context_window(hf_model.config), gguf_blocks(source, hf_model),
                               activations=config.activations)
        return _loaded(forward, tokenizer, source.display_name)

    def wrap(self, hf_model: Any, tokenizer: Any, name: str, blocks: dict[str, Any], activations: str) -> LoadedModel | None:
        if native_support(hf_model) is not None:
            return None
        return _loaded(LlamaForward(hf_model, context_window(hf_model.config), blocks, activations=activations),
                       tokenizer, name)

    def describe(self, loaded: LoadedModel) -> dict[str, Any]:
        forward = loaded.forward
        assert isinstance(forward, LlamaForward)
        isa = forward.kernels.isa if forward.kernels is not None else None
        if forward.native is not None:
            summary = f"decoding passes in the {isa} kernels on GGUF blocks"
        elif forward.attention_kernel is not None:
            summary = f"float32 weights, {isa} attention kernel"
        else:
            summary = "float32 weights, SDPA attention"
        return {"summary": summary, "kernels": isa, "whole_pass_compiled": forward.native is not None,
                "block_weights": forward.block_kernels, "activations": forward.activations}


def load_onto_kernels(source: ModelSource, config: ModelConfig) -> LoadedModel | None:
    """A GGUF straight onto the compiled kernels, with no float32 copy of its matrices: the blocks
    stay in the memory-mapped file (q and k rows reordered into copies), token rows come from the
    embedding's blocks, and a weightless transformers model supplies the config, norms and
    rotary tables. None where that does not apply (a format or shape the kernels do not run):
    then transformers loads it."""
    from parrot.engine.quant import (ROPE_FACTORS, apply_rope_factors, apply_rope_scaling, gguf_rope_scaling,
                                     read_gguf_native, release_file_pages)

    assert source.gguf_path is not None
    tokenizer, model_config = gguf_tokenizer_and_config(source)
    scaling = gguf_rope_scaling(source.gguf_path)  # Gemma 3 4B and larger: transformers' conversion drops it
    if scaling is not None:
        apply_rope_scaling(model_config, scaling)
    try:
        blocks, small = read_gguf_native(source.gguf_path, model_config)
    except ValueError as exc:
        log.info("%s: %s; loading it through transformers", source.gguf_file, exc)
        return None
    if "lm_head.weight" not in blocks and "model.embed_tokens.weight" in blocks:
        model_config.tie_word_embeddings = True  # no output.weight: the LM head is the embedding
        blocks["lm_head.weight"] = blocks["model.embed_tokens.weight"]
    factors = small.pop(ROPE_FACTORS, None)
    skeleton: Any = weightless_model(model_config, small)
    if skeleton is None:  # a rope scaling of its own: transformers' modules compute the tables
        from transformers import AutoConfig, AutoModelForCausalLM

        if isinstance(model_config, SimpleNamespace):
            values = dict(vars(model_config))
            model_config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        skeleton.load_state_dict(small, strict=False, assign=True)
        with torch.device("cpu"):  # its inverse frequencies, built for real
            skeleton.model.rotary_emb = type(skeleton.model.rotary_emb)(config=model_config)
    if native_support(skeleton) is not None:
        return None
    if factors is not None:
        if isinstance(skeleton.model.rotary_emb, dict):
            raise ValueError(f"{source.gguf_file}: rope_freqs in a model with rotary tables per layer type")
        apply_rope_factors(skeleton.model.rotary_emb, factors)
    forward = LlamaForward(skeleton, context_window(model_config), blocks, activations=config.activations)
    if forward.native is None:
        return None
    release_file_pages(blocks)  # every pass reads the packed copies
    return _loaded(forward, tokenizer, source.display_name)


def _loaded(forward: LlamaForward, tokenizer: Any, name: str) -> LoadedModel:
    return LoadedModel(forward=forward, tokenizer=tokenizer, name=name, device=forward.device, dtype=forward.dtype,
                       backend=NativeBackend.name, context_window=forward.max_positions,
                       pass_report=forward.pass_report)


register_backend(NativeBackend())
