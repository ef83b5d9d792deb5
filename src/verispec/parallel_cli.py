"""``verispec parallel train``: the parallel (DCOCO) draft head's training as a command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verispec.argtypes import positive_int


def add_parallel_parser(commands) -> None:  # noqa: ANN001 - argparse's subparsers action
    from verispec.drafters.parallel.drafter import PARALLEL_CANDIDATES
    from verispec.drafters.parallel.train import ParallelTrainSettings
    from verispec.eagle_cli import FEATURE_DIRS, add_model_options

    parallel = commands.add_parser("parallel", help="parallel draft head (K positions per pass, contextual correction): train")
    steps = parallel.add_subparsers(dest="parallel_command", required=True)
    train = steps.add_parser(
        "train",
        help="train a parallel head on the EAGLE feature shards (CE over K block slots, cosine LR); resumable, a usable head at every checkpoint",
    )
    defaults = ParallelTrainSettings()
    add_model_options(train)
    train.add_argument("--features", type=Path, action="append", default=None, metavar="DIR", help=f"feature shards directory, repeatable (default: <cache>/eagle/<target>/{{{','.join(FEATURE_DIRS)}}}, those that exist)")
    train.add_argument("--out", type=Path, default=None, metavar="PATH", help="head file (default <cache>/eagle/<target>/parallel.safetensors)")
    train.add_argument("--eagle-head", type=Path, default=None, metavar="PATH", help="EAGLE head whose draft vocabulary the parallel head reuses (default <cache>/eagle/<target>/head.safetensors if it exists, else the bundled head)")
    train.add_argument("--init-from-eagle", action="store_true", help="start the context encoder (fc, layer 0, norm) from the EAGLE head's weights")
    train.add_argument("--block-size", type=positive_int, default=defaults.block_size, help=f"K, positions drafted per pass (default {defaults.block_size})")
    train.add_argument("--num-layers", type=int, choices=[1, 2], default=defaults.num_layers, help=f"decoder layers (default {defaults.num_layers})")
    train.add_argument("--epochs", type=float, default=defaults.epochs, help=f"passes over the sequences (default {defaults.epochs})")
    train.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate (default {defaults.lr})")
    train.add_argument("--sequences-per-step", type=positive_int, default=defaults.sequences_per_step, help=f"sequences per optimiser step (default {defaults.sequences_per_step})")
    train.add_argument("--cuts-per-sequence", type=positive_int, default=defaults.cuts_per_sequence, help=f"blocks drafted per sequence (default {defaults.cuts_per_sequence})")
    train.add_argument("--intermediate-size", type=positive_int, default=defaults.intermediate_size, help=f"the head's MLP width (default {defaults.intermediate_size}; must be the EAGLE head's with --init-from-eagle)")
    train.add_argument("--known-fraction", type=float, default=defaults.known_fraction, help=f"probability a block slot is given as its true token (default {defaults.known_fraction})")
    train.add_argument("--feature-weight", type=float, default=defaults.feature_weight, help=f"weight of the SmoothL1 term against the target's features (default {defaults.feature_weight})")
    train.add_argument("--anchor-weight", type=float, default=defaults.anchor_weight, help=f"weight of EAGLE's next-feature loss on each block's anchor (the last context row), which keeps the first draft at EAGLE's accuracy; 0 = off (default {defaults.anchor_weight})")
    train.add_argument("--checkpoint-every", type=positive_int, default=defaults.checkpoint_every, help=f"steps between checkpoints (default {defaults.checkpoint_every})")
    train.add_argument("--seed", type=int, default=defaults.seed, help="initialisation and data order (default 0)")
    train.set_defaults(handler=_train)

    from verispec.cli import add_target_dtype_option
    from verispec.eagle_cli import add_eval_prompt_options

    evaluate = steps.add_parser(
        "eval",
        help="greedy tau of the parallel head with and without contextual correction (pair fit by the parallel head, and by the EAGLE head) and of the EAGLE head, replayed on the target's recorded answers, per category",
        description="Records the target's greedy answers (16 at a time) and replays greedy decoding on them for each drafter: exact greedy tau and "
        "acceptance by draft position, no timing (`verispec bench` measures speed). Drafters: parallel (top-1 per position), parallel-corrected "
        "(--candidates per position, the best path by pair fit) and, unless --no-eagle, parallel-corrected with the EAGLE head's pair fit and the EAGLE head itself at the same gamma. Heads run as trained (float32).",
    )
    add_model_options(evaluate)
    add_target_dtype_option(evaluate, "precision the target runs in while recording its answers: float32 (default) or bfloat16")
    add_eval_prompt_options(evaluate, default_gamma=5)
    evaluate.add_argument("--parallel-head", type=Path, default=None, metavar="PATH", help="parallel head (default <cache>/eagle/<target>/parallel.safetensors if it exists, else the bundled head)")
    evaluate.add_argument("--candidates", type=positive_int, default=PARALLEL_CANDIDATES, metavar="M", help=f"candidates per position for the corrected drafter (default {PARALLEL_CANDIDATES})")
    evaluate.add_argument("--eagle-head", type=Path, default=None, metavar="PATH", help="EAGLE head to compare with (default <cache>/eagle/<target>/head.safetensors, else the bundled head)")
    evaluate.add_argument("--no-eagle", action="store_true", help="leave the EAGLE head out")
    evaluate.add_argument("--path-confidence", type=float, default=0.0, metavar="P", help="the parallel drafters end a round's path where the product of its block probabilities falls below P, in [0, 1) (0 = off, the default; the EAGLE head drafts all gamma)")
    evaluate.set_defaults(handler=_eval)


def _settings(args: argparse.Namespace):  # noqa: ANN202
    from verispec.drafters.parallel.train import ParallelTrainSettings

    return ParallelTrainSettings(
        epochs=args.epochs, lr=args.lr, sequences_per_step=args.sequences_per_step, cuts_per_sequence=args.cuts_per_sequence,
        block_size=args.block_size, num_layers=args.num_layers, intermediate_size=args.intermediate_size,
        known_fraction=args.known_fraction, feature_weight=args.feature_weight, anchor_weight=args.anchor_weight, init_from_eagle=args.init_from_eagle,
        checkpoint_every=args.checkpoint_every, seed=args.seed,
    )  # fmt: skip


def _train(args: argparse.Namespace) -> int:
    import torch

    from verispec.drafters.eagle import default_head_path
    from verispec.drafters.eagle.checkpoint import find_head
    from verispec.drafters.parallel.checkpoint import default_parallel_path
    from verispec.drafters.parallel.train import train_parallel_head
    from verispec.eagle_cli import default_feature_dirs
    from verispec.models import load_model

    settings = _settings(args)  # validate before minutes of loading
    eagle_default = default_head_path(args.target, args.cache_dir)
    dirs = args.features or default_feature_dirs(eagle_default.parent)
    if not dirs:
        raise FileNotFoundError(f"no features under {eagle_default.parent}: run `verispec eagle extract` / `verispec eagle answers` first")
    eagle_head = args.eagle_head or find_head(args.target, args.cache_dir)
    if args.eagle_head is not None and not args.eagle_head.is_file():
        raise FileNotFoundError(f"--eagle-head {str(args.eagle_head)!r} does not exist")
    if settings.init_from_eagle and eagle_head is None:
        raise ValueError(f"--init-from-eagle needs an EAGLE head: none at {eagle_default} or bundled, pass --eagle-head PATH")
    out = args.out or default_parallel_path(args.target, args.cache_dir)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, cache_dir=args.cache_dir)
    result = train_parallel_head(target, dirs, out, settings, eagle_head=eagle_head)
    print(json.dumps(result, indent=1))
    print(f"parallel head -> {out}", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from verispec.drafters.draft_model import checked_threshold
    from verispec.drafters.eagle import load_head
    from verispec.drafters.eagle.acceptance import accepted_prefixes, drafted_from_every_start, replay_rounds, target_choices
    from verispec.drafters.eagle.checkpoint import find_head
    from verispec.drafters.parallel import ParallelDrafter, load_parallel_head
    from verispec.drafters.parallel.acceptance import accepted_from_every_start as parallel_accepted
    from verispec.eagle_cli import answers_for_replay, check_eval_prompt_options, eval_prompts, load_target, print_rounds_by_category

    check_eval_prompt_options(args)  # before minutes of loading
    checked_threshold(args.path_confidence, "--path-confidence")
    prompts = eval_prompts(args)
    head_path = parallel_head_path(args)
    eagle_path = None if args.no_eagle else args.eagle_head or find_head(args.target, args.cache_dir)
    if eagle_path is not None and not eagle_path.is_file():
        raise FileNotFoundError(f"--eagle-head {str(eagle_path)!r} does not exist")
    target = load_target(args)
    head, vocab = load_parallel_head(head_path, target.model)
    eagle, eagle_vocab = load_head(eagle_path, target.model) if eagle_path is not None else (None, None)
    stop = {"path_confidence": args.path_confidence or None}
    drafters = {
        "parallel": ParallelDrafter(target, head, vocab, correction=False, candidates=1, **stop),
        f"parallel-corrected (m={args.candidates})": ParallelDrafter(target, head, vocab, candidates=args.candidates, **stop),
    }
    if eagle is not None:  # the same lattice, the pair fit scored by EAGLE steps (--pair-fit eagle), and the EAGLE head's successors
        drafters[f"parallel-corrected, EAGLE pair fit (m={args.candidates})"] = ParallelDrafter(target, head, vocab, candidates=args.candidates, corrector=eagle, path_rule="lattice", **stop)
        drafters[f"parallel-corrected, EAGLE successors (m={args.candidates})"] = ParallelDrafter(target, head, vocab, candidates=args.candidates, corrector=eagle, path_rule="successor", **stop)
    lm_weight = target.model.get_output_embeddings().weight.detach().float()  # the target's argmax; float32 once (a bfloat16 target)
    drafts = min(args.gamma, head.config.block_size)  # a parallel round drafts at most the head's K
    # name -> (head file, drafts a round at most, (drafted or None: all, accepted) from every start of a recorded text)
    scorers = {
        name: (head_path, drafts, lambda tokens, features, first_row, choice, drafter=drafter: parallel_accepted(drafter, tokens, features, drafts, choice, first_row=first_row))
        for name, drafter in drafters.items()
    }
    if eagle is not None:
        eagle_rows = lm_weight[eagle_vocab] if eagle_vocab is not None else lm_weight
        embed = target.model.get_input_embeddings()
        scorers["eagle"] = (
            eagle_path, args.gamma,
            lambda tokens, features, first_row, choice: (None, accepted_prefixes(drafted_from_every_start(eagle, embed, eagle_rows, eagle_vocab, tokens, features, args.gamma), tokens, choice)),
        )  # fmt: skip
    rounds: dict[str, list] = {name: [] for name in scorers}
    for prompt, tokens, features in answers_for_replay(args, target, [prompt.text for prompt in prompts]):
        first_row = len(prompt) - 2  # the first round's catch-up row: the prompt but its last token is prefilled
        choice = target_choices(features, lm_weight)  # [n]: once per answer, not per drafter (a 151,936-row product)
        for name, (_, gamma, from_every_start) in scorers.items():
            drafted, accepted = from_every_start(tokens, features, first_row, choice)
            rounds[name].append(replay_rounds(accepted, first_row, len(tokens) + 1, gamma, drafted))
    for name, per_prompt in rounds.items():
        path, gamma, _ = scorers[name]
        stop_note = f" (path stop {args.path_confidence:g})" if args.path_confidence and name != "eagle" else ""
        print(f"{name} ({path.name}), up to {gamma} drafts a round{stop_note}, {args.max_new_tokens} new tokens, replayed greedy decoding:")
        print_rounds_by_category(prompts, per_prompt)
    return 0


def add_parallel_drafter_options(sub: argparse.ArgumentParser) -> None:
    """``--drafter parallel``'s options, for every command that decodes with a drafter."""
    from verispec.drafters.parallel.drafter import PARALLEL_CANDIDATES, PARALLEL_PATH_RULE, PATH_RULES

    sub.add_argument("--parallel-head", type=Path, default=None, metavar="PATH", help="parallel head for --drafter parallel (default <cache>/eagle/<target>/parallel.safetensors, made by `verispec parallel train`, if it exists, else the bundled head)")
    sub.add_argument("--block-size", type=positive_int, default=None, metavar="K", help="--drafter parallel: drafts per round at most (default: the head's K; at most K)")
    sub.add_argument("--candidates", type=positive_int, default=PARALLEL_CANDIDATES, metavar="M", help=f"--drafter parallel: candidates kept per position for contextual correction (default {PARALLEL_CANDIDATES})")
    sub.add_argument("--no-correction", dest="correction", action="store_false", help="--drafter parallel: top-1 per position, one head pass a round (no contextual correction)")
    sub.add_argument(
        "--pair-fit", choices=["auto", "parallel", "eagle"], default="auto",
        help="--drafter parallel: what scores how a candidate fits the one before it — one EAGLE-head step per candidate, reading it as the token "
        "one step ahead (eagle; --eagle-head, one built here or the bundled head), or the parallel head given that candidate as a known slot "
        "(parallel); auto (default): eagle when the target has an EAGLE head, else parallel",
    )  # fmt: skip
    sub.add_argument(
        "--path-rule", choices=PATH_RULES, default=None,
        help=f"--drafter parallel with the EAGLE pair fit: how the path is picked — each draft after the first the EAGLE head's most likely token "
        f"after the one before it (successor), or the best path through the lattice of the block's candidates (lattice); default {PARALLEL_PATH_RULE}",
    )  # fmt: skip


