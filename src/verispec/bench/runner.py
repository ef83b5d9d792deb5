"""Run every method on every prompt, interleaved prompt by prompt, and collect one row per run.

For each prompt (and each turn, with ``multi_turn``) every method runs before the next prompt
starts, so slow drifts of the machine (other load, clock changes) hit all methods alike and the
per-prompt ratios stay fair. Before timing, each method runs once briefly (untimed, on the first
prompt's first ``WARMUP_PROMPT_TOKENS`` tokens) so one-off costs (first-call allocations, adaptive
cost estimates) do not land on the first prompt.

Multi-turn: turn k's input is the conversation so far - the user turns, each followed by the
answer of *our plain decoding* to it (the same context for every method; its own output when
``plain`` runs, else a separate untimed plain run) - then user turn k, in the chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verispec.bench.memory import PeakRss, current_rss
from verispec.bench.methods import Method, RunOutput
from verispec.bench.prompts import Prompt
from verispec.sampling import SamplingParams

WARMUP_TOKENS = 8
# The warm-up reads at most this many tokens of the first prompt: it is there for one-off costs, and
# a long-context run's first prompt (16K tokens: ~8 min of prefill on 2 cores) would pay them many times over.
WARMUP_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int
    sampling: SamplingParams
    multi_turn: bool = False  # run every turn of multi-turn prompts, not just the first
    warmup: bool = True
    chat: bool = True  # False: each prompt is raw text to continue (no chat template), as /v1/completions takes it


@dataclass
class Row:
    """One method on one prompt turn."""

    prompt_id: str
    category: str
    turn: int  # 1-based
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float  # wall-clock, prefill included
    target_calls: int
    draft_calls: int | None
    drafted_per_round: list[int] | None  # None: not observable (Hugging Face methods)
    accepted_per_round: list[int] | None
    token_ids: list[int]
    prefill_seconds: float | None = None  # the target's prompt prefill within ``seconds``; None: not observable (HF)
    reused_prompt_tokens: int = 0  # prompt positions restored from the method's prefix cache (ours, --prefix-cache-mb)
    draft_seconds: float | None = None  # drafting within ``seconds`` (ours only)
    verify_seconds: float | None = None  # verification passes within ``seconds`` (ours only)
    branches_verified: int = 0  # runner-up tokens verified beside the chain (ours, one-level draft trees)
    branches_accepted: int = 0  # rounds that kept one

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.turn)

    @property
    def label(self) -> str:
        return self.prompt_id if self.turn == 1 else f"{self.prompt_id} (turn {self.turn})"

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Throughput after the prompt's prefill (what long prompts would otherwise hide); 0 if unknown."""
        if self.prefill_seconds is None or self.seconds - self.prefill_seconds <= 0:
            return 0.0
        return self.new_tokens / (self.seconds - self.prefill_seconds)


@dataclass
class BenchRun:
    rows: list[Row] = field(default_factory=list)
    peak_rss: dict[str, int] = field(default_factory=dict)  # method -> bytes (whole process)
    rss_before: int | None = None  # bytes, models loaded, before the first run
    complete: bool = False
    stopped_by: str | None = None  # why an incomplete run ended
    error: BaseException | None = None  # the exception that ended it (re-raised by the caller after saving)


def count_runs(prompts: list[Prompt], methods: dict[str, Method], multi_turn: bool) -> int:
    turns = sum(len(p.turns) if multi_turn else 1 for p in prompts)
    return turns * len(methods)


