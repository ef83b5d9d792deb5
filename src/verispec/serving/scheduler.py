"""Continuous batching of speculative decoding: one thread owns the target; requests share its passes.

The asyncio side only calls :meth:`Scheduler.submit` (and :meth:`GenerationRequest.cancel`) and
reads the events a request's ``sink`` receives. The scheduler thread loops over rounds:

1. admit waiting requests up to ``max_batch`` (each prefilled alone, then merged into the batch
   cache), in order, until their prompts pass ``prefill_budget`` tokens (the first always comes in),
   and drop cancelled ones, closing their drafter sessions;
2. every running request drafts its own proposal: its own drafter session, its own seeded
   ``torch.Generator``, at most gamma from :class:`~verispec.serving.gamma_policy.BatchGammaPolicy`,
   as many as :class:`~verispec.serving.batch_plan.BatchPlanner` plans for the batch from each
   request's acceptance (its :class:`~verispec.engine.gamma.AdaptiveGamma`) and the measured costs
   of passes and drafting, so text the drafter cannot follow - a rejection attack included - and
   batches whose extra rows cost more than they bring are decoded plainly instead of slower than plainly;
3. ONE target forward over all running requests (:class:`~verispec.serving.lean_batch.LeanBatchedTarget`
   where the target runs the lean forward, else :class:`~verispec.serving.batch_cache.BatchedTarget`);
4. each request verifies its rows with the single-sequence engine's own functions
   (:func:`~verispec.engine.decoder.verify_drafts`: ``greedy_verify`` / ``rejection_sample``), so
   the math is exactly the engine's; stop conditions cut; the accepted tokens are sent at once;
5. finished, failed and cancelled requests leave the batch.

A request that raises (its drafter, its stop condition, its sink) fails alone; only an error in
the shared forward pass fails every request of that round, since it cannot be attributed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from verispec.drafters.base import Drafter, DraftSession, Proposal, propose_batch
from verispec.engine.decoder import StepResult, checked_proposal, draft_context, validate_prompt, verify_drafts
from verispec.engine.gamma import AdaptiveGamma
from verispec.engine.monitor import AcceptanceMonitor, MonitorConfig
from verispec.engine.stats import GenerationStats
from verispec.engine.stopping import StopCondition
from verispec.engine.prefix_cache import prefix_cache_of_mb
from verispec.sampling import SamplingParams
from verispec.serving.batch_cache import BatchedTarget, CompactionPolicy
from verispec.serving.batch_plan import BatchPlanner, PlanRow
from verispec.serving.gamma_policy import BatchGammaPolicy
from verispec.serving.lean_batch import LeanBatchedTarget, lean_batching_unsupported_reason
from verispec.serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_NO_DRAFT = Proposal(tokens=[], probs=None)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queue`` requests already."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is stopping and takes no more requests."""


@dataclass(frozen=True)
class SchedulerConfig:
    gamma: int = 4  # drafts per request per round when the batch is small
    max_batch: int = 32  # requests running together; more wait in the queue
    max_queue: int = 64  # waiting requests; beyond this submit() raises QueueFullError
    gamma_policy: BatchGammaPolicy = field(default_factory=BatchGammaPolicy)
    # Drafts planned per round below the batch policy's gamma from each request's acceptance and the
    # measured costs (unseeded requests: see _draft_budgets); False: every request drafts that gamma.
    adaptive_gamma: bool = True
    # With adaptive_gamma: no request's expected rate in a round may fall more than this below a plain
    # round's because of the others' drafts (BatchPlanner.max_slowdown); None: the batch's rate alone.
    max_slowdown: float | None = BatchPlanner.max_slowdown
    compaction: CompactionPolicy = field(default_factory=CompactionPolicy)
    # The acceptance monitor's window and floor (a warning per request / key / global dip below it).
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    # Passes whose rows all decode greedily take the LM head's argmax through its exact int8 screen
    # (models/screened_head.py) where the target runs the float32 panel kernels.
    screen_lm_head: bool = True
    # Where the target runs the lean forward (panel kernels): each request keeps its own cache and a
    # pass is one fused kernel call over every request's rows (serving/lean_batch.py); False, or a
    # target it cannot run: transformers' forward over one shared masked cache (serving/batch_cache.py).
    lean_batching: bool = True
    # MB of keys/values of earlier requests kept so that a new one starts from the longest prefix
    # it shares with them (a system prompt, a conversation's earlier turns); lean batching only; 0: off.
    prefix_cache_mb: int = 0
    # Prompt tokens admitted (prefilled) between two rounds, the first waiting request always: the
    # rest wait for the next round, so the requests already running, and the first newcomer, emit
    # tokens in between instead of waiting for every prefill (four ~2.3K-token prompts arriving
    # together on the 2-core Zen 4 EPYC: median first token after 85 s instead of 166 s; HumanEval
    # loads of 16 and 32 clients served as fast either way: README, Performance, 2026-12-06
    # (morning)). 0: admit every waiting request at once.
    prefill_budget: int = 2048

    def __post_init__(self) -> None:
        for name in ("gamma", "max_batch", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.prefill_budget, bool) or not isinstance(self.prefill_budget, int) or self.prefill_budget < 0:
            raise ValueError(f"prefill_budget must be an integer >= 0 (0 = admit every waiting request at once), got {self.prefill_budget!r}")
        BatchPlanner(max_slowdown=self.max_slowdown)  # checked here, built per scheduler
        prefix_cache_of_mb(self.prefix_cache_mb)  # checked here, built per scheduler (an empty cache costs nothing)