def parallel_corrector_path(args: argparse.Namespace) -> Path | None:
    """The EAGLE head that scores --drafter parallel's pair fit, or None for the parallel head's own
    fit (or no correction); checked before minutes of model loading. ``--pair-fit auto`` takes the
    EAGLE head when one is found: the head's own fit never changed a path in our replays and costs
    more a round (README, Parallel drafting), the EAGLE fit raised HumanEval's tau by 5-6%.
    ``--path-rule successor`` without an EAGLE head is refused here."""
    if getattr(args, "drafter", None) != "parallel":
        return None
    corrector = _corrector_path(args)
    if corrector is None and getattr(args, "path_rule", None) == "successor":
        raise ValueError("--path-rule successor drafts the EAGLE head's own next tokens: it needs the EAGLE pair fit (--pair-fit eagle, or auto with an EAGLE head)")
    return corrector


def _corrector_path(args: argparse.Namespace) -> Path | None:
    """The EAGLE head --pair-fit and --eagle-head ask for (see :func:`parallel_corrector_path`)."""
    from verispec.drafters.eagle import existing_head_path
    from verispec.drafters.eagle.checkpoint import find_head

    pair_fit = getattr(args, "pair_fit", "auto")
    if pair_fit == "parallel":
        return None
    if not args.correction:
        if pair_fit == "eagle":
            raise ValueError("--pair-fit eagle scores contextual correction: it cannot be combined with --no-correction")
        return None
    if pair_fit == "eagle" or args.eagle_head is not None:
        return existing_head_path(args.eagle_head, args.target, args.cache_dir)
    head = find_head(args.target, args.cache_dir)
    if head is None:
        print(f"verispec: no EAGLE head for {args.target}: --drafter parallel scores its pair fit with the parallel head (--pair-fit parallel)", file=sys.stderr)
    return head


