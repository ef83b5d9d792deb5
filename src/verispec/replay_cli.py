"""``verispec replay``: rank drafting settings on recorded greedy traces (:mod:`verispec.bench.replay`).

Records each prompt's greedy answer and the draft model's teacher-forced view of it once (cached in
a traces file, reused by later runs with the same models and length), measures the pass costs here
(or takes them from ``--verify-ms`` / ``--draft-ms``), then replays every setting on every trace in
seconds. What chose the defaults (README, Performance) — rerunnable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_SETTINGS = "ngram+draft-adaptive:gamma=16:path=0.45,ngram+draft-adaptive:gamma=10,ngram+draft-adaptive:gamma=16:path=0.3,ngram+draft-adaptive:gamma=16:path=0.6"
COST_ROWS = [1, 2, 4, 8, 12, 17]


def add_replay_parser(commands, add_kernel_options) -> None:  # noqa: ANN001 - argparse's subparsers action, cli's option adder
    from verispec.argtypes import positive_int
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    replay = commands.add_parser(
        "replay",
        help="rank drafting settings (gamma, path/confidence stops, lookup) by replaying recorded greedy answers under measured pass costs",
        description="Records the target's greedy answers and the draft model's token and probability at every answer position once "
        "(--traces, reused), then replays greedy decoding under each --settings entry with the adaptive controller fed modelled costs: "
        "modelled decode speed-up over plain decoding, tau and alpha per setting, in seconds per setting. Ranks settings; `verispec bench` measures them.",
    )
    replay.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    replay.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    replay.add_argument("--set", choices=["humaneval", "spec-bench"], default="humaneval", help="prompts: HumanEval problems, or Spec-Bench dev questions per category (default humaneval)")
    replay.add_argument("--first", type=int, default=8, help="skip this many prompts (per category for spec-bench) so the benchmark's own prompts stay out of the tuning (default 8: bench runs HumanEval 0-7)")
    replay.add_argument("--num-prompts", type=positive_int, default=24, help="prompts (per category for spec-bench) after --first (default 24)")
    replay.add_argument("--spec-bench", type=Path, default=None, help="Spec-Bench dev file (default ../shared/data/spec_bench/dev.jsonl)")
    replay.add_argument("--max-new-tokens", type=positive_int, default=128)
    replay.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma list of bench method names with settings, from draft-model[-adaptive], ngram[-adaptive], ngram+draft[-adaptive] (default {DEFAULT_SETTINGS})")
    replay.add_argument("--gamma", type=positive_int, default=6, help="gamma for settings that do not set one (default 6)")
    replay.add_argument("--verify-ms", default=None, metavar="ROWS:MS,...", help=f"target pass costs, e.g. 1:237,4:273,8:315 (default: measured here, rows {','.join(map(str, COST_ROWS))}, greedy through the screened head on code text)")
    replay.add_argument("--draft-ms", type=float, default=None, help="draft model step cost (default: measured here, one token)")
    replay.add_argument("--traces", type=Path, default=None, help="traces file, read and extended (default <out>/traces.json)")
    replay.add_argument("--threads", type=positive_int, default=None)
    replay.add_argument("--cache-dir", type=Path, default=None)
    replay.add_argument("--out", type=Path, default=Path("replay-results"), help="output directory: traces.json, replay.json (default replay-results/)")
    add_kernel_options(replay)
    replay.set_defaults(handler=_replay)


def parse_verify_ms(text: str) -> dict[int, float]:
    """``1:237,4:273`` -> {1: 0.237, 4: 0.273}; ValueError naming --verify-ms otherwise."""
    costs: dict[int, float] = {}
    for item in text.split(","):
        rows, sep, ms = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            costs[int(rows)] = float(ms) / 1000
        except ValueError:
            raise ValueError(f"--verify-ms: expected ROWS:MS entries like 1:237,4:273, got {item.strip()!r}") from None
    if 1 not in costs or min(costs) < 1 or min(costs.values()) <= 0:
        raise ValueError(f"--verify-ms needs a positive cost for 1 row (and row counts >= 1), got {text!r}")
    return costs


def _prompts(args: argparse.Namespace):  # noqa: ANN202 - list[Prompt]
    from verispec.bench.prompts import DEFAULT_SPEC_BENCH, humaneval_prompts, spec_bench_prompts

    if args.first < 0:
        raise ValueError(f"--first must be >= 0, got {args.first}")
    if args.set == "humaneval":
        return humaneval_prompts(args.first + args.num_prompts)[args.first :]
    taken: dict[str, int] = {}
    kept = []
    for prompt in spec_bench_prompts(args.spec_bench or DEFAULT_SPEC_BENCH):
        index = taken[prompt.category] = taken.get(prompt.category, -1) + 1
        if args.first <= index < args.first + args.num_prompts:
            kept.append(prompt)
    return kept


def _replay(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from verispec.bench.methods import parse_methods, parse_variant
    from verispec.bench.replay import REPLAY_BASES, TRACE_FORMAT, DraftTrace, ReplayCosts, record_trace, replay, summarize_replays
    from verispec.bench.runner import conversation_ids
    from verispec.cli import _prepare_models, draft_model_settings, target_dtype
    from verispec.drafters.combined import STREAM_GAMMA, lookup_then_model
    from verispec.engine import SpeculativeDecoder
    from verispec.engine.gamma import StepCosts
    from verispec.models import load_model

    settings = parse_methods(args.settings)
    for setting in settings:  # before any model loads (replay() checks the same when it runs)
        if parse_variant(setting).base not in REPLAY_BASES:
            raise ValueError(f"--settings: {setting!r}: replay takes {', '.join(REPLAY_BASES)}")
    verify_given = parse_verify_ms(args.verify_ms) if args.verify_ms else None
    if args.draft_ms is not None and args.draft_ms < 0:
        raise ValueError(f"--draft-ms must be >= 0, got {args.draft_ms}")
    prompts = _prompts(args)
    if not prompts:
        raise ValueError("no prompts after --first; lower --first")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    traces_path = args.traces or args.out / "traces.json"
    # The served target's dtype is part of what it answers: a bfloat16 target's greedy text differs.
    key = {"target": args.target, "target_dtype": args.target_dtype, "draft": args.draft, "max_new_tokens": args.max_new_tokens, "format": TRACE_FORMAT}
    stored = json.loads(traces_path.read_text()) if traces_path.exists() else {}
    traces = {t["prompt_id"]: DraftTrace(**t) for t in stored.get("traces", [])} if {k: stored.get(k) for k in key} == key else {}
    missing = [p for p in prompts if p.id not in traces]
    needs_costs = verify_given is None or args.draft_ms is None
    if missing or needs_costs:
        target = load_model(args.target, cache_dir=args.cache_dir, dtype=target_dtype(args))
        draft = load_model(args.draft, cache_dir=args.cache_dir)
        _prepare_models(args, target, draft)
        drafter = draft_model_settings(args).build(draft)
        decoder = SpeculativeDecoder(target, lookup_then_model(drafter), gamma=STREAM_GAMMA, adaptive_gamma=True)
        for prompt in tqdm(missing, desc="recording traces", unit="prompt", file=sys.stderr):
            ids = conversation_ids(target.tokenizer, [{"role": "user", "content": prompt.text}], True)
            traces[prompt.id] = record_trace(prompt.id, decoder, drafter, ids, args.max_new_tokens)
            traces_path.write_text(json.dumps({**key, "traces": [vars(trace) for trace in traces.values()]}))  # after every prompt
        verify_s, draft_step_s = _measured_costs(target, draft, verify_given, args.draft_ms)
    else:
        verify_s, draft_step_s = verify_given, args.draft_ms / 1000
    costs = ReplayCosts(verify_s, draft_step_s)
    print(f"costs (ms): target pass {', '.join(f'{r} rows {s * 1e3:.0f}' for r, s in sorted(verify_s.items()))}; draft step {draft_step_s * 1e3:.1f}", file=sys.stderr)
    results = []
    for setting in settings:
        shared = StepCosts()  # one table per setting, carried over its prompts as in a benchmark run
        results += [replay(traces[prompt.id], setting, costs, args.gamma, shared) for prompt in prompts]
    summaries = summarize_replays(results, settings)
    width = max(len(s.setting) for s in summaries)
    print(f"{'setting':<{width}}  modelled decode speed-up median (mean)  tau   alpha")
    for s in summaries:
        print(f"{s.setting:<{width}}  {s.median_speedup:.3f}x ({s.mean_speedup:.3f}x){'':16}  {s.tokens_per_call:.2f}  {s.acceptance_rate:.3f}")
    category = {prompt.id: prompt.category for prompt in prompts}
    by_category = {name: summarize_replays([r for r in results if category[r.prompt_id] == name], settings) for name in dict.fromkeys(category.values())}
    if len(by_category) > 1:
        print(f"\nmodelled decode speed-up by category, median (tau):\n{'category':<22}" + "".join(f"  setting {i + 1:<10}" for i in range(len(settings))))
        for name, rows in by_category.items():
            print(f"{name:<22}" + "".join(f"  {s.median_speedup:6.3f}x ({s.tokens_per_call:4.2f})" for s in rows))
        print("settings: " + "; ".join(f"{i + 1} = {setting}" for i, setting in enumerate(settings)))
    (args.out / "replay.json").write_text(json.dumps({
        **key, "prompts": [p.id for p in prompts], "verify_ms": {r: s * 1e3 for r, s in verify_s.items()}, "draft_ms": draft_step_s * 1e3,
        "summaries": [vars(s) for s in summaries],
        "by_category": {name: [vars(s) for s in rows] for name, rows in by_category.items()},
        "rows": [vars(r) | {"speedup": r.speedup, "category": category[r.prompt_id]} for r in results],
    }, indent=1))  # fmt: skip
    print(f"results: {args.out / 'replay.json'}; traces: {traces_path}", file=sys.stderr)
    return 0


def _measured_costs(target, draft, verify_given, draft_ms):  # noqa: ANN001, ANN202 - LoadedModels -> (rows -> s, s)
    """Pass costs measured here as `verispec costs` does (target: greedy through the screened head on code text)."""
    from verispec.bench.costs import forward_costs, stdlib_text_ids

    verify_s = verify_given
    if verify_s is None:
        text = stdlib_text_ids(target.tokenizer, 300 + max(COST_ROWS))
        verify_s = {c.new_tokens: c.median_s for c in forward_costs(target.model, 300, COST_ROWS, 5, text_ids=text, argmax_only=True)}
    if draft_ms is not None:
        return verify_s, draft_ms / 1000
    step = forward_costs(draft.model, 300, [1], 9, lean=True, panel_kernels=True)[0].median_s
    return verify_s, step
