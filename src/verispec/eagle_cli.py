"""``verispec eagle extract | train | build | eval``: the EAGLE head's pipeline as commands."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from verispec.argtypes import positive_int

# Where `eagle extract` and `eagle answers` write under <cache>/eagle/<target>/, and what `eagle
# train` and `parallel train` read by default (those that exist): stdlib sources, answers to stdlib
# requests, answers to package requests. (corpus.REQUEST_SOURCES, not imported: --help loads nothing.)
FEATURE_DIRS = ("features", "answers", "answers-packages")
REQUEST_SOURCES = ("stdlib", "packages")


def add_eagle_parser(commands) -> None:  # noqa: ANN001 - argparse's subparsers action
    eagle = commands.add_parser("eagle", help="EAGLE draft head: extract target features, train, evaluate")
    steps = eagle.add_subparsers(dest="eagle_command", required=True)

    def dtype_option(sub: argparse.ArgumentParser) -> None:
        from verispec.cli import add_target_dtype_option

        add_target_dtype_option(sub, "precision the target runs in: float32 (default) or bfloat16 (features are stored in bfloat16 either way; a bfloat16 target makes them several times faster on CPUs with AVX512-BF16/AMX: measured ~440 tokens/s for extract on a Xeon with AMX and ~110 on a Zen 4 EPYC (vs ~64 in float32) and ~100 for answers in batches of 64, and a head trained on them drafts for either precision: the fingerprint reads the weights rounded to bfloat16)")

    def sequence_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--max-seq-len", type=int, default=1024, help="tokens per training sequence at most (default 1024)")
        sub.add_argument("--corpus-seed", type=int, default=0, help="order of the standard-library modules and requests (default 0)")

    def extract_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--max-tokens", type=int, default=120_000, help="stdlib tokens to run through the target (default 120000: ~30 min for the built-in target on 2 cores, ~64 tokens/s)")

    def answer_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--answer-tokens", type=int, default=60_000, help="tokens of requests + the target's own answers to record (default 60000: ~40 min for the built-in target, ~25 tokens/s in batches of 32)")
        sub.add_argument("--answer-batch", type=int, default=32, help="requests answered together (default 32; more is faster per token, up to memory)")
        sub.add_argument("--answer-max-new-tokens", type=int, default=256, help="answer length limit (default 256)")
        sub.add_argument("--requests", choices=REQUEST_SOURCES, default="stdlib", help="whose documented functions the requests are written from: stdlib (default; ~2,400 requests, into <cache>/eagle/<target>/answers) or packages (~11,000 from numpy, scipy, sympy, networkx, torch, transformers and other permissively licensed packages verispec installs, into .../answers-packages)")

    def train_options(sub: argparse.ArgumentParser) -> None:
        from verispec.drafters.eagle.train import PRECISIONS, TrainSettings

        defaults = TrainSettings()
        sub.add_argument("--out", type=Path, default=None, metavar="PATH", help="head file (default <cache>/eagle/<target>/head.safetensors)")
        sub.add_argument("--epochs", type=float, default=defaults.epochs, help=f"passes over the features (default {defaults.epochs})")
        sub.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate (default {defaults.lr})")
        sub.add_argument("--tokens-per-step", type=int, default=defaults.tokens_per_step, help=f"positions per optimiser step (default {defaults.tokens_per_step})")
        sub.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size, help=f"the head's MLP width (default {defaults.intermediate_size})")
        sub.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab, help=f"draft vocabulary: the N most frequent corpus tokens, 0 = full (default {defaults.draft_vocab})")
        sub.add_argument("--ce-weight", type=float, default=defaults.ce_weight, help=f"weight of the cross-entropy against the target's next-token distribution beside the feature regression (default {defaults.ce_weight})")
        sub.add_argument("--noise", type=float, default=defaults.noise, help=f"input-feature noise, relative to their rms (default {defaults.noise})")
        sub.add_argument("--seed", type=int, default=defaults.seed, help="initialisation and data order (default 0)")
        sub.add_argument("--unroll-steps", type=int, default=defaults.unroll_steps, help=f"drafting steps trained on: S > 1 also trains steps 2..S on the head's own predicted features, as drafting feeds them (training-time test; each step costs about one more pass; default {defaults.unroll_steps})")
        sub.add_argument("--precision", choices=["auto", *PRECISIONS], default="auto", help="precision of the training's matrix products (weights and optimiser stay float32): auto (default) = bfloat16 where the CPU has AVX512-BF16/AMX, else float32")
        sub.add_argument("--init-from", type=Path, default=None, metavar="PATH", help="start from this trained head (same target and shape) instead of a fresh one, e.g. to fine-tune it with --unroll-steps")
        sub.add_argument("--keep-draft-vocab", action="store_true", help="with --init-from: keep that head's draft vocabulary instead of counting the most frequent tokens of this run's features (for fine-tuning on less or narrower data than the head saw)")

    def train_inputs(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--features", type=Path, action="append", default=None, metavar="DIR", help=f"feature shards directory, repeatable (default: <cache>/eagle/<target>/{{{','.join(FEATURE_DIRS)}}}, those that exist)")

    def eval_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--head", type=Path, default=None, metavar="PATH", help="head file (default <cache>/eagle/<target>/head.safetensors, else the head bundled for the target)")
        add_eval_prompt_options(sub, default_gamma=6, long_set=True)
        sub.add_argument("--teacher-forced", action="store_true", help="instead of decoding each prompt with drafts, record the target's greedy answers (kept in <cache>/eagle/<target>/recordings) and replay greedy decoding on them (exact greedy tau and acceptance by position; minutes faster, no timing). The head as trained on HumanEval/Spec-Bench: answers recorded in batches, all rounds from one unrolled pass; with --set long, far memory or int8: answers recorded one at a time through the engine's forward, rounds replayed through the drafter's own session")
        sub.add_argument("--draft-quantize", choices=["int8", "none"], default="none", help="int8: the head with int8 linears (default none)")
        from verispec.far_memory_cli import add_far_memory_options

        add_far_memory_options(sub, default_mode="full")  # a measurement: the head as trained unless asked

    steps_table = (
        ("extract", "run the frozen target over the standard-library corpus; save (tokens, features) shards; resumable", _extract, (dtype_option, sequence_options, extract_options)),
        ("answers", "record the target's own answers to coding requests (stdlib or package functions) with their features; resumable", _answers, (dtype_option, sequence_options, answer_options)),
        ("train", "train a head on extracted features (SmoothL1 + 0.1 CE, cosine LR); resumable from its checkpoint", _train, (train_inputs, train_options)),
        ("build", "extract + answers + train with the defaults: the head `--drafter eagle` uses (~2 h for the built-in target)", _build, (dtype_option, sequence_options, extract_options, answer_options, train_options)),
        ("eval", "tau and alpha of a head on held-back prompts (HumanEval, never in the training corpus); --teacher-forced replays greedy decoding on recorded answers, minutes faster", _eval, (dtype_option, eval_options)),
    )  # fmt: skip
    for name, help_text, handler, option_groups in steps_table:
        sub = steps.add_parser(name, help=help_text)
        for add_options in (add_model_options, *option_groups):
            add_options(sub)
        sub.set_defaults(handler=handler)
    export = steps.add_parser("export", help="copy a head file with bfloat16 weights (half the size; how the bundled head was made)")
    export.add_argument("head", type=Path, help="head file to copy (EAGLE or parallel)")
    export.add_argument("--out", type=Path, required=True, metavar="PATH", help="where to write the copy")
    export.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="storage precision of the weights (default bfloat16)")
    export.set_defaults(handler=_export)


def add_model_options(sub: argparse.ArgumentParser) -> None:
    """--target, --cache-dir, --threads: the options of every head pipeline step (`eagle ...`, `parallel ...`)."""
    from verispec.models import DEFAULT_TARGET

    sub.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    sub.add_argument("--cache-dir", type=Path, default=None, help="model cache (default $VERISPEC_CACHE or ~/.cache/verispec)")
    sub.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")


def add_eval_prompt_options(sub: argparse.ArgumentParser, default_gamma: int, long_set: bool = False) -> None:
    """The prompts and lengths of a head's evaluation (`eagle eval`, `parallel eval`); ``long_set``:
    also the long-input set (`eagle eval`, whose session replay runs far memory on it)."""
    from verispec.bench.prompts import DEFAULT_SPEC_BENCH

    sets = ["humaneval", "spec-bench", *(["long"] if long_set else [])]
    long_help = "; long: standard-library modules cut to --lengths tokens with a request at the end (bench --set long), one category per length" if long_set else ""
    sub.add_argument("--set", choices=sets, default="humaneval", help=f"prompts: HumanEval problems (default) or Spec-Bench questions, with a line per category{long_help}")
    if long_set:
        from verispec.bench.long_context import LONG_SPLITS

        sub.add_argument("--lengths", default="16384", metavar="N,M", help="--set long: prompt lengths in tokens, chat template included (default 16384)")
        sub.add_argument("--split", choices=LONG_SPLITS, default="dev", help="--set long: dev (default: for choosing --local-window etc.) or eval modules, disjoint")
    sub.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH, metavar="PATH", help=f"Spec-Bench questions (default {DEFAULT_SPEC_BENCH}, relative to the current directory)")
    per_length = ", or modules per length (--set long)" if long_set else ""
    sub.add_argument("--num-prompts", type=int, default=8, help=f"HumanEval prompts, or prompts per Spec-Bench category{per_length} (default 8)")
    sub.add_argument("--first-prompt", type=int, default=0, help="index of the first HumanEval problem (default 0, as the bench; e.g. 100 for a dev range the bench never runs)")
    sub.add_argument("--gamma", type=int, default=default_gamma, help=f"drafts per round (default {default_gamma})")
    sub.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    sub.add_argument("--rerecord", action="store_true", help="replays: record the target's answers again instead of reading those an earlier evaluation kept in <cache>/eagle/<target>/recordings")


def check_eval_prompt_options(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.gamma < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts, --gamma and --max-new-tokens must be >= 1")
    if args.first_prompt < 0:
        raise ValueError(f"--first-prompt must be >= 0, got {args.first_prompt}")


def _paths(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(stdlib features dir, answers features dir of --requests, head file)."""
    from verispec.drafters.eagle import default_head_path

    default = default_head_path(args.target, args.cache_dir)
    head = getattr(args, "out", None) or default
    answers = FEATURE_DIRS[1] if getattr(args, "requests", "stdlib") == "stdlib" else FEATURE_DIRS[2]
    return default.parent / FEATURE_DIRS[0], default.parent / answers, Path(head)