def parallel_head_path(args: argparse.Namespace) -> Path:
    """The parallel head to load (--parallel-head or the default), checked to exist before minutes of model loading."""
    from verispec.drafters.parallel import existing_parallel_path

    return existing_parallel_path(args.parallel_head, args.target, args.cache_dir)


def parallel_drafter_from_args(args: argparse.Namespace, target, head_path: Path, corrector: Path | None = None):  # noqa: ANN001, ANN201 - a LoadedModel -> ParallelDrafter
    """--drafter parallel's drafter; ``corrector``: the EAGLE head scoring the pair fit (--pair-fit eagle)."""
    from verispec.drafters.parallel import ParallelDrafter
    from verispec.drafters.parallel.drafter import PARALLEL_PATH_CONFIDENCE

    from verispec.drafters.draft_model import tree_alternatives

    from verispec.far_memory_cli import far_memory_from_args

    quantize = getattr(args, "draft_quantize", "none") == "int8"
    alternatives = tree_alternatives(getattr(args, "tree_rows", 0))
    # --path-rule successor without a corrector was refused by parallel_corrector_path, before loading.
    path_rule = getattr(args, "path_rule", None)  # None: the drafter's default (PARALLEL_PATH_RULE with the EAGLE fit)
    far_memory = far_memory_from_args(args) if hasattr(args, "local_window") else None
    return ParallelDrafter(
        target, head_path, block_size=args.block_size, candidates=args.candidates, correction=args.correction, quantize=quantize, alternatives=alternatives,
        corrector=corrector, far_memory=far_memory, path_confidence=PARALLEL_PATH_CONFIDENCE, path_rule=path_rule,
    )  # fmt: skip


