"""``--draft-attention / --local-window / --memory-temperature / --memory-weight``: far-memory options of head drafting.

Shared by every command that drafts with the EAGLE or parallel head (generate, compare, serve, eagle
eval; bench takes the three numbers and picks the mode per method: eagle-local, eagle-fold,
eagle-auto, and ``:attention=full|local|fold|auto`` on the other EAGLE and the parallel methods).
"""

from __future__ import annotations

import argparse

from verispec.drafters.far_memory import ATTENTION_MODES, AUTO_WINDOW_AFTER, FarMemoryConfig

_DEFAULTS = FarMemoryConfig()


def add_far_memory_options(sub: argparse.ArgumentParser, *, with_mode: bool = True, default_mode: str = "auto") -> None:
    """The four options; ``default_mode``: --draft-attention's default ("auto" where requests are
    served, "full" where a setting is measured: ``eagle eval``)."""
    if with_mode:
        sub.add_argument("--draft-attention", choices=ATTENTION_MODES, default=default_mode, help=f"how the EAGLE or parallel head (and its EAGLE corrector) attends over long inputs: full (as trained), local (only the last --local-window tokens), fold (local window at exact positions + all older tokens as a far memory at one shared position; training-free), auto (full for prompts of at most {AUTO_WINDOW_AFTER} tokens, the heads' training length, local for longer ones: the fastest setting measured at 8K-16K); default {default_mode}")
    sub.add_argument("--local-window", type=int, default=_DEFAULTS.local_window, metavar="W", help=f"local/fold: tokens that keep their exact positions (default {_DEFAULTS.local_window})")
    sub.add_argument("--memory-temperature", type=float, default=_DEFAULTS.memory_temperature, metavar="T", help=f"fold: far-memory attention logits are divided by T; < 1 sharpens (default {_DEFAULTS.memory_temperature})")
    sub.add_argument("--memory-weight", type=float, default=_DEFAULTS.memory_weight, metavar="LAMBDA", help=f"fold: multiplies the far memory's total attention mass against the local window (default {_DEFAULTS.memory_weight})")


def auto_attention_note(drafter, prompt_length: int) -> str | None:  # noqa: ANN001 - any Drafter
    """What ``generate`` tells a user whose prompt made "auto" leave the head's trained attention;
    None when it did not (or the drafter has no head)."""
    from verispec.drafters.by_length import LengthSwitchDrafter

    if isinstance(drafter, LengthSwitchDrafter):
        drafter = drafter.for_prompt(prompt_length)
    far_memory = getattr(drafter, "far_memory", None) or getattr(getattr(drafter, "fallback", None), "far_memory", None)
    resolved = far_memory.for_prompt(prompt_length) if far_memory is not None and far_memory.mode == "auto" else None
    if resolved is None:
        return None
    return (
        f"verispec: the head drafts over the last {resolved.local_window} tokens: the prompt's {prompt_length} tokens are past the "
        f"{AUTO_WINDOW_AFTER} it was trained on (--draft-attention auto; full or fold to choose otherwise)"
    )


def far_memory_from_args(args: argparse.Namespace, mode: str | None = None) -> FarMemoryConfig | None:
    """The config the options describe (``mode`` overrides --draft-attention); None for "full" ("auto"
    is kept: each request resolves it by its prompt's length). Errors name the option."""
    mode = mode or getattr(args, "draft_attention", "full")
    config = FarMemoryConfig(mode, args.local_window, args.memory_temperature, args.memory_weight)
    return config if config.changes_attention else None
