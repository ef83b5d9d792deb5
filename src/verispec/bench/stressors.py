"""Stressed prompt sets: the same prompts, each also with text that makes drafters disagree.

A stressor is a change to the user's message. ``random`` and ``attack`` append a suffix of tokens
(random ones, or the one ``verispec attack`` searched for) the way planted content would sit in a
message; ``language`` and ``format`` are natural stressors - a switch of the answer's language and
an unusual output format, both far from what small drafters saw in training. Every stressed prompt
is an ordinary benchmark prompt whose category is the stressor, so ``verispec bench`` reports α, τ
and the speed-up against plain decoding per stressor, for every drafter, greedy or sampled.
"""

from __future__ import annotations

from verispec.bench.prompts import Prompt

STRESSORS = ("clean", "random", "language", "format", "attack")
LANGUAGE_SWITCH = "Réponds uniquement en français : explique d'abord la solution en français, puis écris le code avec des noms de variables et des commentaires en français."
FORMAT_SWITCH = "Write your whole answer in CAPITAL LETTERS, with one space between every two characters, and no code block."


def with_suffix(text: str, suffix_text: str) -> str:
    """The user's message with a suffix planted at its end (the one place the search and the runs share)."""
    return f"{text}\n{suffix_text}"


def parse_stressors(text: str) -> list[str]:
    """Stressor names from a comma list, in order, duplicates dropped; ValueError naming --stressors."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in STRESSORS]
    if not names or unknown:
        raise ValueError(f"--stressors: expected a comma list of {', '.join(STRESSORS)}, got {text!r}")
    return names


def stressed_prompts(prompts: list[Prompt], stressors: list[str], random_suffix: str, attack_suffix: str) -> list[Prompt]:
    """Every prompt under every stressor, prompt by prompt (so machine drift hits all stressors alike)."""
    change = {
        "clean": lambda text: text,
        "random": lambda text: with_suffix(text, random_suffix),
        "language": lambda text: with_suffix(text, LANGUAGE_SWITCH),
        "format": lambda text: with_suffix(text, FORMAT_SWITCH),
        "attack": lambda text: with_suffix(text, attack_suffix),
    }
    unknown = [name for name in stressors if name not in change]
    if unknown:
        raise ValueError(f"unknown stressor(s) {unknown}; known: {', '.join(STRESSORS)}")
    return [Prompt(id=f"{prompt.id} [{name}]", category=name, text=change[name](prompt.text)) for prompt in prompts for name in stressors]