def print_proposal_costs(context: int, repeats: int, target, head_path: Path, eagle_head: Path | None) -> None:  # noqa: ANN001 - a LoadedModel
    """`verispec costs`: drafting cost per proposed token, the parallel head's (with and without
    correction) next to the EAGLE head's, for a round of K drafts after a ``context``-token context."""
    from verispec.bench.costs import proposal_cost
    from verispec.drafters.eagle import EagleDrafter, load_head
    from verispec.drafters.parallel import ParallelDrafter, load_parallel_head

    # Each head file is read once; every drafter below builds on it (int8 ones on their own copy).
    parallel, parallel_vocab = load_parallel_head(head_path, target.model)
    eagle = load_head(eagle_head, target.model) if eagle_head is not None else None
    drafts = parallel.config.block_size
    print(f"drafting cost per proposed token, rounds of {drafts} drafts after a {context}-token context:")
    for quantize in (False, True):  # the bench drafts in int8 (--draft-quantize int8, the default)
        precision = "int8" if quantize else "float32"
        costs = {"parallel": proposal_cost(ParallelDrafter(target, parallel, parallel_vocab, correction=False, quantize=quantize), context, drafts, repeats)}
        costs["parallel-corrected"] = proposal_cost(ParallelDrafter(target, parallel, parallel_vocab, quantize=quantize), context, drafts, repeats)
        if eagle is not None:
            corrected = ParallelDrafter(target, parallel, parallel_vocab, quantize=quantize, corrector=eagle[0])  # the default path rule, as generate drafts
            costs["parallel-corrected-eagle"] = proposal_cost(corrected, context, drafts, repeats)
            costs["eagle"] = proposal_cost(EagleDrafter(target, *eagle, quantize=quantize), context, drafts, repeats)
        for name, seconds in costs.items():
            ratio = f" ({seconds / costs['eagle']:.2f}x eagle)" if "eagle" in costs else ""
            print(f"  {name + ', ' + precision:<28}{seconds * 1000:7.2f} ms{ratio}")