def default_feature_dirs(head_dir: Path) -> list[Path]:
    """The feature directories under ``head_dir`` (<cache>/eagle/<target>) that hold shards."""
    return [head_dir / name for name in FEATURE_DIRS if (head_dir / name / "manifest.json").exists()]


def load_target(args: argparse.Namespace):  # noqa: ANN201 - the loaded target (--target, --threads, --target-dtype)
    import torch

    from verispec.cli import target_dtype
    from verispec.models import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return load_model(args.target, cache_dir=args.cache_dir, dtype=target_dtype(args))


def _extract_settings(args: argparse.Namespace):  # noqa: ANN202
    from verispec.drafters.eagle.extract import ExtractSettings

    return ExtractSettings(max_tokens=args.max_tokens, max_seq_len=args.max_seq_len)


def _answer_settings(args: argparse.Namespace):  # noqa: ANN202
    from verispec.drafters.eagle.extract import ExtractSettings

    if args.answer_tokens < 2:
        raise ValueError(f"--answer-tokens must be >= 2, got {args.answer_tokens}")
    for name in ("answer_batch", "answer_max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return ExtractSettings(max_tokens=args.answer_tokens, max_seq_len=args.max_seq_len, shard_tokens=2048)


def _train_settings(args: argparse.Namespace):  # noqa: ANN202
    from verispec.drafters.eagle.train import TrainSettings, default_precision

    if args.init_from is not None and not args.init_from.is_file():
        raise FileNotFoundError(f"--init-from: EAGLE head {str(args.init_from)!r} does not exist")
    if args.keep_draft_vocab and args.init_from is None:
        raise ValueError("--keep-draft-vocab needs --init-from: it keeps that head's draft vocabulary")
    return TrainSettings(
        epochs=args.epochs, lr=args.lr, tokens_per_step=args.tokens_per_step, intermediate_size=args.intermediate_size,
        draft_vocab=args.draft_vocab, noise=args.noise, ce_weight=args.ce_weight, seed=args.seed, unroll_steps=args.unroll_steps,
        init_from=str(args.init_from) if args.init_from is not None else "", keep_draft_vocab=args.keep_draft_vocab,
        precision=default_precision() if args.precision == "auto" else args.precision,
    )  # fmt: skip


def _run_extract(args: argparse.Namespace, target) -> None:  # noqa: ANN001
    from verispec.drafters.eagle.corpus import stdlib_documents
    from verispec.drafters.eagle.extract import extract_features

    features_dir, _, _ = _paths(args)
    started = time.perf_counter()
    manifest = extract_features(
        target, stdlib_documents(seed=args.corpus_seed), features_dir, _extract_settings(args),
        corpus_name=f"python-stdlib (seed {args.corpus_seed})",
    )  # fmt: skip
    tokens = sum(shard["tokens"] for shard in manifest["shards"])
    print(f"{tokens} tokens in {len(manifest['shards'])} shards -> {features_dir} ({time.perf_counter() - started:.0f}s)", file=sys.stderr)


def _run_answers(args: argparse.Namespace, target) -> None:  # noqa: ANN001
    from verispec.drafters.eagle.corpus import coding_requests, installed_packages, length_sorted, package_versions
    from verispec.drafters.eagle.extract import record_answers

    _, answers_dir, _ = _paths(args)
    started = time.perf_counter()
    if args.requests == "stdlib":
        requests, corpus_name = coding_requests(seed=args.corpus_seed), f"stdlib coding requests, instructions and stubs (seed {args.corpus_seed})"
    else:
        packages = installed_packages()
        # Batches of similar lengths (the stdlib requests keep the order the bundled head's recipe recorded them in).
        window = 4 * args.answer_batch
        requests = length_sorted(coding_requests(seed=args.corpus_seed, source="packages", packages=packages, progress=True), window)
        corpus_name = f"package coding requests, instructions and stubs (seed {args.corpus_seed}; sorted by length in runs of {window}; {package_versions(packages)})"
    manifest = record_answers(
        target, requests, answers_dir, _answer_settings(args),
        batch_size=args.answer_batch, max_new_tokens=args.answer_max_new_tokens, corpus_name=corpus_name,
    )  # fmt: skip
    tokens = sum(shard["tokens"] for shard in manifest["shards"])
    print(f"{tokens} tokens of answers in {len(manifest['shards'])} shards -> {answers_dir} ({time.perf_counter() - started:.0f}s)", file=sys.stderr)


def _run_train(args: argparse.Namespace, target) -> None:  # noqa: ANN001
    from verispec.drafters.eagle.train import train_head

    features_dir, _, head_path = _paths(args)
    # (build has no --features: it trains on the default directories, which it has just filled)
    dirs = getattr(args, "features", None) or default_feature_dirs(features_dir.parent)
    if not dirs:
        raise FileNotFoundError(f"no features under {features_dir.parent}: run `verispec eagle extract` / `verispec eagle answers` first")
    result = train_head(target, dirs, head_path, _train_settings(args))
    print(json.dumps(result, indent=1))
    print(f"head -> {head_path}", file=sys.stderr)


def _extract(args: argparse.Namespace) -> int:
    _extract_settings(args)  # validate before minutes of loading
    _run_extract(args, load_target(args))
    return 0


def _answers(args: argparse.Namespace) -> int:
    _answer_settings(args)  # validate before minutes of loading
    _run_answers(args, load_target(args))
    return 0


def _train(args: argparse.Namespace) -> int:
    _train_settings(args)
    _run_train(args, load_target(args))
    return 0


def _build(args: argparse.Namespace) -> int:
    _answer_settings(args)
    _extract_settings(args)
    _train_settings(args)
    target = load_target(args)
    _run_extract(args, target)
    _run_answers(args, target)
    _run_train(args, target)
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from verispec.drafters.eagle.checkpoint import export_head

    if args.out.resolve() == args.head.resolve():
        raise ValueError("--out must differ from the head it copies")
    out = export_head(args.head, args.out, getattr(torch, args.dtype))
    print(f"{args.head} ({args.head.stat().st_size / 1e6:.1f} MB) -> {out} ({out.stat().st_size / 1e6:.1f} MB, {args.dtype})", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from verispec.drafters.eagle import existing_head_path
    from verispec.far_memory_cli import far_memory_from_args

    check_eval_prompt_options(args)
    far_memory = far_memory_from_args(args)  # before minutes of loading
    session_replay = args.teacher_forced and (args.set == "long" or args.draft_quantize != "none" or far_memory is not None)
    if args.set == "long":
        from verispec.bench.long_context import long_context_prompts, parse_lengths

        lengths = parse_lengths(args.lengths)  # ValueError naming --lengths
        if args.first_prompt:
            raise ValueError("--first-prompt applies to --set humaneval; --set long takes the first --num-prompts modules of --split")
    prompts = eval_prompts(args) if args.set != "long" else None
    head_path = existing_head_path(args.head, args.target, args.cache_dir)
    target = load_target(args)
    if prompts is None:  # cut to token lengths: needs the target's tokenizer
        prompts = long_context_prompts(target.tokenizer, lengths, args.split, per_length=args.num_prompts)
    texts = [prompt.text for prompt in prompts]
    drafting_s = None
    if session_replay:
        rounds, drafting_s = _session_replayed_rounds(args, target, head_path, texts, far_memory)
    elif args.teacher_forced:
        rounds = _replayed_rounds(args, target, head_path, texts)
    else:
        rounds = _decoded_rounds(args, target, head_path, texts, far_memory)
    how = "replayed greedy decoding" + (" through the drafter's session" if session_replay else "") if args.teacher_forced else "decoded"
    attention = f", {far_memory.mode} attention (W {far_memory.local_window}, T {far_memory.memory_temperature:g}, λ {far_memory.memory_weight:g})" if far_memory is not None else ""
    quantized = ", int8 head" if args.draft_quantize != "none" else ""
    print(f"{head_path.name}{quantized}{attention}, gamma {args.gamma}, {args.max_new_tokens} new tokens, {how}:")
    print_rounds_by_category(prompts, rounds)
    if drafting_s is not None:  # the replay ran the head's real calls: their time is the drafting cost
        num_rounds = sum(len(prompt_rounds) for prompt_rounds in rounds)
        print(f"  drafting: {drafting_s:.1f} s over {num_rounds} rounds, {1000 * drafting_s / max(1, num_rounds):.1f} ms a round (the head's catch-up over each prompt included)")
    return 0


def print_rounds_by_category(prompts: list, rounds: list[list[tuple[int, int]]]) -> None:
    """tau, alpha and acceptance by draft position per category (and over all, when there are several).

    rounds: (drafted, accepted) of each round, per prompt.
    """
    from verispec.engine.stats import acceptance_by_position

    categories = list(dict.fromkeys(prompt.category for prompt in prompts))  # in the order of the prompts
    for category in [*categories, "all"] if len(categories) > 1 else categories:
        pooled = [pair for prompt, pairs in zip(prompts, rounds) if category in ("all", prompt.category) for pair in pairs]
        drafted, accepted = [d for d, _ in pooled], [a for _, a in pooled]
        tau = (sum(accepted) + len(accepted)) / max(1, len(accepted))  # tokens per target call, the bonus included
        alpha = sum(accepted) / max(1, sum(drafted))
        count = sum(1 for prompt in prompts if category in ("all", prompt.category))
        by_position = ", ".join(f"{rate:.2f}" for rate in acceptance_by_position(drafted, accepted))
        per_round = sum(drafted) / max(1, len(drafted))  # rows a target pass verifies beyond the one it always runs
        print(f"  {category:<14} {count:>3} prompts  tau {tau:.2f}  alpha {alpha:.3f}  drafts/round {per_round:.2f}  acceptance by draft position: {by_position}")


def eval_prompts(args: argparse.Namespace) -> list:
    """HumanEval problems first_prompt.. (num_prompts of them), or the first num_prompts of each Spec-Bench category."""
    from verispec.bench.prompts import first_per_category, humaneval_prompts, spec_bench_prompts

    if args.set == "spec-bench":
        if args.first_prompt:
            raise ValueError("--first-prompt applies to --set humaneval; Spec-Bench takes the first --num-prompts of each category")
        return first_per_category(spec_bench_prompts(args.spec_bench), args.num_prompts)
    prompts = humaneval_prompts(args.first_prompt + args.num_prompts)[args.first_prompt :]
    if not prompts:
        raise ValueError(f"--first-prompt {args.first_prompt} is past HumanEval's last problem")
    return prompts


def _decoded_rounds(args: argparse.Namespace, target, head_path: Path, texts: list[str], far_memory) -> list[list[tuple[int, int]]]:  # noqa: ANN001
    """(drafted, accepted) of each round of real speculative decoding, per text."""
    from tqdm import tqdm

    from verispec.drafters.eagle import EagleDrafter
    from verispec.engine import SpeculativeDecoder
    from verispec.models import encode_prompt

    drafter = EagleDrafter(target, head_path, quantize=args.draft_quantize == "int8", far_memory=far_memory)
    decoder = SpeculativeDecoder(target, drafter, gamma=args.gamma)
    rounds = []
    for text in tqdm(texts, desc="eval", unit="prompt", file=sys.stderr):
        stats = decoder.generate(encode_prompt(target.tokenizer, text), args.max_new_tokens).stats
        rounds.append(list(zip(stats.drafted_per_round, stats.accepted_per_round)))
    return rounds


def _replayed_rounds(args: argparse.Namespace, target, head_path: Path, texts: list[str]) -> list[list[tuple[int, int]]]:  # noqa: ANN001
    """(drafted, accepted) of each round greedy decoding would run, replayed on the target's recorded answers, per text."""
    from verispec.drafters.eagle import load_head
    from verispec.drafters.eagle.acceptance import accepted_from_every_start, replay_rounds

    head, vocab_ids = load_head(head_path, target.model)
    lm_weight = target.model.get_output_embeddings().weight.detach().float()  # once, not per answer (a bfloat16 target)
    lm_rows = lm_weight[vocab_ids] if vocab_ids is not None else lm_weight
    embed = target.model.get_input_embeddings()
    rounds = []
    for prompt, tokens, features in answers_for_replay(args, target, texts):
        from_every_start = accepted_from_every_start(head, embed, lm_rows, vocab_ids, tokens, features, args.gamma, full_lm_head=lm_weight)
        rounds.append(replay_rounds(from_every_start, len(prompt) - 2, len(tokens) + 1, args.gamma))
    return rounds


def _session_replayed_rounds(args: argparse.Namespace, target, head_path: Path, texts: list[str], far_memory) -> tuple[list[list[tuple[int, int]]], float]:  # noqa: ANN001
    """((drafted, accepted) of each greedy round per text, seconds spent in the drafting sessions):
    rounds replayed through the drafter's own session on the target's answers recorded through the
    engine's forward (the target on the panel kernels where they run, as `bench` runs it: the
    features the drafter sees in decoding)."""
    import time

    from verispec.bench.recordings import default_recordings_dir, recorded_engine_answers
    from verispec.cli import _prepare_models
    from verispec.drafters.eagle import EagleDrafter
    from verispec.drafters.eagle.acceptance import replay_session_rounds
    from verispec.models import encode_prompt
    from verispec.sampling import SamplingParams

    kernels = argparse.Namespace(target_kernels="panel", greedy_lm_head="screened", draft_quantize="none")
    _prepare_models(kernels, target, None)
    drafter = EagleDrafter(target, head_path, quantize=args.draft_quantize == "int8", far_memory=far_memory)
    prompts = [encode_prompt(target.tokenizer, text) for text in texts]
    directory = default_recordings_dir(args.target, args.cache_dir)
    rounds, drafting_s = [], 0.0
    for prompt, (sequence, features) in zip(prompts, recorded_engine_answers(target, prompts, args.max_new_tokens, directory, reuse=not args.rerecord)):
        started = time.perf_counter()
        rounds.append(replay_session_rounds(drafter.start(prompt, SamplingParams()), sequence, features, len(prompt), args.gamma))
        drafting_s += time.perf_counter() - started
    return rounds, drafting_s


def answers_for_replay(args: argparse.Namespace, target, texts: list[str]):  # noqa: ANN001, ANN201 - a LoadedModel -> Iterator
    """The target's recorded greedy answers to ``texts`` with their features (bench/recordings.py), read from
    <cache>/eagle/<target>/recordings where an earlier evaluation left them, unless --rerecord."""
    from verispec.bench.recordings import default_recordings_dir, recorded_answers

    directory = default_recordings_dir(args.target, args.cache_dir)
    return recorded_answers(target, texts, args.max_new_tokens, directory, reuse=not args.rerecord)