def run_bench(
    prompts: list[Prompt],
    methods: dict[str, Method],
    settings: BenchSettings,
    tokenizer: Any,
    *,
    answer_method: Method | None = None,
    on_row: Callable[[Row], None] | None = None,
    on_turn_done: Callable[[list[Row]], None] | None = None,
) -> BenchRun:
    """Run ``methods`` (in their order) on each prompt turn.

    An error or Ctrl-C during the runs does not propagate: it ends the run, is kept in ``error``,
    and the rows measured so far are returned (``complete`` False) for the caller to save.

    ``answer_method``: plain decoding that answers earlier turns when ``plain`` is not among ``methods``.
    ``on_row`` is called after every run, ``on_turn_done`` with the rows of each finished prompt turn.
    """
    if not prompts or not methods:
        raise ValueError("run_bench needs at least one prompt and one method")
    answerer = methods.get("plain", answer_method)
    if settings.multi_turn and answerer is None and any(p.follow_ups for p in prompts):
        raise ValueError("multi-turn prompts need plain decoding to answer earlier turns (answer_method)")
    run = BenchRun(rss_before=current_rss())
    monitor = PeakRss().start()
    try:
        if settings.warmup:
            first = conversation_ids(tokenizer, [{"role": "user", "content": prompts[0].text}], settings.chat)[:WARMUP_PROMPT_TOKENS]
            for method in methods.values():
                method.run(first, min(WARMUP_TOKENS, settings.max_new_tokens), settings.sampling)
            # The timed runs of that prompt must not start from the warm-ups' prompts. Forgotten after
            # all of them: methods sharing one prefix cache (--share-prefill) then prefill the
            # warm-up prompt once between them, not once each (a 16K-token prompt: ~8 min a prefill).
            for method in methods.values():
                forget = getattr(method, "forget", None)
                if forget is not None:
                    forget()
        for prompt in prompts:
            messages: list[dict[str, str]] = []
            for turn, text in enumerate(prompt.turns[: len(prompt.turns) if settings.multi_turn else 1], start=1):
                messages.append({"role": "user", "content": text})
                input_ids = conversation_ids(tokenizer, messages, settings.chat)
                turn_rows = []
                for name, method in methods.items():
                    with monitor.measuring(name):
                        output = method.run(input_ids, settings.max_new_tokens, settings.sampling)
                    row = _row(prompt, turn, name, input_ids, output)
                    run.rows.append(row)
                    turn_rows.append(row)
                    if on_row is not None:
                        on_row(row)
                if on_turn_done is not None:
                    on_turn_done(turn_rows)
                if turn < len(prompt.turns) and settings.multi_turn:
                    answer = next((r.token_ids for r in turn_rows if r.method == "plain"), None)
                    if answer is None:
                        answer = answerer.run(input_ids, settings.max_new_tokens, settings.sampling).token_ids
                    messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
        run.complete = True
    except KeyboardInterrupt as error:
        run.stopped_by, run.error = "interrupted (Ctrl-C)", error
    except Exception as error:  # keep what was measured; the caller saves it, then re-raises
        run.stopped_by, run.error = f"stopped by an error: {type(error).__name__}: {error}", error
    finally:
        monitor.stop()
        run.peak_rss = dict(monitor.peaks)
    return run


def conversation_ids(tokenizer: Any, messages: list[dict[str, str]], chat: bool = True) -> list[int]:
    """Token ids of a chat ready for the assistant's reply; a single user turn is exactly ``encode_prompt``.

    ``chat=False``: the one message's raw text, to be continued (no template).
    """
    from verispec.models import encode_prompt

    if tokenizer is None:
        raise ValueError("the target has no tokenizer; benchmark prompts are text")
    if not chat and len(messages) > 1:
        raise ValueError("--raw prompts are single texts to continue; they cannot be combined with --multi-turn")
    if len(messages) == 1:
        return encode_prompt(tokenizer, messages[0]["content"], chat=chat)
    if not tokenizer.chat_template:
        raise ValueError("--multi-turn needs a target with a chat template (to place earlier answers in the conversation)")
    # Render, then encode, as encode_prompt does: the template spells out every special token.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _row(prompt: Prompt, turn: int, method: str, input_ids: list[int], output: RunOutput) -> Row:
    return Row(
        prompt_id=prompt.id,
        category=prompt.category,
        turn=turn,
        method=method,
        prompt_tokens=len(input_ids),
        new_tokens=len(output.token_ids),
        seconds=output.seconds,
        target_calls=output.target_calls,
        draft_calls=output.draft_calls,
        drafted_per_round=output.drafted_per_round,
        accepted_per_round=output.accepted_per_round,
        token_ids=output.token_ids,
        prefill_seconds=output.prefill_seconds,
        reused_prompt_tokens=output.reused_prompt_tokens,
        draft_seconds=output.draft_seconds,
        verify_seconds=output.verify_seconds,
        branches_verified=output.branches_verified,
        branches_accepted=output.branches_accepted,
    )
