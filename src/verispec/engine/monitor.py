"""Rolling acceptance statistics, and a warning when speculation stops paying.

Speculation is faster only while the drafter agrees with the target. Text far from the
drafter's training, or text built to make them disagree (a rejection attack), lowers the
tokens accepted per target call until each token costs more than plain decoding — silently.
The monitor keeps the last ``window`` rounds of each *scope* (a request, an API key, the whole
process) and reports α, τ, acceptance by draft position and the realised speed-up estimate

    speed-up ≈ (tokens emitted in the window / seconds those rounds took) × plain_step_s

where ``plain_step_s`` is the cost of one plain decoding step (a one-token target pass): given
up front (``verispec costs`` measures it) and refined from the plain rounds the engine runs
(rounds without drafts: adaptive gamma 0, probes, the first round). When a scope's estimate stays
below ``speedup_floor`` (or, without a plain-step cost, its α below ``alpha_floor``) over a full
verdict, one structured warning is logged; another comes only after the scope recovered.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import asdict, dataclass

from verispec.engine.stats import acceptance_by_position

logger = logging.getLogger("verispec.monitor")


@dataclass(frozen=True)
class MonitorConfig:
    window: int = 64  # rounds kept per scope
    min_rounds: int = 16  # rounds in the window before any verdict (a few unlucky rounds are noise)
    speedup_floor: float = 1.0  # warn below this realised speed-up over plain decoding
    alpha_floor: float | None = None  # without a plain-step cost: warn below this acceptance rate
    plain_step_s: float | None = None  # a plain decoding step's cost, if measured beforehand
    smoothing: float = 0.2  # weight of each newly observed plain step in the running estimate

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_rounds < 1 or self.min_rounds > self.window:
            raise ValueError(f"need 1 <= min_rounds <= window, got min_rounds={self.min_rounds}, window={self.window}")
        if self.speedup_floor <= 0:
            raise ValueError(f"speedup_floor must be > 0, got {self.speedup_floor!r}")
        if self.alpha_floor is not None and not 0.0 < self.alpha_floor < 1.0:
            raise ValueError(f"alpha_floor must be in (0, 1), got {self.alpha_floor!r}")
        if self.plain_step_s is not None and self.plain_step_s <= 0:
            raise ValueError(f"plain_step_s must be > 0, got {self.plain_step_s!r}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")


@dataclass(frozen=True)
class AcceptanceSnapshot:
    """One scope's statistics over its last ``rounds`` rounds."""

    rounds: int
    drafted: int
    accepted: int
    emitted: int
    seconds: float
    alpha: float  # accepted / drafted (0 when nothing was drafted)
    tau: float  # emitted tokens per target call
    acceptance_by_position: list[float]
    tokens_per_s: float
    speedup: float | None  # realised tokens/s over plain decoding's; None until a plain step is known

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Round:
    drafted: int
    accepted: int
    emitted: int
    seconds: float


class AcceptanceMonitor:
    """Rolling acceptance per scope; thread-safe enough for one writer (the engine or scheduler thread)."""

    def __init__(self, config: MonitorConfig | None = None) -> None:
        self.config = config if config is not None else MonitorConfig()
        self.plain_step_s = self.config.plain_step_s
        self._rounds: dict[str, deque[_Round]] = {}
        self._below: set[str] = set()  # scopes warned about and not recovered since
        self.warnings = 0

    def record(self, scopes: tuple[str, ...], num_drafted: int, num_accepted: int, num_emitted: int, seconds: float) -> None:
        """One target call's outcome, counted in every scope it belongs to (e.g. global, key, request)."""
        if num_drafted < 0 or not 0 <= num_accepted <= num_drafted or num_emitted < 0 or seconds < 0:
            raise ValueError(f"inconsistent round: drafted={num_drafted} accepted={num_accepted} emitted={num_emitted} seconds={seconds}")
        if num_drafted == 0 and num_emitted == 1 and seconds > 0:
            # A plain step: exactly what plain decoding would have paid for this token.
            old = self.plain_step_s
            self.plain_step_s = seconds if old is None else old + self.config.smoothing * (seconds - old)
        for scope in scopes:
            window = self._rounds.setdefault(scope, deque(maxlen=self.config.window))
            window.append(_Round(num_drafted, num_accepted, num_emitted, seconds))
            self._judge(scope)

    def snapshot(self, scope: str) -> AcceptanceSnapshot:
        rounds = list(self._rounds.get(scope, ()))
        drafted = sum(r.drafted for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        emitted = sum(r.emitted for r in rounds)
        seconds = sum(r.seconds for r in rounds)
        tokens_per_s = emitted / seconds if seconds > 0 else 0.0
        return AcceptanceSnapshot(
            rounds=len(rounds), drafted=drafted, accepted=accepted, emitted=emitted, seconds=seconds,
            alpha=accepted / drafted if drafted else 0.0,
            tau=emitted / len(rounds) if rounds else 0.0,
            acceptance_by_position=acceptance_by_position([r.drafted for r in rounds], [r.accepted for r in rounds]),
            tokens_per_s=tokens_per_s,
            speedup=tokens_per_s * self.plain_step_s if self.plain_step_s is not None and seconds > 0 else None,
        )  # fmt: skip

    def scopes(self) -> list[str]:
        return list(self._rounds)

    def forget(self, scope: str) -> None:
        """Drop a finished scope (a request that ended); its rounds stay counted in the wider scopes."""
        self._rounds.pop(scope, None)
        self._below.discard(scope)

    def _judge(self, scope: str) -> None:
        snapshot = self.snapshot(scope)
        if snapshot.rounds < self.config.min_rounds or snapshot.drafted == 0:
            return  # too little evidence, or not speculating at all: nothing to lose
        if snapshot.speedup is not None:
            below = snapshot.speedup < self.config.speedup_floor
        elif self.config.alpha_floor is not None:
            below = snapshot.alpha < self.config.alpha_floor
        else:
            return
        if below and scope not in self._below:
            self._below.add(scope)
            self.warnings += 1
            event = {"event": "speculation_below_floor", "scope": scope, "speedup_floor": self.config.speedup_floor}
            event.update({key: snapshot.to_dict()[key] for key in ("rounds", "alpha", "tau", "tokens_per_s", "speedup")})
            logger.warning(json.dumps(event))
        elif not below and scope in self._below:
            self._below.discard(scope)
            logger.info(json.dumps({"event": "speculation_recovered", "scope": scope, "speedup": snapshot.speedup, "alpha": snapshot.alpha}))