@dataclass
class RequestFailed:
    """The last event of a request that raised: the message is safe to show the client."""

    message: str


RequestEvent = StepResult | RequestFailed


@dataclass(eq=False)
class GenerationRequest:
    """One generation as the scheduler runs it; ``sink`` is called from the scheduler thread."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[int | str]  # stop token ids and strings (EOS included by the caller)
    sink: Callable[[RequestEvent], None]  # must not block: it runs between the batch's rounds
    client: str = "anonymous"  # whose request (an API key's id): the acceptance monitor's key scope
    arrived: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop generating (a disconnected client); the row is dropped before the next round."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(eq=False)
class _Row:
    """A running request: everything the single-sequence loop keeps in local variables."""

    request: GenerationRequest
    tokens: list[int]  # committed sequence: prompt + emitted tokens
    stopper: StopCondition
    generator: torch.Generator
    session: DraftSession | None
    stats: GenerationStats
    controller: AdaptiveGamma | None = None  # this request's acceptance-driven gamma (None: the policy's)
    unseen_features: list[torch.Tensor] = field(default_factory=list)  # each [n, hidden]
    last_emitted: float | None = None
    round_draft_s: float = 0.0  # this round's drafting time (the monitor charges it with the shared pass)
    round_controlled: bool = False  # this round's gamma came from the controller: it learns from the outcome
    has_drafted: bool = False  # its drafter has run (its first drafting round also pays the drafter's prefill)

    @property
    def scopes(self) -> tuple[str, str, str]:
        """The acceptance monitor's scopes of this request: global, its client's, its own."""
        return ("global", f"key:{self.request.client}", f"request:{id(self.request)}")


class Scheduler:
    """Runs every submitted request through shared, batched verification passes of ``target``."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None,
        tokenizer: Any | None,
        config: SchedulerConfig | None = None,
        metrics: ServerMetrics | None = None,
        monitor: AcceptanceMonitor | None = None,
        planner: BatchPlanner | None = None,
    ) -> None:
        self.config = config if config is not None else SchedulerConfig()
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.monitor = monitor if monitor is not None else AcceptanceMonitor(self.config.monitor)
        self.target = batched_target(target, self.config)
        self.drafter = drafter
        self.tokenizer = tokenizer
        self._wants_features = bool(drafter is not None and drafter.needs_target_features)
        # One target, one drafter: the costs are the server's, the acceptance each request's.
        self._planner = planner if planner is not None else BatchPlanner(max_slowdown=self.config.max_slowdown)
        self._waiting: deque[GenerationRequest] = deque()
        self._rows: list[_Row] = []  # the scheduler thread's alone
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # The asyncio side ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current round, then fail what is left (waiting and running) and end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._thread = None

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``; raises :class:`QueueFullError` when ``max_queue`` requests wait already."""
        self.start()
        with self._lock:
            if self._stopping:
                raise SchedulerClosedError("the server is shutting down")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting already (--max-queue {self.config.max_queue})")
            self._waiting.append(request)
            self.metrics.queue_length.set(len(self._waiting))
            self._lock.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows)

    # The scheduler thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._waiting and not self._rows:
                    self._lock.wait()
                if self._stopping:
                    break
                count = admission_count([len(r.prompt_ids) for r in self._waiting], self.config.max_batch - len(self._rows), self.config.prefill_budget)
                admitted = [self._waiting.popleft() for _ in range(count)]
                self.metrics.queue_length.set(len(self._waiting))
            for request in admitted:
                self._admit(request)
            self._leave([row for row in self._rows if row.request.cancelled])
            if self._rows:
                self._round()
            self.metrics.running.set(len(self._rows))
        self._shut_down()

    def _admit(self, request: GenerationRequest) -> None:
        if request.cancelled:
            return
        session = None
        try:
            prompt = validate_prompt(request.prompt_ids, self.target.vocab_size)
            stopper = StopCondition(request.stop, self.tokenizer)
            session = self.drafter.start(prompt, request.sampling) if self.drafter is not None else None
            prefill_started = time.perf_counter()
            features = self.target.add(prompt)
        except Exception as error:  # noqa: BLE001 - this request fails, the server goes on
            _close(session)
            self._fail(request, error)
            return
        reused = getattr(self.target, "last_reused", 0)
        stats = GenerationStats(prompt_tokens=len(prompt), reused_prompt_tokens=reused, prefill_s=time.perf_counter() - prefill_started)
        row = _Row(request, list(prompt), stopper, request.sampling.make_generator(), session, stats)
        # Seeded requests stay uncontrolled: their text must not depend on timings (see _propose).
        if self.config.adaptive_gamma and session is not None and request.sampling.seed is None:
            row.controller = AdaptiveGamma(self.config.gamma)  # its acceptance only: the planner prices rounds
        if self._wants_features and len(features):
            row.unseen_features.append(features)
        self._rows.append(row)
        self.metrics.prompt_tokens.inc(len(prompt))
        self.metrics.reused_prompt_tokens.inc(reused)

    def _round(self) -> None:
        rows = self._rows
        gamma = self.config.gamma_policy.gamma_for(len(rows), self.config.gamma) if self.drafter is not None else 0
        self.metrics.gamma.set(gamma)
        failed: set[int] = set()
        budgets = self._draft_budgets(rows, gamma)
        self.metrics.round_drafts.set(sum(budgets))
        first_drafts = any(budget > 0 and not row.has_drafted for row, budget in zip(rows, budgets))
        draft_started = time.perf_counter()
        proposals = self._propose_all(rows, budgets, failed)
        draft_s = time.perf_counter() - draft_started
        feeds = [[row.tokens[-1]] + proposal.tokens for row, proposal in zip(rows, proposals)]
        try:
            pass_started = time.perf_counter()
            greedy = all(row.request.sampling.is_greedy for row in rows)
            outputs = self.target.extend(feeds, [len(feed) for feed in feeds], argmax_only=greedy)
            pass_s = time.perf_counter() - pass_started
        except Exception as error:  # noqa: BLE001 - the shared pass failed: nobody's tokens are valid
            logger.exception("batched target pass failed")
            for index, row in enumerate(rows):
                if index not in failed:
                    self._fail(row.request, error)
            self._leave(rows)
            return
        num_drafted = sum(len(proposal.tokens) for proposal in proposals)
        # A drafter's first round pays its prefill: no measure of drafting.
        self._planner.observe(sum(map(len, feeds)), pass_s, draft_s, 0 if first_drafts else num_drafted)
        kept, finished = [], set(failed)
        for index, (row, proposal, output) in enumerate(zip(rows, proposals, outputs)):
            if index in failed:
                kept.append(0)
                continue
            try:
                num_accepted, done = self._accept(row, proposal, output.logits, output.features, pass_s)
            except Exception as error:  # noqa: BLE001 - e.g. a sink that cannot deliver any more
                kept.append(0)
                finished.add(index)
                self._fail(row.request, error)
                continue
            kept.append(num_accepted + 1)  # the fed last token and the accepted drafts stay cached
            if done:
                finished.add(index)
        self.target.commit(kept)
        self.metrics.target_calls.inc()
        self._leave([rows[index] for index in sorted(finished)])

    def _propose_all(self, rows: list[_Row], budgets: list[int], failed: set[int]) -> list[Proposal]:
        """Every row's drafts for this round (``budgets`` tokens): drafted together where the drafter can
        (a draft model's sessions take one pass per step for all rows, :func:`~verispec.drafters.base.propose_batch`).
        A drafter error fails its request only: if the joint call fails, each row drafts alone."""
        drafting = [index for index, budget in enumerate(budgets) if budget > 0]
        proposals = [_NO_DRAFT] * len(rows)
        if not drafting:
            return proposals
        contexts = {index: draft_context(rows[index].tokens, rows[index].unseen_features, len(rows[index].tokens) - 1) for index in drafting}
        started = time.perf_counter()
        try:
            drafted = propose_batch([rows[i].session for i in drafting], [contexts[i] for i in drafting], [budgets[i] for i in drafting], [rows[i].generator for i in drafting])
            elapsed = time.perf_counter() - started  # every row waited for the joint drafting
            timed = [(index, proposal, elapsed) for index, proposal in zip(drafting, drafted)]
        except Exception:  # noqa: BLE001 - find the row whose drafter fails; the others draft alone
            timed = []
            for index in drafting:
                started = time.perf_counter()
                try:
                    proposal = rows[index].session.propose(contexts[index], budgets[index], rows[index].generator)
                except Exception as error:  # noqa: BLE001 - a drafter error fails its request only
                    failed.add(index)
                    self._fail(rows[index].request, error)
                    continue
                timed.append((index, proposal, time.perf_counter() - started))
        for index, proposal, elapsed in timed:
            row = rows[index]
            row.has_drafted = True
            row.round_draft_s = elapsed
            row.stats.draft_s += elapsed
            try:
                proposals[index] = checked_proposal(proposal, budgets[index], self.target.vocab_size, self.drafter.name)
            except Exception as error:  # noqa: BLE001 - a malformed proposal fails its request only
                failed.add(index)
                self._fail(row.request, error)
        return proposals

    def _draft_budgets(self, rows: list[_Row], gamma: int) -> list[int]:
        """How many tokens each row drafts this round (0: none): the batch planner's choice for
        controlled rows, at most ``gamma``, plus a probe now and then for a row it leaves plain."""
        plan_rows = []
        for row in rows:
            # A seeded request keeps the full gamma: its random stream (one uniform per draft) and so its
            # text then depend on its prompt and seed only, never on the traffic it shares rounds with.
            wanted = self.config.gamma if row.request.sampling.seed is not None and self.drafter is not None else gamma
            room = max(row.request.max_tokens - row.stats.new_tokens - 1, 0)  # never draft what we could not emit
            cap = 0 if row.session is None else min(wanted, room)
            row.round_controlled = row.controller is not None and gamma > 0 and cap > 0
            if row.round_controlled:  # the batch allows speculation; does this request's text pay for it?
                plan_rows.append(PlanRow(tuple(row.controller.reaches(min(cap, row.controller.draft_limit)))))
            else:
                plan_rows.append(PlanRow(None, cap))
        budgets = self._planner.plan(plan_rows)
        # Acceptance is only learnt from drafts: a text left plain is re-tested now and then, unless
        # no text could pay for its drafts in this batch.
        probing = any(budgets) or self._planner.could_pay(plan_rows)
        for index, row in enumerate(rows):
            if not row.round_controlled:
                continue
            if budgets[index] > 0:
                row.controller.speculation_paid()
            elif probing:
                budgets[index] = row.controller.plain_round()
        return budgets

    def _accept(self, row: _Row, proposal: Proposal, logits: torch.Tensor, features: torch.Tensor, pass_s: float) -> tuple[int, bool]:
        """Verify one row's drafts; emit its tokens. Returns (num_accepted, finished)."""
        # logits: [k+1, vocab]; features: [k+1, hidden]
        request = row.request
        output, num_accepted = verify_drafts(proposal.tokens, proposal.probs, logits, request.sampling, row.generator)
        if self._wants_features:
            row.unseen_features.append(features[: num_accepted + 1].clone())  # a copy: the batch's hidden states go
        new_tokens, stopped = row.stopper.cut(output[: num_accepted + 1])
        row.tokens.extend(new_tokens)
        stats = row.stats
        stats.record_round(len(proposal.tokens), num_accepted, len(new_tokens), proposal.num_forward_passes)
        if row.round_controlled:
            row.controller.observe_acceptance(len(proposal.tokens), num_accepted, proposal.num_forward_passes)
        now = time.perf_counter()
        stats.total_s = now - request.arrived
        self._record(row, len(proposal.tokens), num_accepted, len(new_tokens), now)
        self._monitor(row, len(proposal.tokens), num_accepted, len(new_tokens), row.round_draft_s + pass_s)
        row.round_draft_s = 0.0
        finish = "stop" if stopped else "length" if stats.new_tokens >= request.max_tokens else None
        request.sink(StepResult(new_tokens, len(proposal.tokens), num_accepted, finish, stats))
        return num_accepted, finish is not None

    def _record(self, row: _Row, num_drafted: int, num_accepted: int, num_emitted: int, now: float) -> None:
        metrics = self.metrics
        if num_drafted:
            metrics.drafts.inc()
            metrics.draft_tokens.inc(num_drafted)
            metrics.accepted_tokens.inc(num_accepted)
            for position in range(num_accepted):
                metrics.accepted_by_position.labels(position=str(position)).inc()
        metrics.generated_tokens.inc(num_emitted)
        if not num_emitted:
            return
        if row.last_emitted is None:
            metrics.time_to_first_token.observe(now - row.request.arrived)
            later_tokens = num_emitted - 1  # the first token's wait is the TTFT, not a per-token time
            gap = 0.0
        else:
            later_tokens, gap = num_emitted, now - row.last_emitted
        for _ in range(later_tokens):
            metrics.time_per_token.observe(gap / num_emitted)
        row.last_emitted = now

    def _monitor(self, row: _Row, num_drafted: int, num_accepted: int, num_emitted: int, seconds: float) -> None:
        """Rolling acceptance (global, per client, per request) and its gauges.

        A request is charged the whole shared pass (what it would wait for alone is not measurable
        inside a batch), and the plain-step cost is learnt from the server's own plain rounds, so
        the speed-up is relative to plain decoding at the batch sizes this server runs.
        """
        warnings = self.monitor.warnings
        self.monitor.record(row.scopes, num_drafted, num_accepted, num_emitted, seconds)
        self.metrics.below_floor.inc(self.monitor.warnings - warnings)
        for scope in row.scopes[:2]:
            snapshot = self.monitor.snapshot(scope)
            self.metrics.rolling_alpha.labels(scope=scope).set(snapshot.alpha)
            self.metrics.rolling_tau.labels(scope=scope).set(snapshot.tau)
            if snapshot.speedup is not None:
                self.metrics.rolling_speedup.labels(scope=scope).set(snapshot.speedup)

    def _leave(self, leaving: list[_Row]) -> None:
        """Remove rows from the batch (cache included) and close their drafter sessions."""
        if not leaving:
            return
        gone = set(map(id, leaving))
        keep = [index for index, row in enumerate(self._rows) if id(row) not in gone]
        self.target.remove(keep)
        for row in leaving:
            _close(row.session)
            self.monitor.forget(row.scopes[2])
        self._rows = [self._rows[index] for index in keep]
        self.metrics.running.set(len(self._rows))

    def _fail(self, request: GenerationRequest, error: BaseException) -> None:
        if not isinstance(error, ValueError):  # bad input explains itself; anything else is our bug
            logger.error("request failed", exc_info=error)
        try:
            request.sink(RequestFailed(f"{type(error).__name__}: {error}"))
        except Exception:  # noqa: BLE001 - its client is gone; nothing more to tell
            pass

    def _shut_down(self) -> None:
        closed = SchedulerClosedError("the server is shutting down")
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            self._fail(request, closed)
        for row in self._rows:
            self._fail(row.request, closed)
        self._leave(list(self._rows))
        self.metrics.queue_length.set(0)


def admission_count(prompt_lengths: list[int], room: int, prefill_budget: int) -> int:
    """How many of the waiting requests (their prompt lengths, in queue order) to admit now: up to
    ``room``, and while their prompts total at most ``prefill_budget`` tokens, the first always
    (0: no budget, all that fit)."""
    count, total = 0, 0
    for length in prompt_lengths[: max(room, 0)]:
        if count and prefill_budget and total + length > prefill_budget:
            break
        count, total = count + 1, total + length
    return count


def batched_target(model: PreTrainedModel, config: SchedulerConfig) -> BatchedTarget | LeanBatchedTarget:
    """What runs the shared passes: the lean fused stack where it can, else the masked shared cache."""
    if config.lean_batching and lean_batching_unsupported_reason(model) is None:
        return LeanBatchedTarget(model, config.screen_lm_head, prefix_cache_of_mb(config.prefix_cache_mb))
    return BatchedTarget(model, config.compaction, config.screen_lm_head)


def _close(session: DraftSession | None) -> None:
    if session is None:
        return
    try:
        session.close()
    except Exception:  # noqa: BLE001 - freeing memory must not fail a request
        logger.exception("closing a drafter session failed")
