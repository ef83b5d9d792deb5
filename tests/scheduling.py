"""Requests through a Scheduler and their whole answers, for the serving tests."""

from __future__ import annotations

import queue

from verispec import SamplingParams
from verispec.serving import GenerationRequest, Scheduler


def serve_all(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], object]]:
    """Submit ``prompts`` together (greedy, no stop); per prompt its tokens and its last StepResult."""
    sinks = [queue.Queue() for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        scheduler.submit(GenerationRequest(prompt, max_tokens, SamplingParams(), [], sink.put))
    answers = []
    for sink in sinks:
        tokens, step = [], None
        while step is None or step.finish_reason is None:
            step = sink.get(timeout=60)
            tokens += step.token_ids
        answers.append((tokens, step))
    return answers
