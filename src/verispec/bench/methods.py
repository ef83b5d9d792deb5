"""The decoding methods a benchmark compares, all behind one ``run(input_ids, max_new_tokens, sampling)``.

Ours run through :class:`SpeculativeDecoder`; the Hugging Face ones through ``model.generate``
with the same stop tokens and sampling settings. Every method is timed the same way: wall-clock
around the whole call, prefill included, because that is how long a user waits for the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from verispec.drafters.by_length import DEFAULT_LONG_PROMPT
from verispec.drafters.combined import STREAM_GAMMA, STREAM_PATH_CONFIDENCE
from verispec.drafters.far_memory import ATTENTION_MODES, FarMemoryConfig
from verispec.drafters.parallel.drafter import PARALLEL_CANDIDATES, PARALLEL_PATH_RULE, PATH_RULES
from verispec.engine.decoder import LONG_CONTEXT_TREE_LIMIT
from verispec.sampling import SamplingParams


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str  # "ours" or "hf"
    needs_draft: bool  # needs the draft model loaded
    description: str


METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in [
        MethodSpec("plain", "ours", False, "our plain decoding (no drafter): the baseline"),
        MethodSpec("draft-model", "ours", True, "draft model, gamma drafts a round"),
        MethodSpec("draft-model-adaptive", "ours", True, "draft model, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("ngram", "ours", False, "prompt lookup (NgramDrafter), gamma drafts a round"),
        MethodSpec("ngram-adaptive", "ours", False, "prompt lookup, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("ngram+draft", "ours", True, "prompt lookup when it matches, the draft model otherwise (CombinedDrafter)"),
        MethodSpec("ngram+draft-adaptive", "ours", True, "ngram+draft, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("eagle", "ours", False, "EAGLE head on the target's features (--eagle-head), gamma drafts a round"),
        MethodSpec("eagle-adaptive", "ours", False, "EAGLE head, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("ngram+eagle", "ours", False, "prompt lookup when it matches, the EAGLE head otherwise (CombinedDrafter)"),
        MethodSpec("ngram+eagle-adaptive", "ours", False, "ngram+eagle, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("eagle-local", "ours", False, "EAGLE head attending to the last --local-window tokens only (truncation)"),
        MethodSpec("eagle-fold", "ours", False, "EAGLE head with far memory (FOLD: --local-window, --memory-temperature, --memory-weight)"),
        MethodSpec("eagle-auto", "ours", False, "EAGLE head as generate/serve run it by default: as trained up to 1,024 prompt tokens, eagle-local past them (--draft-attention auto)"),
        MethodSpec("eagle-local-adaptive", "ours", False, "eagle-local, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("eagle-fold-adaptive", "ours", False, "eagle-fold, 0..gamma drafts a round (adaptive_gamma)"),
        MethodSpec("auto", "ours", True, f"generate's default drafter: ngram+draft-adaptive:gamma={STREAM_GAMMA}:path={STREAM_PATH_CONFIDENCE} below {DEFAULT_LONG_PROMPT:,} prompt tokens, ngram+eagle-adaptive:gamma={STREAM_GAMMA}:path=0.2:attention=auto from there; with :tree=N the head's rounds verify trees while the sequence is under {LONG_CONTEXT_TREE_LIMIT:,} tokens"),
        MethodSpec("parallel", "ours", False, "parallel head (--parallel-head): a block of K drafts from one pass, top-1 per position"),
        MethodSpec("parallel-corrected", "ours", False, f"parallel head + contextual correction: {PARALLEL_CANDIDATES} candidates a position (:cand=M), best path by pair fit"),
        MethodSpec("parallel-corrected-eagle", "ours", False, "parallel-corrected with the pair fit scored by the EAGLE head (--eagle-head): one step per candidate, the candidate as the token one step ahead"),
        MethodSpec("hf-plain", "hf", False, "transformers generate(), greedy or sampling"),
        MethodSpec("hf-assisted", "hf", True, "transformers assisted generation (assistant_model=draft), default settings"),
        MethodSpec("hf-lookup", "hf", False, "transformers prompt lookup (prompt_lookup_num_tokens=10)"),
    ]
}
# Method names that draft with an EAGLE head (the bench loads one when any is asked for).
EAGLE_HEAD_PREFIXES = ("eagle", "ngram+eagle")
EAGLE_HEAD_METHODS = ("parallel-corrected-eagle", "auto")  # other methods that read one
# What `generate` and `compare` run by default for a prompt below DEFAULT_LONG_PROMPT tokens, as a
# bench method (`auto` switches to the EAGLE head from there, as they do).
STREAM_DEFAULT_METHOD = f"ngram+draft-adaptive:gamma={STREAM_GAMMA}:path={STREAM_PATH_CONFIDENCE}"
# The full run: every method but ngram-adaptive (lookup drafts cost nothing, so adapting their
# number changes little) and fixed-gamma ngram+draft, plus the generate/compare default, to keep
# 21 prompts x 8 methods at ~90 minutes on the 2-core CPU. EAGLE and parallel methods need a
# trained head (--eagle-head, --parallel-head), so they run when asked for.
DEFAULT_METHODS = tuple(
    STREAM_DEFAULT_METHOD if name == "ngram+draft-adaptive" else name
    for name in METHODS
    if name not in ("ngram-adaptive", "ngram+draft", "auto") and not name.startswith((*EAGLE_HEAD_PREFIXES, "parallel"))
)
QUICK_METHODS = ("plain", "draft-model", "ngram")  # --quick: the baseline and our two drafters
REFERENCE_METHODS = ("plain", "hf-plain")  # speed-up baselines and identical-output references, in order of preference


# Per-method settings a method name can carry after colons, e.g. ``draft-model:gamma=8:vocab=32768``,
# so that settings are compared side by side in one run (interleaved prompt by prompt, like methods).
_DRAFT_MODEL_METHODS = ("draft-model", "draft-model-adaptive", "ngram+draft", "ngram+draft-adaptive")
_EAGLE_METHODS = ("eagle", "eagle-adaptive", "ngram+eagle", "ngram+eagle-adaptive")  # (far-memory variants: as measured, no stop rule)
_PARALLEL_METHODS = ("parallel", "parallel-corrected", "parallel-corrected-eagle")
_CORRECTED_METHODS = ("parallel-corrected", "parallel-corrected-eagle")
_ATTENTION_METHODS = _EAGLE_METHODS + _PARALLEL_METHODS  # heads whose attention over long inputs is a setting (eagle-local etc. fix it)
_TREE_METHODS = _DRAFT_MODEL_METHODS + _EAGLE_METHODS + _PARALLEL_METHODS + ("auto",)  # drafters offering runner-ups
_PATH_METHODS = _DRAFT_MODEL_METHODS + _EAGLE_METHODS + _PARALLEL_METHODS  # drafters with the path stop rule (auto fixes generate's)
_HEAD_METHODS = tuple(name for name in METHODS if name.startswith(EAGLE_HEAD_PREFIXES) or name in EAGLE_HEAD_METHODS)  # methods that read an EAGLE head


@dataclass(frozen=True)
class _Option:
    help: str  # shown by `bench --help` and in out-of-range errors
    parse: type  # int or float
    valid: Callable[[float], bool]
    applies: Callable[[str], bool]  # to which base method names
    scope: str  # those methods, for the error message


_OPTIONS = {
    "gamma": _Option("draft tokens per round (adaptive methods: at most), >= 1", int, lambda v: v >= 1,
                     lambda base: METHODS[base].family == "ours" and base != "plain", "our drafting methods"),
    "vocab": _Option("draft model: draft over the first N token ids (+ special ones); 0 = the full vocabulary", int, lambda v: v >= 0,
                     lambda base: base in _DRAFT_MODEL_METHODS, ", ".join(_DRAFT_MODEL_METHODS)),
    "confidence": _Option("draft model: stop a round's drafting below this draft probability, in [0, 1); 0 = never", float, lambda v: 0 <= v < 1,
                          lambda base: base in _DRAFT_MODEL_METHODS, ", ".join(_DRAFT_MODEL_METHODS)),
    "path": _Option("draft model, EAGLE or parallel head: stop a round's drafting (end a parallel head's path) once the product of its draft probabilities is below this, in [0, 1); 0 = never", float,
                    lambda v: 0 <= v < 1, lambda base: base in _PATH_METHODS, ", ".join(_PATH_METHODS)),
    "tune": _Option("prompt lookup: 1 = each session picks the best-scoring of its lookup rules (the default), 0 = the latest-match rule with capped short matches alone",
                    int, lambda v: v in (0, 1), lambda base: base in ("ngram", "ngram-adaptive"), "ngram, ngram-adaptive"),
    "screen": _Option("greedy target passes: 1 = the LM head's argmax through its exact int8 screen, 0 = every logit in float32 (the run's --greedy-lm-head otherwise)", int,
                      lambda v: v in (0, 1), lambda base: METHODS[base].family == "ours", "our methods"),
    "tree": _Option("greedy verification passes of up to N rows, the spare ones filled with the draft model's, EAGLE head's or parallel head's runner-up tokens (a one-level draft tree); 0 = chains only (the run's --tree-rows otherwise)",
                    int, lambda v: v >= 0, lambda base: base in _TREE_METHODS, ", ".join(_TREE_METHODS)),
    "expand": _Option("EAGLE head with draft trees: runner-up paths drafted on per draft step, in the chain's head call, their next tokens offered as deeper tree nodes; 0 = one-level trees (the default: deeper ones measured no faster here)",
                      int, lambda v: v >= 0, lambda base: base in _EAGLE_METHODS, ", ".join(_EAGLE_METHODS)),
    "dhead": _Option("draft model: 1 = greedy draft steps read the LM head through its 4-bit screen, 0 = the int8 head (the run's --draft-greedy-head otherwise)", int,
                     lambda v: v in (0, 1), lambda base: base in _DRAFT_MODEL_METHODS, ", ".join(_DRAFT_MODEL_METHODS)),
    "dwin": _Option("draft model: it sees only the last N prompt tokens; 0 = the whole prompt (the run's --draft-window otherwise)", int,
                    lambda v: v >= 0, lambda base: base in _DRAFT_MODEL_METHODS, ", ".join(_DRAFT_MODEL_METHODS)),
    "prefix": _Option("MB of this method's own prefix caches (target and draft model): prompts start from its earlier prompts' and answers' longest shared prefix; 0 = none (the run's --prefix-cache-mb otherwise)",
                      int, lambda v: v >= 0, lambda base: METHODS[base].family == "ours", "our methods"),
    "cand": _Option(f"contextual correction: candidates kept per position (m), >= 2 (default {PARALLEL_CANDIDATES})", int, lambda v: v >= 2,
                    lambda base: base in _CORRECTED_METHODS, ", ".join(_CORRECTED_METHODS)),
    "rule": _Option(f"contextual correction by the EAGLE fit: how the path is picked — lattice (the best path through the K×m lattice) or successor (each next draft the EAGLE corrector's most likely token after the one before it; default {PARALLEL_PATH_RULE})",
                    str, lambda v: v in PATH_RULES, lambda base: base == "parallel-corrected-eagle", "parallel-corrected-eagle"),
    "head": _Option("EAGLE head: the N-th --eagle-head of the run, >= 1 (default 1), to time two heads side by side", int, lambda v: v >= 1,
                    lambda base: base in _HEAD_METHODS, ", ".join(_HEAD_METHODS)),
    "attention": _Option("EAGLE or parallel head (and its EAGLE corrector): how it attends over long inputs — full (as trained), local (the last --local-window tokens only), fold (far memory: --local-window, --memory-temperature, --memory-weight) or auto (full up to 1,024 prompt tokens, local past them)",
                         str, lambda v: v in ATTENTION_MODES, lambda base: base in _ATTENTION_METHODS, ", ".join(_ATTENTION_METHODS)),
}
METHOD_OPTIONS = {key: option.help for key, option in _OPTIONS.items()}


@dataclass(frozen=True)
class MethodVariant:
    """A method name plus the settings its ``:key=value`` suffixes override (None: the run's setting)."""

    base: str
    gamma: int | None = None
    vocab: int | None = None
    confidence: float | None = None
    path: float | None = None
    screen: int | None = None
    tune: int | None = None
    tree: int | None = None
    expand: int | None = None
    dhead: int | None = None
    dwin: int | None = None
    prefix: int | None = None
    attention: str | None = None
    cand: int | None = None
    rule: str | None = None
    head: int | None = None


def parse_variant(name: str) -> MethodVariant:
    """``draft-model:gamma=8:vocab=32768`` -> MethodVariant; ValueError naming --methods otherwise."""
    base, *settings = name.split(":")
    if base not in METHODS:
        raise ValueError(f"--methods: unknown method {base!r}; known: {', '.join(METHODS)}")
    values: dict[str, int | float] = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if key not in _OPTIONS or not sep:
            raise ValueError(f"--methods: {name!r}: expected key=value with key one of {', '.join(_OPTIONS)}, got {setting!r}")
        if key in values:
            raise ValueError(f"--methods: {name!r} sets {key} twice")
        option = _OPTIONS[key]
        if not option.applies(base):
            raise ValueError(f"--methods: {name!r}: {key} applies to {option.scope} only")
        try:
            number = option.parse(value)
        except ValueError:
            raise ValueError(f"--methods: {name!r}: {key} must be a number, got {value!r}") from None
        if not option.valid(number):
            raise ValueError(f"--methods: {name!r}: {key} out of range ({option.help}), got {value}")
        values[key] = number
    return MethodVariant(base, **values)  # type: ignore[arg-type]


def parse_methods(text: str) -> list[str]:
    """Method names (each optionally with ``:key=value`` settings) from a comma list, in the given
    order, duplicates dropped; ValueError naming --methods."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise ValueError("--methods must name at least one method")
    for name in names:
        parse_variant(name)
    return names


def eagle_heads_needed(names: list[str]) -> int:
    """How many EAGLE heads ``names`` read: the highest ``:head=N`` among the methods that read one
    (1 without the setting), 0 if none does."""
    variants = [parse_variant(name) for name in names]
    return max((variant.head or 1 for variant in variants if variant.base in _HEAD_METHODS), default=0)


def method_spec(name: str) -> MethodSpec:
    """The :class:`MethodSpec` of a method name, settings suffixes allowed."""
    return METHODS[parse_variant(name).base]


@dataclass
class RunOutput:
    """One method on one prompt."""

    token_ids: list[int]  # the new tokens only, the stop token included
    seconds: float  # wall-clock of the whole call, prefill included
    target_calls: int  # target forward passes that emitted tokens (our separate prefill pass excluded)
    draft_calls: int | None  # draft-model forward passes (None: the method has no draft model)
    # Per verification round (ours only; None for Hugging Face, whose rounds we do not observe):
    drafted_per_round: list[int] | None = None
    accepted_per_round: list[int] | None = None
    prefill_seconds: float | None = None  # ours: the target's prompt prefill within ``seconds`` (None for Hugging Face)
    reused_prompt_tokens: int = 0  # ours: prompt positions restored from the method's prefix cache (not prefilled)
    draft_seconds: float | None = None  # ours: drafting within ``seconds``
    verify_seconds: float | None = None  # ours: verification passes (and acceptance) within ``seconds``
    branches_verified: int = 0  # ours: runner-up tokens verified beside the chain (one-level draft trees)
    branches_accepted: int = 0  # ours: rounds that kept one


class Method(Protocol):
    name: str

    def forget(self) -> None:
        """Drop what earlier runs left that would make the next one cheaper (stored prefixes)."""

    def run(self, input_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> RunOutput: ...


class OursMethod:
    """A :class:`SpeculativeDecoder`, built once so adaptive cost estimates carry over between prompts."""

    def __init__(self, name: str, decoder: Any, prefix_caches: list[Any] | None = None) -> None:
        """``prefix_caches``: the method's own PrefixCaches (target's, draft's), cleared by :meth:`forget`."""
        self.name = name
        self.decoder = decoder
        self.prefix_caches = prefix_caches or []

    def forget(self) -> None:
        for cache in self.prefix_caches:
            cache.clear()

    def run(self, input_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> RunOutput:
        tokens: list[int] = []
        step = None
        started = time.perf_counter()
        # stream(), not generate(): the same work minus detokenizing, which HF's generate does not do either.
        for step in self.decoder.stream(input_ids, max_new_tokens, sampling):
            tokens.extend(step.token_ids)
        seconds = time.perf_counter() - started
        assert step is not None
        stats = step.stats
        return RunOutput(
            token_ids=tokens,
            seconds=seconds,
            target_calls=stats.target_calls,
            draft_calls=stats.draft_calls if self.decoder.drafter is not None else None,
            drafted_per_round=list(stats.drafted_per_round),
            accepted_per_round=list(stats.accepted_per_round),
            prefill_seconds=stats.prefill_s,
            reused_prompt_tokens=stats.reused_prompt_tokens,
            draft_seconds=stats.draft_s,
            verify_seconds=stats.verify_s,
            branches_verified=stats.branches_verified,
            branches_accepted=stats.branches_accepted,
        )


class HFMethod:
    """``target.generate(...)`` with explicit stop/pad ids and sampling settings, forward calls counted by hooks."""

    def __init__(self, name: str, target: Any, draft: Any | None, generate_kwargs: dict[str, Any], eos: list[int], pad: int | None) -> None:
        self.name = name
        self.target = target  # a transformers model
        self.draft = draft  # the assistant model for hf-assisted, else None
        self.generate_kwargs = generate_kwargs
        self.eos = eos
        self.pad = pad

    def forget(self) -> None:
        """Nothing to forget: transformers' generate keeps no state between calls."""

    def run(self, input_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> RunOutput:
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.target.device)  # [1, prompt]
        kwargs = dict(self.generate_kwargs)
        kwargs.update(_hf_sampling_kwargs(sampling))
        if not sampling.is_greedy and sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # HF samples from the global generator
        with _counting_calls(self.target) as target_calls, _counting_calls(self.draft) as draft_calls:
            started = time.perf_counter()
            with torch.inference_mode():
                output = self.target.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    # Our engine stops at exactly these ids by default; pass them so both sides agree.
                    eos_token_id=self.eos or None,
                    pad_token_id=self.pad,
                    **kwargs,
                )
            seconds = time.perf_counter() - started
        return RunOutput(
            token_ids=output[0, len(input_ids) :].tolist(),
            seconds=seconds,
            # HF has no separate prefill pass: its first call reads the prompt and emits the first
            # token (our prefill + first verification), so every call counts.
            target_calls=target_calls[0],
            draft_calls=draft_calls[0] if self.draft is not None else None,
        )


def build_method(
    name: str,
    target: Any,
    draft: Any | None,
    gamma: int,
    eagle_head: Any | None = None,
    head_quantize: bool = False,
    far_memory: Any | None = None,
    parallel_head: Any | None = None,
    draft_settings: Any | None = None,
    screen_lm_head: bool = True,
    tree_rows: int | None = None,
    prefix_cache_mb: int = 0,
    shared_prefixes: Any | None = None,
) -> Method:
    """Build ``name`` on the loaded models (``LoadedModel``s); ``draft`` may be None if the method needs none.

    ``name`` may carry ``:key=value`` settings (:func:`parse_variant`) that override ``gamma``,
    ``screen_lm_head`` and the draft settings for this method; the method keeps the full name as its label.

    ``eagle_head``: the EAGLE head (checkpoint path or ``EagleHead``) for the eagle methods, or a
    list of heads that a ``:head=N`` setting picks from (1-based; the first without it);
    ``head_quantize``: run the EAGLE and parallel heads with int8 linears.
    ``far_memory``: the ``FarMemoryConfig`` whose window / temperature / weight eagle-local,
    eagle-fold and eagle-auto use (each sets its own mode; default: the config's defaults), and the
    EAGLE and parallel methods with an ``attention`` setting (``ngram+eagle-adaptive:attention=fold``);
    without one they attend as trained.
    ``parallel_head``: the parallel head (checkpoint path or ``ParallelHead``) for the parallel methods.
    ``draft_settings``: the :class:`~verispec.drafters.draft_model.DraftModelSettings` of our
    draft-model methods (default: its defaults).
    ``screen_lm_head``: ``SpeculativeDecoder(screen_lm_head=...)`` for our methods (greedy passes).
    ``tree_rows``: ``SpeculativeDecoder(tree_rows=...)`` for our drafting methods (None: its default).
    ``prefix_cache_mb``: our methods each keep their own prefix caches of this size (the target's
    where it runs the fused lean stack, the draft model's where it does): a prompt starts from the
    longest prefix of the method's own earlier prompts and answers; 0: none.
    ``shared_prefixes``: a target :class:`~verispec.engine.prefix_cache.PrefixCache` this method
    shares with the run's other methods (``bench --share-prefill``) in place of its own: the first
    method to run a prompt prefills it, the others start from its keys, values and features (exact:
    the same tokens). A method's own ``:prefix=MB`` setting still gives it a cache of its own.
    """
    variant = parse_variant(name)
    label = name  # the full name, settings included, labels the rows; the base name picks the method
    heads = list(eagle_head) if isinstance(eagle_head, (list, tuple)) else [] if eagle_head is None else [eagle_head]
    if variant.head is not None and variant.head > len(heads):
        raise ValueError(f"--methods: {label!r} picks EAGLE head {variant.head}, but the run has {len(heads)} (repeat --eagle-head to give more)")
    eagle_head = heads[(variant.head or 1) - 1] if heads else None
    spec, name = METHODS[variant.base], variant.base
    if spec.needs_draft and draft is None:
        raise ValueError(f"method {name!r} needs a draft model")
    if spec.family == "hf":
        return _build_hf(name, target, draft)
    from verispec.drafters import lookup_then_model
    from verispec.drafters.draft_model import DraftModelSettings, tree_alternatives
    from verispec.engine import SpeculativeDecoder
    from verispec.engine.decoder import DEFAULT_TREE_ROWS

    gamma = variant.gamma if variant.gamma is not None else gamma
    settings = draft_settings if draft_settings is not None else DraftModelSettings()
    overrides = {"draft_vocab": variant.vocab, "confidence_threshold": variant.confidence, "path_confidence": variant.path}
    settings = replace(settings, **{key: value or None for key, value in overrides.items() if value is not None})  # 0 = off
    tree_rows = variant.tree if variant.tree is not None else tree_rows if tree_rows is not None else DEFAULT_TREE_ROWS
    settings = replace(settings, alternatives=tree_alternatives(tree_rows))
    if variant.dhead is not None:
        settings = replace(settings, greedy_head="screened" if variant.dhead else "full")
    if variant.dwin is not None:
        settings = replace(settings, context_window=variant.dwin or None)
    if variant.screen is not None:
        screen_lm_head = bool(variant.screen)

    from verispec.engine.lean_lm import prefix_reuse_unsupported_reason
    from verispec.engine.prefix_cache import prefix_cache_of_mb

    prefix_cache_mb = variant.prefix if variant.prefix is not None else prefix_cache_mb
    if shared_prefixes is not None and variant.prefix is None:
        target_prefixes = shared_prefixes
    else:
        target_prefixes = prefix_cache_of_mb(prefix_cache_mb) if prefix_cache_mb and prefix_reuse_unsupported_reason(target.model) is None else None
    settings = replace(settings, prefix_cache_mb=prefix_cache_mb)
    if name == "plain":
        return OursMethod(label, SpeculativeDecoder(target, screen_lm_head=screen_lm_head, prefix_cache=target_prefixes), [target_prefixes] if target_prefixes is not None else [])
    adaptive = {"adaptive_gamma": True} if name.endswith("-adaptive") else {}
    model_drafter = None  # the draft model (its prefix cache is the method's too)
    tree_max_context = None  # bench trees run at every length unless the method is generate's default
    if name.startswith("draft-model"):
        drafter = model_drafter = settings.build(draft, name=draft.name)
    elif name.startswith(EAGLE_HEAD_PREFIXES):
        from verispec.drafters.eagle import EagleDrafter

        if eagle_head is None:
            raise ValueError(f"method {name!r} needs an EAGLE head (--eagle-head PATH; `verispec eagle build` trains one)")
        mode = {"eagle-local": "local", "eagle-fold": "fold", "eagle-auto": "auto"}.get(name.removesuffix("-adaptive"), variant.attention)
        settings = replace(far_memory or FarMemoryConfig(), mode=mode) if mode is not None else None
        drafter = EagleDrafter(
            target, eagle_head, quantize=head_quantize, far_memory=settings, path_confidence=variant.path, alternatives=tree_alternatives(tree_rows),
            expand=(variant.expand or 0) if tree_rows else 0,
        )  # fmt: skip
        if name.startswith("ngram+"):
            drafter = lookup_then_model(drafter)
    elif name.startswith("parallel"):
        from verispec.drafters.parallel import ParallelDrafter

        if parallel_head is None:
            raise ValueError(f"method {name!r} needs a parallel head (--parallel-head PATH; `verispec parallel train` trains one)")
        corrector = None
        if name == "parallel-corrected-eagle":
            if eagle_head is None:
                raise ValueError(f"method {name!r} needs an EAGLE head for its pair fit (--eagle-head PATH, or the bundled head)")
            corrector = eagle_head
        attention = replace(far_memory or FarMemoryConfig(), mode=variant.attention) if variant.attention not in (None, "full") else None
        drafter = ParallelDrafter(
            target, parallel_head, candidates=variant.cand or PARALLEL_CANDIDATES, correction=name != "parallel", quantize=head_quantize, alternatives=tree_alternatives(tree_rows),
            corrector=corrector, far_memory=attention, path_confidence=variant.path or None, path_rule=variant.rule, name=name,
        )  # fmt: skip
    elif name.startswith("ngram+"):
        model_drafter = settings.build(draft, name=draft.name)
        drafter = lookup_then_model(model_drafter)
    elif name == "auto":
        drafter, model_drafter = _auto_drafter(target, draft, eagle_head, head_quantize, far_memory, settings, tree_rows)
        gamma, adaptive = variant.gamma or STREAM_GAMMA, {"adaptive_gamma": True}
        tree_max_context = LONG_CONTEXT_TREE_LIMIT  # generate's trees end there too
    else:
        drafter = lookup_drafter(variant.tune)
    decoder = SpeculativeDecoder(
        target, drafter, gamma=gamma, screen_lm_head=screen_lm_head, tree_rows=tree_rows, prefix_cache=target_prefixes, tree_max_context=tree_max_context, **adaptive
    )
    caches = [cache for cache in (target_prefixes, getattr(model_drafter, "prefix_cache", None)) if cache is not None]
    return OursMethod(label, decoder, caches)


def _auto_drafter(target: Any, draft: Any, eagle_head: Any | None, head_quantize: bool, far_memory: Any | None, settings: Any, tree_rows: int) -> tuple[Any, Any]:
    """(``--drafter auto`` as ``generate`` builds it, its draft model): lookup + draft model (path stop
    STREAM_PATH_CONFIDENCE, chains) below DEFAULT_LONG_PROMPT prompt tokens, lookup + EAGLE head
    (path stop EAGLE_PATH_CONFIDENCE, attention auto, runner-ups for ``tree_rows``) from there."""
    from verispec.drafters import LengthSwitchDrafter, lookup_then_model
    from verispec.drafters.draft_model import tree_alternatives
    from verispec.drafters.eagle import EagleDrafter
    from verispec.drafters.eagle.drafter import EAGLE_PATH_CONFIDENCE

    if eagle_head is None:
        raise ValueError("method 'auto' needs an EAGLE head for its long prompts (--eagle-head PATH, or the bundled head)")
    model_drafter = replace(settings, path_confidence=STREAM_PATH_CONFIDENCE, alternatives=0).build(draft, name=draft.name)
    attention = replace(far_memory or FarMemoryConfig(), mode="auto")
    head = EagleDrafter(target, eagle_head, quantize=head_quantize, far_memory=attention, path_confidence=EAGLE_PATH_CONFIDENCE, alternatives=tree_alternatives(tree_rows))
    return LengthSwitchDrafter(lookup_then_model(model_drafter), lookup_then_model(head), DEFAULT_LONG_PROMPT), model_drafter


def lookup_drafter(tune: int | None) -> Any:
    """The ``ngram`` methods' drafter: the self-tuning prompt lookup, or with ``tune`` 0 its
    latest-match rule alone (a ``NgramDrafter``)."""
    from verispec.drafters import LookupRule, NgramDrafter

    return NgramDrafter(LookupRule()) if tune == 0 else NgramDrafter()


def _build_hf(name: str, target: Any, draft: Any | None) -> HFMethod:
    model = target.model
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = model.generation_config.pad_token_id
    if pad is None and target.tokenizer is not None:
        pad = target.tokenizer.pad_token_id
    if pad is None and eos:
        pad = eos[0]  # what HF would pick itself, minus its warning
    kwargs: dict[str, Any] = {}
    assistant = None
    if name == "hf-assisted":
        assistant = draft.model
        kwargs["assistant_model"] = assistant
    elif name == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    return HFMethod(name, model, assistant, kwargs, eos, pad)


def _hf_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    # repetition_penalty 1.0 explicitly: a model's generation_config may ship one (Qwen's hub
    # configs do), and ours applies none; anything else would change the output, not just the speed.
    if sampling.is_greedy:
        return {"do_sample": False, "repetition_penalty": 1.0}
    # top_k 0 disables top-k in HF as in ours (HF's own default would be 50).
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "repetition_penalty": 1.0}


@contextmanager
def _counting_calls(module: torch.nn.Module | None) -> Iterator[list[int]]:
    """Count ``module``'s forward calls while the block runs (a forward hook; nothing is patched)."""
    count = [0]
    if module is None:
        yield count
        return

    def hook(*_: Any) -> None:
        count[0] += 1

    handle = module.register_forward_hook(hook)
    try:
        yield count
    finally:
        handle.remove()
