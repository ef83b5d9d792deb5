"""``verispec attack``: search a rejection-attack suffix, then benchmark every drafter under every stressor.

Two steps. The search (random coordinate descent, :mod:`verispec.bench.attack`) runs
the surrogate drafter (``--surrogate``: the draft model, or the EAGLE head) against the target on
the first prompt. Then every prompt is written under every
stressor (clean, random suffix, language switch, unusual format, the found suffix) to a prompts
file, and ``verispec bench`` runs the chosen methods on it: the report is a bench report whose
categories are the stressors - α, τ, tokens/s and the speed-up over plain decoding, per drafter
(the attack transfers or not to drafters it was not searched on), greedy or sampled.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from pathlib import Path

DEFAULT_ATTACK_METHODS = "plain,draft-model,draft-model-adaptive,ngram,ngram-adaptive"
SURROGATES = ("draft-model", "eagle")


def add_attack_parser(commands, add_sampling_options, add_kernel_options) -> None:  # noqa: ANN001 - argparse's subparsers action, cli's option adders
    from verispec.bench.attack import AttackSettings
    from verispec.bench.stressors import STRESSORS
    from verispec.argtypes import positive_int
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    defaults = AttackSettings()
    attack = commands.add_parser(
        "attack",
        help="red-team the drafters: search a prompt suffix that minimises the draft model's acceptance, then benchmark plain, fixed-gamma and adaptive decoding under it and under natural stressors",
        description="Step 1 searches a suffix (on the first prompt) that minimises the draft model's expected acceptance of the target's continuation. Step 2 writes every prompt under every stressor to <out>/prompts.jsonl and runs `verispec bench` on it: one category per stressor.",
    )
    attack.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    attack.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    attack.add_argument("--surrogate", choices=SURROGATES, default="draft-model", help="the drafter the suffix is searched against: draft-model (default, --draft) or eagle (the EAGLE head: --eagle-head or the target's default head; measure the transfer to the draft model and n-gram drafting with --methods)")
    attack.add_argument("--prompt", default=None, help="one prompt (default: the first --num-prompts HumanEval problems, in the chat template)")
    attack.add_argument("--num-prompts", type=positive_int, default=1, help="HumanEval problems (default 1); the suffix is searched on the first and planted in all (transfer across prompts)")
    attack.add_argument("--suffix-tokens", type=positive_int, default=defaults.suffix_tokens, help=f"suffix length (default {defaults.suffix_tokens})")
    attack.add_argument("--steps", type=positive_int, default=defaults.steps, help=f"search steps (default {defaults.steps})")
    attack.add_argument("--candidates", type=positive_int, default=defaults.candidates, help=f"token swaps tried per step (default {defaults.candidates})")
    attack.add_argument("--continuation-tokens", type=positive_int, default=defaults.continuation_tokens, help=f"target continuation the acceptance is measured on (default {defaults.continuation_tokens})")
    attack.add_argument("--quality-weight", type=float, default=defaults.quality_weight, help="penalty weight on the clean answer's NLL after the suffix (stealth); 0 = strongest attack")
    attack.add_argument("--search-seed", type=int, default=defaults.seed, help="search seed, also picks the random suffix (default 0)")
    attack.add_argument("--placement", choices=["message", "completion"], default="message", help="where the suffix is planted: message (default) = the end of the user's message inside the chat template (content a chat service processes); completion = the end of a raw prompt that the model continues without a template (what /v1/completions serves), right before the answer")
    attack.add_argument("--stressors", default=",".join(STRESSORS), help=f"comma list of {', '.join(STRESSORS)} (default: all)")
    attack.add_argument("--methods", default=DEFAULT_ATTACK_METHODS, help=f"bench methods run on every stressed prompt (default {DEFAULT_ATTACK_METHODS}; add eagle,eagle-adaptive for the EAGLE head)")
    attack.add_argument("--gamma", type=positive_int, default=4, help="drafts per round for fixed-gamma methods, the maximum for adaptive ones (default 4)")
    attack.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated per run (default 64)")
    add_sampling_options(attack)
    add_kernel_options(attack)
    attack.add_argument("--eagle-head", type=Path, default=None, metavar="PATH", help="EAGLE head for eagle methods and --surrogate eagle")
    attack.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    attack.add_argument("--cache-dir", type=Path, default=None)
    attack.add_argument("--out", type=Path, default=None, metavar="DIR", help="output directory: attack.json, prompts.jsonl and the bench report in bench/ (default attack-results/<timestamp>/)")
    attack.add_argument("--search-only", action="store_true", help="stop after writing attack.json and prompts.jsonl")
    attack.set_defaults(handler=_attack)


def _attack(args: argparse.Namespace) -> int:
    import time

    import torch

    from verispec.bench.attack import AttackSettings, search_suffix
    from verispec.bench.methods import parse_methods
    from verispec.bench.prompts import Prompt, humaneval_prompts
    from verispec.bench.stressors import parse_stressors, stressed_prompts, with_suffix
    from verispec.models import encode_prompt, load_model

    settings = AttackSettings(
        suffix_tokens=args.suffix_tokens, steps=args.steps, candidates=args.candidates,
        continuation_tokens=args.continuation_tokens, quality_weight=args.quality_weight, seed=args.search_seed,
    )  # fmt: skip
    stressors = parse_stressors(args.stressors)
    if args.prompt is not None and args.num_prompts != 1:
        raise ValueError("--num-prompts counts HumanEval problems; it cannot be combined with --prompt")
    parse_methods(args.methods)  # refuse unknown methods before minutes of searching
    if args.surrogate == "eagle":
        from verispec.drafters.eagle import existing_head_path

        eagle_head = existing_head_path(args.eagle_head, args.target, args.cache_dir)  # before minutes of loading
    out = args.out if args.out is not None else Path("attack-results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = [Prompt(id="prompt", category="user", text=args.prompt)] if args.prompt is not None else humaneval_prompts(args.num_prompts)

    # The search scores candidates with whole-sequence passes: dense kernels and a float32 surrogate.
    target = load_model(args.target, cache_dir=args.cache_dir)
    if args.surrogate == "eagle":
        from verispec.drafters.eagle import EagleDrafter

        draft = EagleDrafter(target, eagle_head)
        draft_vocab = draft.vocab_size
    else:
        draft = load_model(args.draft, cache_dir=args.cache_dir)
        draft_vocab = draft.model.get_output_embeddings().out_features
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise ValueError("--target has no tokenizer; the attack plants text in the user's message")
    # Suffix tokens: any ordinary token both models have (special tokens would end or restructure the turn).
    special = set(tokenizer.all_special_ids)
    vocab = min(len(tokenizer), target.model.get_output_embeddings().out_features, draft_vocab)
    allowed = [token for token in range(vocab) if token not in special]
    first = prompts[0].text

    chat = args.placement == "message"

    def attacked_ids(suffix: list[int]) -> list[int]:
        return encode_prompt(tokenizer, with_suffix(first, tokenizer.decode(suffix)) if suffix else first, chat=chat)

    result = search_suffix(target, draft, attacked_ids, settings, allowed, progress=True)
    rng = random.Random(args.search_seed + 1)
    random_suffix = tokenizer.decode([rng.choice(allowed) for _ in range(settings.suffix_tokens)])
    attack_suffix = tokenizer.decode(result.suffix)
    print(f"suffix {attack_suffix!r}: expected acceptance {result.expected_acceptance:.3f} (the random start: {result.initial_expected_acceptance:.3f})")
    summary = {
        "suffix": result.suffix, "suffix_text": attack_suffix, "random_suffix_text": random_suffix,
        "expected_acceptance": result.expected_acceptance, "initial_expected_acceptance": result.initial_expected_acceptance,
        "history": result.history, "settings": settings.__dict__, "searched_on": prompts[0].id, "placement": args.placement,
        "surrogate": args.surrogate,
    }  # fmt: skip
    (out / "attack.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    prompts_file = out / "prompts.jsonl"
    with prompts_file.open("w", encoding="utf-8") as lines:
        for prompt in stressed_prompts(prompts, stressors, random_suffix, attack_suffix):
            lines.write(json.dumps({"id": prompt.id, "category": prompt.category, "prompt": prompt.text}, ensure_ascii=False) + "\n")
    print(f"wrote {out / 'attack.json'} and {prompts_file}")
    if args.search_only:
        return 0
    del target, draft  # the bench loads the models as users run them (packed target, int8 draft by default)
    gc.collect()
    from verispec.cli import main

    return main(_bench_argv(args, prompts_file, out / "bench"))


def _bench_argv(args: argparse.Namespace, prompts_file: Path, out: Path) -> list[str]:
    """`verispec bench` on the stressed prompts with this command's decoding and kernel options."""
    argv = ["bench", "--prompts", str(prompts_file), "--out", str(out), "--target", args.target, "--draft", args.draft]
    if args.placement == "completion":
        argv.append("--raw")
    for option in ("methods", "gamma", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "target_dtype", "target_kernels",
                   "draft_confidence", "draft_path_confidence", "draft_vocab", "draft_quantize", "eagle_head", "threads", "cache_dir"):  # fmt: skip
        value = getattr(args, option)
        if value is not None:
            argv += [f"--{option.replace('_', '-')}", str(value)]
    return argv
