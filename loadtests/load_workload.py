"""The load generator's workload: prompts from ``../shared/data``, a weighted task mix, a fixed order.

The order of prompts depends only on the seed and the request's index, never on timing, so a
run with speculation on and one with it off (``--compare``), or two concurrency levels, send
the same prompts in the same order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
TASKS = ("summarization", "context_qa", "grammar", "code_edit", "open_chat")


@dataclass(frozen=True)
class Prompt:
    id: str
    task: str
    text: str


def parse_mix(spec: str) -> dict[str, float]:
    """Task weights from ``"all"``, ``"grammar,summarization"`` (weight 1 each) or
    ``"summarization=2,grammar=1"``. Unknown tasks and weights that are not positive are errors."""
    if spec.strip() in ("", "all"):
        return dict.fromkeys(TASKS, 1.0)
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; tasks are {', '.join(TASKS)}")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"weight of {name!r} is not a number: {weight!r}") from None
        if value < 0:
            raise ValueError(f"weight of {name!r} is negative")
        if value > 0:
            weights[name] = value
    if not weights:
        raise ValueError("the task mix has no task with a positive weight")
    return weights


def load_prompts(data_dir: Path, tasks: list[str], max_prompt_chars: int | None = None) -> dict[str, list[Prompt]]:
    """Every prompt of each task file (``<task>.jsonl``), optionally only those up to a length."""
    prompts: dict[str, list[Prompt]] = {}
    for task in tasks:
        path = data_dir / f"{task}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found (--data points at the evaluation prompts)")
        rows = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    item = json.loads(line)
                    if max_prompt_chars is None or len(item["prompt"]) <= max_prompt_chars:
                        rows.append(Prompt(id=str(item["id"]), task=task, text=item["prompt"]))
        if not rows:
            raise ValueError(f"{path} has no prompt of at most {max_prompt_chars} characters")
        prompts[task] = rows
    return prompts


class Workload:
    """Request ``i`` gets ``prompt(i)``: a task drawn by weight, then a prompt of that task, both
    from a generator seeded by ``(seed, i)`` (so the sequence does not depend on who asks first)."""

    def __init__(self, prompts: dict[str, list[Prompt]], weights: dict[str, float], seed: int = 0) -> None:
        self.prompts = prompts
        self.tasks = [t for t in weights if t in prompts]
        self.weights = [weights[t] for t in self.tasks]
        self.seed = seed

    def prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        task = rng.choices(self.tasks, weights=self.weights)[0]
        return rng.choice(self.prompts[task])

    @classmethod
    def from_args(cls, data_dir: Path, mix: str, seed: int, max_prompt_chars: int | None = None) -> "Workload":
        weights = parse_mix(mix)
        return cls(load_prompts(data_dir, list(weights), max_prompt_chars), weights, seed)
