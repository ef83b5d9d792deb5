"""Parallel drafting with contextual correction (DCOCO): K drafts from one head pass.

``head`` (the module: context encoder + K mask slots), ``lattice`` (best paths through the
K×m candidates), ``drafter`` (the Drafter implementation), ``checkpoint`` (bound to one target),
``train`` (on the EAGLE pipeline's feature shards) and ``acceptance`` (greedy rounds replayed on
recorded text: ``verispec parallel eval``).
"""

from verispec.drafters.parallel.checkpoint import bundled_parallel_path, default_parallel_path, existing_parallel_path, load_parallel_head, save_parallel_head
from verispec.drafters.parallel.drafter import ParallelDrafter
from verispec.drafters.parallel.head import ParallelConfig, ParallelHead
from verispec.drafters.parallel.lattice import best_path, top_paths

__all__ = [
    "ParallelConfig",
    "ParallelDrafter",
    "ParallelHead",
    "best_path",
    "bundled_parallel_path",
    "default_parallel_path",
    "existing_parallel_path",
    "load_parallel_head",
    "save_parallel_head",
    "top_paths",
]
