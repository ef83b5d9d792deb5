"""``verispec attack``: search a rejection-attack suffix, then time plain, fixed-gamma and controlled decoding."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def add_attack_parser(commands) -> None:  # noqa: ANN001 - argparse's subparsers action
    from verispec.bench.attack import AttackSettings
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    defaults = AttackSettings()
    attack = commands.add_parser("attack", help="red-team the draft model: find a prompt suffix that minimises its acceptance; compare plain, fixed-gamma and adaptive decoding on clean, random-suffix and attacked prompts")
    attack.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    attack.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model attacked (default {DEFAULT_DRAFT})")
    attack.add_argument("--prompt", default=None, help="the prompt (default: HumanEval problem --humaneval-index in the chat template)")
    attack.add_argument("--humaneval-index", type=int, default=0, help="HumanEval problem used when --prompt is not given (default 0)")
    attack.add_argument("--suffix-tokens", type=int, default=defaults.suffix_tokens, help=f"suffix length (default {defaults.suffix_tokens})")
    attack.add_argument("--steps", type=int, default=defaults.steps, help=f"search steps (default {defaults.steps})")
    attack.add_argument("--candidates", type=int, default=defaults.candidates, help=f"token swaps tried per step (default {defaults.candidates})")
    attack.add_argument("--continuation-tokens", type=int, default=defaults.continuation_tokens, help=f"target continuation the acceptance is measured on (default {defaults.continuation_tokens})")
    attack.add_argument("--quality-weight", type=float, default=defaults.quality_weight, help="penalty weight on the clean answer's NLL after the suffix (stealth); 0 = strongest attack")
    attack.add_argument("--seed", type=int, default=defaults.seed, help="search seed (default 0)")
    attack.add_argument("--gamma", type=int, default=4, help="drafts per round for fixed-gamma decoding, the maximum for adaptive (default 4)")
    attack.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per timed run (default 64)")
    attack.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    attack.add_argument("--cache-dir", type=Path, default=None)
    attack.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the suffix and the table as JSON")
    attack.set_defaults(handler=_attack)


def _attack(args: argparse.Namespace) -> int:
    import torch

    from verispec.bench.attack import AttackSettings, search_suffix
    from verispec.bench.prompts import humaneval_prompts
    from verispec.drafters import DraftModel
    from verispec.engine import SpeculativeDecoder
    from verispec.models import encode_prompt, load_model

    settings = AttackSettings(
        suffix_tokens=args.suffix_tokens, steps=args.steps, candidates=args.candidates,
        continuation_tokens=args.continuation_tokens, quality_weight=args.quality_weight, seed=args.seed,
    )  # fmt: skip
    if args.gamma < 1 or args.max_new_tokens < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError("--gamma, --max-new-tokens and --threads must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, cache_dir=args.cache_dir)
    draft = load_model(args.draft, cache_dir=args.cache_dir)
    text = args.prompt if args.prompt is not None else humaneval_prompts(args.humaneval_index + 1)[args.humaneval_index].text
    prompt = encode_prompt(target.tokenizer, text)
    # Suffix tokens: any ordinary token both models have (special tokens would end or restructure the turn).
    special = set(target.tokenizer.all_special_ids)
    vocab = min(len(target.tokenizer), target.model.get_output_embeddings().out_features, draft.model.get_output_embeddings().out_features)
    allowed = [token for token in range(vocab) if token not in special]
    result = search_suffix(target, draft, prompt, settings, allowed, progress=True)
    rng = random.Random(args.seed + 1)
    random_suffix = [rng.choice(allowed) for _ in range(settings.suffix_tokens)]
    print(f"suffix {target.tokenizer.decode(result.suffix)!r}: expected acceptance {result.expected_acceptance:.3f} (the random start: {result.initial_expected_acceptance:.3f})")

    decoders = {
        "plain": SpeculativeDecoder(target),
        f"fixed gamma {args.gamma}": SpeculativeDecoder(target, DraftModel(draft), gamma=args.gamma),
        "adaptive": SpeculativeDecoder(target, DraftModel(draft), gamma=args.gamma, adaptive_gamma=True),
    }
    rows = []
    for label, ids in (("clean", prompt), ("random suffix", prompt + random_suffix), ("attack suffix", prompt + result.suffix)):
        plain_speed = None
        for name, decoder in decoders.items():  # interleaved per prompt: machine noise hits all alike
            stats = decoder.generate(ids, args.max_new_tokens, stop=[]).stats
            plain_speed = stats.tokens_per_second if name == "plain" else plain_speed
            rows.append({"prompt": label, "method": name, "tokens_per_s": stats.tokens_per_second, "vs_plain": stats.tokens_per_second / plain_speed,
                         "alpha": stats.acceptance_rate, "tau": stats.tokens_per_call})  # fmt: skip
            print(f"{label:14s} {name:16s} {stats.tokens_per_second:6.2f} tok/s  {rows[-1]['vs_plain']:.2f}x plain  alpha {stats.acceptance_rate:.2f}  tau {stats.tokens_per_call:.2f}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"suffix": result.suffix, "suffix_text": target.tokenizer.decode(result.suffix), "expected_acceptance": result.expected_acceptance,
                                         "initial_expected_acceptance": result.initial_expected_acceptance, "history": result.history, "rows": rows}, indent=1))  # fmt: skip
    print("the output is the target's in every row (speculation is lossless); only speed differs", file=sys.stderr)
    return 0
