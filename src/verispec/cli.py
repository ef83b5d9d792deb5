"""The `verispec` command line: generate, compare, fetch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a doctest."


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as error:  # user-facing failures: a message, not a traceback
        print(f"verispec {args.command}: error: {error}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding: the target's output, sooner.")
    commands = parser.add_subparsers(dest="command", required=True)

    def model_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: built-in name, HF directory, .gguf file or hub id (default {DEFAULT_TARGET})")
        sub.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model, or 'none' for plain decoding (default {DEFAULT_DRAFT})")
        sub.add_argument("--gamma", type=int, default=4, help="draft tokens per target call (default 4)")
        sub.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most (default 128)")
        sub.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        sub.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
        sub.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off")
        sub.add_argument("--seed", type=int, default=None, help="sampling seed")
        sub.add_argument("--raw", action="store_true", help="do not apply the chat template")
        sub.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
        sub.add_argument("--cache-dir", type=Path, default=None, help="model cache (default $VERISPEC_CACHE or ~/.cache/verispec)")

    generate = commands.add_parser("generate", help="generate text with speculative decoding, streamed as tokens are accepted")
    model_options(generate)
    generate.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    generate.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    generate.set_defaults(handler=_generate)

    compare = commands.add_parser("compare", help="the same prompts with and without speculation: times and speed-up")
    model_options(compare)
    compare.add_argument("--humaneval", type=int, metavar="N", default=None, help="use the first N HumanEval prompts instead of PROMPT")
    compare.add_argument("--json", type=Path, default=None, help="also write per-prompt results and the summary as JSON")
    compare.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    compare.set_defaults(handler=_compare)

    fetch = commands.add_parser("fetch", help="download, verify and convert built-in models ahead of time")
    fetch.add_argument("names", nargs="*", default=[DEFAULT_TARGET, DEFAULT_DRAFT])
    fetch.add_argument("--cache-dir", type=Path, default=None)
    fetch.set_defaults(handler=_fetch)
    return parser


def _sampling(args: argparse.Namespace):
    from verispec.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _load(args: argparse.Namespace):
    """Load target (and draft) and build plain and speculative decoders."""
    import torch

    from verispec.drafters import DraftModel
    from verispec.engine import SpeculativeDecoder
    from verispec.models import load_model

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    sampling = _sampling(args)  # validate before minutes of loading
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.gamma < 1:
        raise ValueError(f"--gamma must be >= 1, got {args.gamma}")
    started = time.perf_counter()
    target = load_model(args.target, cache_dir=args.cache_dir)
    drafter = None
    if args.draft.lower() != "none":
        drafter = DraftModel(load_model(args.draft, cache_dir=args.cache_dir), name=args.draft)
    print(f"loaded in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    plain = SpeculativeDecoder(target)
    speculative = SpeculativeDecoder(target, drafter, gamma=args.gamma) if drafter is not None else plain
    return target, plain, speculative, sampling


def _encode(target, text: str, raw: bool) -> list[int]:
    from verispec.models import encode_prompt

    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; text prompts need one")
    return encode_prompt(target.tokenizer, text, chat=not raw)


def _generate(args: argparse.Namespace) -> int:
    target, _, decoder, sampling = _load(args)
    input_ids = _encode(target, args.prompt, args.raw)
    stop = None if not args.stop else decoder.default_stop() + list(args.stop)
    tokens: list[int] = []
    printed = ""
    step = None
    for step in decoder.stream(input_ids, args.max_new_tokens, sampling, stop):
        tokens.extend(step.token_ids)
        # Decode everything so far and print the new suffix: tokens can split multi-byte characters.
        text = target.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    print()
    print(step.stats.summary(), file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from verispec.bench.compare import compare_one, rows_to_dicts, summarize
    from verispec.bench.prompts import Prompt, humaneval_prompts

    if args.draft.lower() == "none":
        raise ValueError("compare needs a draft model (--draft NAME)")
    prompts = humaneval_prompts(args.humaneval) if args.humaneval is not None else [Prompt("prompt", "user", args.prompt)]
    target, plain, speculative, sampling = _load(args)
    rows, spec_stats = [], []
    bar = tqdm(prompts, desc="plain + speculative", unit="prompt", file=sys.stderr)
    for prompt in bar:
        input_ids = _encode(target, prompt.text, args.raw)
        row, plain_result, spec_result = compare_one(plain, speculative, prompt.id, input_ids, args.max_new_tokens, sampling)
        rows.append(row)
        spec_stats.append(spec_result.stats)
        bar.write(
            f"{row.prompt_id}: plain {row.plain_tokens} tok in {row.plain_s:.1f}s, speculative {row.speculative_tokens} tok "
            f"in {row.speculative_s:.1f}s -> {row.speedup:.2f}x, alpha {row.acceptance_rate:.2f}, tau {row.tokens_per_call:.2f}, "
            f"{'identical' if row.identical else 'DIFFERENT'}"
        )
        if len(prompts) == 1:
            bar.write(spec_result.text or "")
    summary = summarize(rows, spec_stats)
    print(f"{args.target} + {args.draft}, gamma {args.gamma}, {args.max_new_tokens} new tokens: {summary.line()}")
    if args.json is not None:
        payload = {"settings": {k: str(v) for k, v in vars(args).items() if k != "handler"}, "summary": summary.__dict__, "prompts": rows_to_dicts(rows)}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from verispec.models import BUILTIN_MODELS, default_cache_dir, prepare_builtin

    cache_dir = args.cache_dir or default_cache_dir()
    for name in args.names:
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
        path = prepare_builtin(BUILTIN_MODELS[name], Path(cache_dir))
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
