"""Models through transformers: a GGUF's converted copy kept in the cache (tokenizer, config, and
for the transformers forward its float32 weights), and loading a transformers model.

Both backends use it: ``hf`` for everything, ``native`` for a GGUF's tokenizer and config and for
sources the kernels do not take whole. Run as ``python -m parrot.engine.hf_loading DIRECTORY
GGUF_FILE``, it is the child process that converts a GGUF's tokenizer and config (below).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import torch

from parrot.config import ModelConfig
from parrot.engine.kernels import cpu_description
from parrot.engine.paths import cache_root
from parrot.engine.source import ModelNotFoundError, ModelSource, choose_device, choose_dtype, resolve_source
from parrot.tokenizer import Tokenizer, load_tokenizer
from parrot.tokenizer.gguf_vocab import UnsupportedTokenizerError
from parrot.tokenizer.loader import write_merges_as_strings

log = logging.getLogger("parrot.engine")


# Part of the conversion cache's key: raise it when what a conversion writes changes (2: the
# tokenizer fixes for SentencePiece prefixes and ignore_merges; 3: special tokens at the file's
# ids; 4: Llama 3's BOS; 5, 6: BPE merges as strings, from both conversions; 7: SentencePiece
# user-defined tokens matched whole), so that no stale copy is read.
CONVERSION_VERSION = 7


# Written into each converted copy: the file it was made from (what its key hashes), so that
# copies no load will read again can be found and removed (_remove_stale).
SOURCE_FILE = "source.json"


def _source_stamp(source: ModelSource) -> dict[str, Any]:
    path = os.path.realpath(os.path.join(source.path, source.gguf_file or ""))
    stat = os.stat(path)
    return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "version": CONVERSION_VERSION}


def _conversion_dir(source: ModelSource) -> str:
    """Where the converted copy of a GGUF goes: keyed by its path, size and modification time."""
    stamp = _source_stamp(source)
    key = hashlib.sha256("|".join(str(stamp[k]) for k in ("path", "size", "mtime_ns", "version")).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "converted", f"{source.display_name}-{key}")


def _recorded_source(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, SOURCE_FILE)) as f:
            recorded = json.load(f)
        return recorded if isinstance(recorded, dict) and isinstance(recorded.get("path"), str) else None
    except (OSError, ValueError):
        return None


def _remove_stale(target: str, path: str) -> None:
    """Remove the other converted copies of ``path``, the file ``target`` was made from (the file
    changed since, e.g. its package was reinstalled, or Parrot's conversion did), and those whose
    file is gone. None of them would be read again, and each can hold the weights in float32 (600
    MB for the embedded model). Copies without a record (made before it was written) are left alone."""
    root = os.path.dirname(target)
    for name in sorted(os.listdir(root)):
        other = os.path.join(root, name)
        recorded = None if name.startswith(".") or other == target else _recorded_source(other)
        if recorded is not None and (recorded["path"] == path or not os.path.exists(recorded["path"])):
            shutil.rmtree(other, ignore_errors=True)
            log.info("removed %s from the conversion cache: a stale copy of %s", name, recorded["path"])


def _save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Save a converted tokenizer into the cache, its BPE merges as strings (2.3 MB less resident
    once read: parrot/tokenizer/loader.py, ``write_merges_as_strings``)."""
    tokenizer.hf.save_pretrained(directory)
    write_merges_as_strings(os.path.join(directory, "tokenizer.json"))


def _publish(staging: str, target: str, last: str, source: ModelSource | None = None) -> None:
    """Move a conversion from ``staging`` into the cache at ``target``: the whole directory where
    there is none yet, else file by file with ``last`` (the file whose presence means "done")
    moved last. Both conversions (the kernels' tokenizer and config, transformers' full model)
    share one directory per file, and whichever runs second must not fail on the first's. With
    ``source``, a new directory records it and the stale copies of the same file are removed."""
    if not os.path.isdir(target):
        stamp = _source_stamp(source) if source is not None else None
        if stamp is not None:
            with open(os.path.join(staging, SOURCE_FILE), "w") as f:
                json.dump(stamp, f)
        os.replace(staging, target)
        if stamp is not None:
            _remove_stale(target, stamp["path"])
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
        _publish(staging, target, last="model.safetensors", source=source)
    except OSError as exc:
        log.warning("could not cache the converted model in %s (%s); the next load converts again", target, exc)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer, hf_model.to(dtype)


def load_transformers(config: ModelConfig, source: ModelSource | None = None) -> tuple[ModelSource, Tokenizer, Any]:
    """The source, tokenizer and transformers model named by ``config`` (on its device and dtype);
    ``source``: ``config.source`` already resolved."""
    from transformers import AutoModelForCausalLM

    if config.threads:
        torch.set_num_threads(config.threads)
    source = source or resolve_source(config.source)
    device = choose_device(config.device)
    dtype = choose_dtype(config.dtype, device)
    log.info("loading %s on %s (%s); CPU: %s", source.display_name, device, str(dtype).removeprefix("torch."),
             cpu_description())
    hf_model: Any
    try:
        if source.gguf_file is not None:
            tokenizer, hf_model = _load_gguf_converted(source, dtype)
        else:
            tokenizer = load_tokenizer(source.path)
            hf_model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load model {config.source!r}: {exc}") from exc
    if source.gguf_file is not None:  # transformers reads no rope_freqs (Llama 3.1 and later)
        from parrot.engine.quant import apply_rope_factors, apply_rope_scaling, gguf_rope_factors, gguf_rope_scaling

        factors = gguf_rope_factors(os.path.join(source.path, source.gguf_file))
        if factors is not None:
            apply_rope_factors(hf_model.model.rotary_emb, factors)
        # nor the scaling in the metadata (Gemma 3 4B and larger): the rotary module is rebuilt with it
        scaling = gguf_rope_scaling(os.path.join(source.path, source.gguf_file))
        if scaling is not None and apply_rope_scaling(hf_model.config, scaling):
            hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(config=hf_model.config)
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


def transformers_config(source: ModelSource) -> Any:
    """The transformers config of a model directory or hub id (config.json only; no weights)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.path)


def gguf_tokenizer_and_config(source: ModelSource) -> tuple[Tokenizer, Any]:
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
    child = subprocess.run([sys.executable, "-m", "parrot.engine.hf_loading", source.path, source.gguf_file or ""],
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
        _publish(staging, target, last="config.json", source=source)
    except OSError as exc:
        log.warning("could not cache the tokenizer and config in %s (%s)", target, exc)
    return tokenizer, config


if __name__ == "__main__":  # the conversion child: python -m parrot.engine.hf_loading DIRECTORY GGUF_FILE
    try:
        convert_gguf_metadata(ModelSource(sys.argv[1], sys.argv[2]))
    except UnsupportedTokenizerError as exc:
        print(exc)
        sys.exit(REFUSED_EXIT)