def parallel_served_rounds(context: int, repeats: int, target, head_path: Path, eagle_head: Path | None) -> list[str]:  # noqa: ANN001 - a LoadedModel
    """`verispec costs`: what a server round's corrected parallel drafting costs (int8, the EAGLE fit
    where there is an EAGLE head: what `serve --drafter parallel` runs) for 4 and 8 requests drafting
    a block each, every session alone and all together (:meth:`ParallelSession.propose_many`)."""
    from verispec.bench.costs import served_round_cost
    from verispec.drafters.parallel import ParallelDrafter
    from verispec.drafters.parallel.drafter import PARALLEL_PATH_CONFIDENCE

    name = "parallel int8, corrected" + (" by the EAGLE fit" if eagle_head is not None else "")
    lines = []
    for path_confidence in (None, PARALLEL_PATH_CONFIDENCE):  # whole blocks; the path stop serve uses (on random features it stops early)
        drafter = ParallelDrafter(target, head_path, quantize=True, corrector=eagle_head, path_confidence=path_confidence)
        for requests in (4, 8):
            alone_s, together_s = served_round_cost(drafter, context, requests, drafter.block_size, repeats)
            stop = "whole blocks" if path_confidence is None else f"path stop {path_confidence}"
            lines.append(f"{name}: a server round of {requests} requests drafting up to {drafter.block_size} each ({stop}): {alone_s * 1000:.1f} ms alone, {together_s * 1000:.1f} ms together ({alone_s / together_s:.1f}x)")
            print(f"costs: {lines[-1]}", file=sys.stderr, flush=True)
    return lines
