"""The ``long`` prompt set: long Python standard-library modules, cut to a token length, with a request at the end.

Why this set: long inputs that exist on every machine that runs verispec, real code a coder target
reads well, and requests that make the answer reach back to the start of the input (far memory).
Each prompt is the first part of a module in a fenced block, then a request about the first
function defined in it (or a summary when the cut holds none), as one chat user turn cut so
that the whole templated prompt is ``length`` tokens (within a few tokens: the cut is re-encoded).
Two kinds of request (``LONG_REQUESTS``): ``rewrite`` the function with type hints (an answer that
copies much of the input: prompt lookup's case) or ``explain`` it in words without its code (an
answer that mostly does not).

Modules: every stdlib ``.py`` file (tests excluded, sorted) of at least ``MIN_MODULE_CHARS``
characters (enough source for 16K tokens), minus data tables; every third one (0, 3, 6, ...) is
the **dev** split (for choosing drafter settings), the others the **eval** split: disjoint by module.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path
from typing import Any

from verispec.bench.prompts import Prompt

LONG_SPLITS = ("dev", "eval")
LONG_REQUESTS = ("rewrite", "explain")
DEFAULT_LONG_LENGTHS = (512, 2048, 4096, 8192)
MIN_MODULE_CHARS = 70_000
# Not code (data tables), or seen by the built-in EAGLE head in training (pieces of _pyio.py, corpus seed 0).
_SKIPPED_MODULES = {"pydoc_data/topics.py", "html/entities.py", "_pyio.py"}
_FIRST_DEF = re.compile(r"^\s*def (\w+)\(", re.MULTILINE)
_CUT_ATTEMPTS = 4  # re-encoding a cut can merge or split tokens at the edge; a few corrections converge
# Characters per token of stdlib source under the built-in target's tokenizer (Qwen2.5): 4.0-4.8 over
# the first 60,000 characters of each long module (median ~4.4; 2026-12-06, one-off).
CHARS_PER_TOKEN = 4.4


def long_context_modules(split: str, root: Path | None = None) -> list[tuple[str, Path]]:
    """(module name, file) of one split, in a fixed order."""
    from verispec.drafters.eagle.corpus import stdlib_sources

    if split not in LONG_SPLITS:
        raise ValueError(f"--split must be one of {', '.join(LONG_SPLITS)}, got {split!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    modules = []
    for path in stdlib_sources(root):
        name = path.relative_to(root).as_posix()
        if name not in _SKIPPED_MODULES and path.stat().st_size >= MIN_MODULE_CHARS:
            modules.append((name, path))
    dev = split == "dev"
    return [module for index, module in enumerate(modules) if (index % 3 == 0) == dev]


def approximate_long_texts(count: int, approx_tokens: int, root: Path | None = None) -> list[str]:
    """``count`` distinct long prompts (the rewrite request) of about ``approx_tokens`` tokens each,
    cut by characters (CHARS_PER_TOKEN), so no tokenizer is needed: what ``verispec loadtest
    --long-prompts`` sends (the server's usage then reports the exact counts). Prompt k reads module
    k mod M of both splits, from line 40 * (k // M) on, so no two share more than the template."""
    if count < 1 or approx_tokens < 1:
        raise ValueError(f"count and approx_tokens must be >= 1, got {count} and {approx_tokens}")
    modules = sorted(long_context_modules("dev", root) + long_context_modules("eval", root))[:count]
    lines = [path.read_text(encoding="utf-8").splitlines(keepends=True) for _, path in modules]  # each module read once
    texts = []
    for k in range(count):
        module = k % len(modules)
        body = "".join(lines[module][40 * (k // len(modules)) :])[: int(approx_tokens * CHARS_PER_TOKEN)]
        texts.append(_prompt_text(modules[module][0], body))
    return texts


def parse_lengths(text: str) -> list[int]:
    """Prompt lengths in tokens from a comma list; ValueError naming --lengths."""
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be a comma list of token counts, got {text!r}") from None
    if not lengths or min(lengths) < 256:
        raise ValueError(f"--lengths must name token counts >= 256 (room for the request), got {text!r}")
    return list(dict.fromkeys(lengths))


def long_context_prompts(
    tokenizer: Any,
    lengths: list[int],
    split: str = "eval",
    per_length: int | None = 2,
    root: Path | None = None,
    request: str = "rewrite",
) -> list[Prompt]:
    """``per_length`` prompts (None: one per module of the split) at each length; category
    ``long-<length>`` (``long-explain-<length>`` for the explain request)."""
    from verispec.models import encode_prompt

    if request not in LONG_REQUESTS:
        raise ValueError(f"--long-request must be one of {', '.join(LONG_REQUESTS)}, got {request!r}")
    kind = "long" if request == "rewrite" else f"long-{request}"
    modules = long_context_modules(split, root)
    if per_length is not None:
        modules = modules[:per_length]
    prompts = []
    for name, path in modules:
        source = path.read_text(encoding="utf-8")
        source_ids = tokenizer(source, add_special_tokens=False)["input_ids"]
        for length in lengths:
            body_tokens = length
            for _ in range(_CUT_ATTEMPTS):
                text = _prompt_text(name, tokenizer.decode(source_ids[: max(body_tokens, 1)]), request)
                error = len(encode_prompt(tokenizer, text)) - length
                if error == 0 or (body_tokens > len(source_ids) and error < 0):  # exact, or the module is used up
                    break
                body_tokens -= error
            prompts.append(Prompt(id=f"{kind}/{name}@{length}", category=f"{kind}-{length}", text=text))
    return prompts


def _prompt_text(module: str, body: str, request: str = "rewrite") -> str:
    function = _FIRST_DEF.search(body)
    if function is None:
        ask = "Summarize what the code above does and list the names it defines."
    elif request == "explain":
        ask = (
            f"Explain in plain words what the function `{function.group(1)}` defined above does and how it is used "
            "in this module. Do not repeat its code."
        )
    else:
        ask = (
            f"Rewrite the function `{function.group(1)}` defined above with full type hints and a docstring "
            "that explains its parameters. Show only the rewritten function."
        )
    return f"Here is the beginning of the Python standard library module `{module}`:\n\n```python\n{body}\n```\n\n{ask}"
