"""The `verispec` command line: generate, compare, bench, fetch, serve, loadtest."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from verispec.argtypes import tree_rows_value

DEFAULT_TREE_ROWS = 0  # = verispec.engine.decoder.DEFAULT_TREE_ROWS (not imported: --help loads no torch; a test checks)
# --tree-rows auto (generate, compare): draft trees of this many rows for an EAGLE head where
# `--target-kernels auto` picked the panel kernels and timed an 8-row pass at most this many times a
# 1-row one (verification rows nearly free). Chosen on HumanEval problems 100-107 (README,
# Performance, 2026-12-05 (noon)); the draft model's trees measured no faster, so it drafts chains.
AUTO_TREE_ROWS = 8
AUTO_TREE_MAX_ROW_COST = 1.15
# ... and only while the sequence is shorter than this (a spare row's attention grows with the context).
DEFAULT_PREFILL_BUDGET = 2048  # = serving.scheduler.SchedulerConfig.prefill_budget (not imported: --help loads no torch; a test checks)
AUTO_TREE_MAX_CONTEXT = 10240  # = verispec.engine.decoder.LONG_CONTEXT_TREE_LIMIT (not imported: --help loads no torch; a test checks)
# --drafter auto: lookup + EAGLE head from this many prompt tokens, lookup + draft model below.
DEFAULT_LONG_PROMPT = 512  # = verispec.drafters.by_length.DEFAULT_LONG_PROMPT (not imported either; a test checks)
DEFAULT_DRAFT_WINDOW = 1024  # --draft-window (tokens of the prompt the draft model sees; README, Performance)
DEFAULT_PREFIX_CACHE_MB = 1024  # = verispec.engine.prefix_cache.DEFAULT_PREFIX_CACHE_MB (not imported either; a test checks)
SHARED_PREFILL_MB = 4096  # bench --share-prefill without --prefix-cache-mb: an 8K prompt's keys, values and features take ~0.5 GB
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a doctest."


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded by `bench` in its report
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as error:  # user-facing failures: a message, not a traceback
        print(f"verispec {args.command}: error: {error}", file=sys.stderr)
        return 2


def _add_sampling_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sub.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    sub.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off")
    sub.add_argument("--seed", type=int, default=None, help="sampling seed (each generation starts from it)")


TARGET_DTYPES = ("float32", "bfloat16")


SERVED_DTYPE_HELP = "the precision the target is loaded and served in: float32 (default) or bfloat16 (half the bytes per step; its products run our bfloat16 few-row kernels on CPUs with AVX512-BF16 or with AVX2 and no AVX-512, elsewhere PyTorch's). The output is exactly this target's either way, and speed-ups compare against plain decoding of the same target"


def add_target_dtype_option(sub: argparse.ArgumentParser, help_text: str = SERVED_DTYPE_HELP) -> None:
    """``--target-dtype`` (read with :func:`target_dtype`); ``help_text`` says what the precision means to the command."""
    sub.add_argument("--target-dtype", choices=list(TARGET_DTYPES), default="float32", help=help_text)


def target_dtype(args: argparse.Namespace):  # noqa: ANN201 - torch.dtype (torch imported lazily)
    """The torch dtype --target-dtype names (float32 for commands without the option)."""
    import torch

    return getattr(torch, getattr(args, "target_dtype", "float32"))  # one of TARGET_DTYPES, checked by argparse


def _add_kernel_options(sub: argparse.ArgumentParser, path_confidence: float | None = None, tree_auto: bool = False) -> None:
    """How the models run (never what they output: the verifier keeps the target's distribution)."""
    add_target_dtype_option(sub)
    sub.add_argument("--target-kernels", choices=["auto", "panel", "packed", "dense"], default="auto", help="auto (default): time panel against packed on the target's own weights when it is prepared (about two seconds) and keep the faster here, which differs by CPU (see Performance); panel: our AVX2 kernels for products over up to 128 tokens (every decoding step and verification pass; built with the system C++ compiler on first use, about a second); packed: oneDNN-packed weights; both use a second copy of the target's weights and attention reading the cache's shared key/value heads in place; panel falls back to packed where it cannot run (no AVX2 or no compiler). dense: PyTorch's and transformers' defaults only")
    sub.add_argument("--greedy-lm-head", choices=["screened", "full"], default="screened", help="screened (default): greedy passes of a target on the float32 panel kernels take the LM head's argmax through an int8 copy of it with an error bound per logit, computing in float32 only the logits that can be the argmax: the same tokens, about a quarter of the head's bytes (~20 ms less per step of the 1.5B target here; the int8 copy takes ~4 s to build and ~230 MB). full: every logit in float32. Sampling always computes the full head")
    auto_trees = (
        f"; auto (default): {AUTO_TREE_ROWS} for an EAGLE head (eagle, ngram+eagle) where --target-kernels auto picks the panel kernels and times an "
        f"{AUTO_TREE_ROWS}-row pass at most {AUTO_TREE_MAX_ROW_COST}x a 1-row one (rows nearly free), else 0"
    ) if tree_auto else f" (default {DEFAULT_TREE_ROWS})"
    sub.add_argument("--tree-rows", type=tree_rows_value if tree_auto else int, default="auto" if tree_auto else DEFAULT_TREE_ROWS, metavar="N", help=f"decoding with a draft model, an EAGLE head or the parallel drafter, greedy or sampled: verification passes of up to N rows, the spare ones filled with the drafter's runner-up tokens (a one-level draft tree: when the target rejects a draft but takes a runner-up, that token and the next are emitted too; exact: each row is computed as the chain would, and when sampling the token replacing a rejected draft is drawn from the residual through the runner-ups). Needs a target on the panel kernels' fused stack; 0 = chains only{auto_trees}")
    sub.add_argument("--draft-confidence", type=float, default=None, metavar="P", help="stop drafting a round once the draft model gives its token less than probability P (e.g. 0.4); default: always draft gamma")
    default = f"default {path_confidence}" if path_confidence is not None else "default: off"
    sub.add_argument("--draft-path-confidence", type=float, default=path_confidence, metavar="P", help=f"stop drafting a round once the product of the draft model's probabilities of this round's tokens is below P (its own estimate that the whole draft is accepted); 0 = off; {default}")
    sub.add_argument("--draft-vocab", type=int, default=0, metavar="N", help="draft model: draft over the first N token ids plus the special ones only (byte-level BPE numbers tokens by merge order, roughly by frequency), so a draft step multiplies by N LM-head rows instead of all; 0 = the full vocabulary (default). Exact either way")
    sub.add_argument("--draft-greedy-head", choices=["screened", "full"], default="screened", help="screened (default): greedy draft steps of the int8 draft model read its LM head through a 4-bit copy (half the head's bytes, ~3 ms of a ~30 ms draft step here), the panels of the 64 largest logits recomputed in int8: the int8 head's choice at every position measured (the copy takes ~1.6 s to build and 68 MB for the 0.5B draft); full: the int8 head. The output is the target's either way; sampling drafts always use the full head")
    sub.add_argument("--draft-window", type=int, default=DEFAULT_DRAFT_WINDOW, metavar="N", help=f"the draft model sees only the last N tokens of the prompt (and all it drafts and the target accepts after it): its prompt pass stays short on long inputs, where prompt lookup still copies from the whole text; 0 = the whole prompt (default {DEFAULT_DRAFT_WINDOW}). Exact either way")
    sub.add_argument("--draft-quantize", choices=["int8", "none"], default="int8", help="int8 (default): dynamic int8 linears for the draft model (or the EAGLE or parallel head), ~2x cheaper draft steps; the output stays exact whatever the draft computes")
    sub.add_argument("--draft-kernels", choices=["panel", "torch"], default="panel", help="panel (default): the lean draft forward through our AVX2 few-row kernels, a whole draft step in one call into them, and the draft's output layer too (same int8 weights; activations in float32, or in 8 bits where the CPU has VNNI dot products; falls back where they cannot run); torch: PyTorch's (fbgemm int8) kernels op by op. The output is the target's either way")
    sub.add_argument("--draft-forward", choices=["lean", "transformers"], default="lean", help="lean (default): the draft model runs through our own forward over its modules (stacked q/k/v and gate/up products, in-place KV cache; Llama/Qwen2/Mistral, else falls back); transformers: the model's own forward. The output is the target's either way")


def draft_model_settings(args: argparse.Namespace):  # noqa: ANN201 - DraftModelSettings (imported lazily)
    """The draft model's settings from the ``--draft-*`` options (0 turns the confidence stops and the vocabulary off)."""
    from verispec.drafters.draft_model import DraftModelSettings, tree_alternatives

    return DraftModelSettings(
        confidence_threshold=args.draft_confidence, path_confidence=args.draft_path_confidence or None, draft_vocab=args.draft_vocab or None,
        lean=None if getattr(args, "draft_forward", "lean") == "lean" else False, panel_kernels=draft_panel_kernels(args),
        alternatives=tree_alternatives(0 if getattr(args, "trees_by_auto", False) else _chain_if_auto(getattr(args, "tree_rows", 0))), greedy_head=getattr(args, "draft_greedy_head", "screened"),
        prefix_cache_mb=getattr(args, "prefix_cache_mb", 0), context_window=getattr(args, "draft_window", 0) or None,
    )


def _chain_if_auto(tree_rows: int | str) -> int:
    """--tree-rows for a draft model: auto never gives it trees (they measured no faster)."""
    return 0 if tree_rows == "auto" else tree_rows


def draft_panel_kernels(args: argparse.Namespace) -> bool:
    """DraftModel's ``panel_kernels`` for --draft-kernels."""
    return getattr(args, "draft_kernels", "panel") == "panel"


def _check_decoding_options(args: argparse.Namespace, max_new_tokens: int):  # noqa: ANN202 - SamplingParams
    """Validate the options generate/compare/bench share, before minutes of model loading."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    _check_model_options(args)
    return _sampling(args)


def _check_model_options(args: argparse.Namespace) -> None:
    """Validate how the models run (every command that loads them, serve included)."""
    if args.gamma < 1:
        raise ValueError(f"--gamma must be >= 1, got {args.gamma}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if getattr(args, "long_prompt", 1) < 1:
        raise ValueError(f"--long-prompt must be >= 1 (prompt tokens), got {args.long_prompt}")
    tree_rows = getattr(args, "tree_rows", 0)  # "auto" (generate, compare) is checked by its parser
    if tree_rows != "auto" and tree_rows < 0:
        raise ValueError(f"--tree-rows must be >= 0 (0 = chains only), got {tree_rows}")
    from verispec.drafters.draft_model import checked_threshold

    checked_threshold(args.draft_confidence, "--draft-confidence")
    checked_threshold(args.draft_path_confidence, "--draft-path-confidence")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = the full vocabulary), got {args.draft_vocab}")
    if getattr(args, "draft_window", 0) < 0:
        raise ValueError(f"--draft-window must be >= 0 (0 = the whole prompt), got {args.draft_window}")
    if getattr(args, "prefix_cache_mb", 0) < 0:
        raise ValueError(f"--prefix-cache-mb must be >= 0 (0 = off), got {args.prefix_cache_mb}")
    if hasattr(args, "local_window"):
        from verispec.far_memory_cli import far_memory_from_args

        far_memory_from_args(args, None if hasattr(args, "draft_attention") else "fold")  # raises naming the bad option
        if getattr(args, "draft_attention", "full") not in ("full", "auto") and args.drafter not in (*EAGLE_DRAFTERS, "parallel"):
            raise ValueError(f"--draft-attention {args.draft_attention} changes a drafting head's attention: it needs --drafter eagle, ngram+eagle or parallel")


def _prepare_models(args: argparse.Namespace, target, draft) -> str:  # noqa: ANN001 - LoadedModels
    """Apply the kernel and quantisation options in place; return which target kernels run (and why)."""
    import torch

    from verispec.models import quantize_int8
    from verispec.models.gqa_attention import use_gqa_attention
    from verispec.models.kernel_choice import fastest_target_kernels
    from verispec.models.packed_linear import onednn_packing_available, pack_linears
    from verispec.models.panel_linear import panel_kernels_unavailable_reason, use_panel_kernels
    from verispec.models.screened_head import ScreenedArgmaxHead

    kernels = args.target_kernels
    used = kernels
    # --tree-rows auto: chains unless the timing below shows verification rows nearly free for an EAGLE head.
    auto_trees = getattr(args, "tree_rows", 0) == "auto"
    if auto_trees:
        args.tree_rows = 0
    args.trees_by_auto = auto_trees  # then a draft model keeps chains (--drafter auto's too) and trees end at AUTO_TREE_MAX_CONTEXT
    chunk_long_passes = False  # prefill products through the panel kernels in chunks: only where auto timed it faster
    screened_head = getattr(args, "greedy_lm_head", "screened") == "screened"
    if kernels != "dense":
        use_gqa_attention(target.model)
    if kernels != "dense" and target.model.dtype == torch.bfloat16:
        from verispec.models.panel_linear import bf16_kernels_available, bf16_uses_amx, bf16_widened

        if bf16_kernels_available():  # half the bytes (and with AVX512-BF16 twice float32's multiply-adds per instruction): no contest to time
            use_panel_kernels(target.model)
            how = "AMX tiles" if bf16_uses_amx() else "weights widened to float32" if bf16_widened() else "dot products"
            used = f"panel (bfloat16 {how})" + (" instead of packed (oneDNN packing here is float32 only)" if kernels == "packed" else "")
        else:
            used = "dense (this CPU or build lacks the bfloat16 few-row kernels: AVX512-BF16, or AVX2 without AVX-512)"
        print(f"verispec: target kernels: {used}", file=sys.stderr)
    elif kernels != "dense" and target.model.dtype != torch.float32:
        used = f"dense (the target is {target.model.dtype}; the few-row kernels are float32 or bfloat16)"
    elif kernels != "dense":
        reason = panel_kernels_unavailable_reason()
        if kernels == "auto" and reason is None and getattr(args, "tree_rows", 0):
            # Draft trees run only on the panel kernels' fused stack: timing packed against it would
            # pick a stack on which --tree-rows does nothing.
            kernels, used = "panel", "panel (--tree-rows: draft trees need the panel kernels' fused stack)"
            print(f"verispec: target kernels: {used}", file=sys.stderr)
        elif kernels == "auto" and (reason is None or onednn_packing_available()):
            # A greedy run reads the head through the int8 screen on panel kernels: time it so.
            # (serve has no --temperature: its requests choose, so the full head is timed.)
            choice = fastest_target_kernels(target.model, screened_head=screened_head and getattr(args, "temperature", None) == 0)
            print(f"verispec: target kernels: {choice.summary()}", file=sys.stderr)
            kernels, used = choice.name, f"auto: {choice.summary()}"
            chunk_long_passes = choice.long_passes == "panel"
            if auto_trees:
                args.tree_rows = _auto_tree_rows(args, choice)
        elif kernels == "panel" and reason is not None:
            print(f"note: --target-kernels panel cannot run here ({reason}); using packed", file=sys.stderr)
            kernels, used = "packed", f"packed (panel cannot run here: {reason})"
        if kernels == "panel":
            use_panel_kernels(target.model, chunk_long_passes)
            if screened_head:  # build its int8 copy now, not in the first request
                ScreenedArgmaxHead.for_head(target.model.get_output_embeddings())
        elif kernels == "packed" and onednn_packing_available():
            pack_linears(target.model)
        elif kernels != "dense":
            used = "dense (neither the panel kernels nor oneDNN packing run here)"
    if draft is not None and args.draft_quantize == "int8":
        quantize_int8(draft.model)
    return used


def _auto_tree_rows(args: argparse.Namespace, choice) -> int:  # noqa: ANN001 - a KernelChoice
    """--tree-rows auto: AUTO_TREE_ROWS for drafting with an EAGLE head (greedy or sampled) on the panel
    kernels where the timed AUTO_TREE_ROWS-row pass costs at most AUTO_TREE_MAX_ROW_COST one-row passes, else 0."""
    row_cost = choice.row_cost("panel", AUTO_TREE_ROWS)
    if choice.name != "panel" or args.drafter not in EAGLE_DRAFTERS or row_cost is None or row_cost > AUTO_TREE_MAX_ROW_COST:
        return 0
    print(f"verispec: draft trees of {AUTO_TREE_ROWS} rows up to {AUTO_TREE_MAX_CONTEXT} tokens of context (--tree-rows auto: {AUTO_TREE_ROWS} rows timed at {row_cost:.2f}x one)", file=sys.stderr)
    return AUTO_TREE_ROWS


def _draft_kernels_used(args: argparse.Namespace) -> str:
    """--draft-kernels as it runs here: whether int8 products take 8-bit dot products (VNNI)."""
    from verispec.models.panel_linear import int8_uses_vnni, panel_kernels_unavailable_reason

    if not draft_panel_kernels(args):
        return args.draft_kernels
    reason = panel_kernels_unavailable_reason()
    if reason is not None:
        return f"torch (panel kernels cannot run here: {reason})"
    if getattr(args, "draft_quantize", "int8") != "int8":
        return "panel, float32"
    return "panel, int8 with 8-bit dot products (VNNI)" if int8_uses_vnni() else "panel, int8 converted to float32"


def _build_parser() -> argparse.ArgumentParser:
    from verispec.drafters.combined import STREAM_GAMMA, STREAM_PATH_CONFIDENCE
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="verispec", description="Lossless speculative decoding: the target's output, sooner.")
    commands = parser.add_subparsers(dest="command", required=True)

    def model_options(sub: argparse.ArgumentParser) -> None:
        _add_loading_options(sub, drafter="auto", gamma=STREAM_GAMMA, path_confidence=STREAM_PATH_CONFIDENCE, tree_auto=True)
        sub.add_argument("--max-new-tokens", type=int, default=128, help="new tokens at most (default 128)")
        _add_sampling_options(sub)
        sub.add_argument("--raw", action="store_true", help="do not apply the chat template")

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
    _add_bench_parser(commands)
    _add_serve_parsers(commands)

    from verispec.attack_cli import add_attack_parser
    from verispec.eagle_cli import add_eagle_parser

    add_eagle_parser(commands)
    from verispec.parallel_cli import add_parallel_parser

    add_parallel_parser(commands)
    add_attack_parser(commands, _add_sampling_options, _add_kernel_options)
    from verispec.replay_cli import add_replay_parser

    add_replay_parser(commands, _add_kernel_options)

    costs = commands.add_parser("costs", help="forward-pass cost by number of new tokens, per kernel setting (what decides gamma here)")
    costs.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    costs.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model, or 'none' (default {DEFAULT_DRAFT})")
    add_target_dtype_option(costs)
    costs.add_argument("--context", type=int, default=300, help="tokens already in the KV cache (default 300)")
    costs.add_argument("--context-fill", choices=["prefill", "random"], default="prefill", help="prefill (default): run the model over --context tokens of text first; random: fill our lean forward's KV caches with random keys and values instead — the same attention work, seconds instead of minutes at 16K tokens; settings that do not run our lean forward (and the parallel head's drafting) are then skipped; the EAGLE head is always timed after random features")
    costs.add_argument("--tokens", default="1,2,3,4,5,6,8,12,16", help="comma list of new-token counts per pass")
    costs.add_argument("--repeats", type=int, default=5, help="passes per count; the median is reported (default 5)")
    costs.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    costs.add_argument("--cache-dir", type=Path, default=None)
    costs.add_argument("--eagle-head", type=Path, default=None, metavar="PATH", help="also time this EAGLE head's steps, over its draft vocabulary and the full one (default: the head `verispec eagle build` made, else the bundled head, if any)")
    costs.add_argument("--parallel-head", type=Path, default=None, metavar="PATH", help="also time this parallel head's drafting per proposed token next to the EAGLE head's (default: the one `verispec parallel train` made here, else the bundled head, if any)")
    costs.add_argument("--draft-vocab", type=int, default=32768, metavar="N", help="also time the int8 draft over its first N token ids (+ special ones), as --draft-vocab N drafts; 0 = skip (default 32768)")
    costs.set_defaults(handler=_costs)
    return parser


DRAFTERS = ("draft-model", "ngram", "ngram+draft", "eagle", "ngram+eagle", "auto", "parallel", "none")
EAGLE_DRAFTERS = ("eagle", "ngram+eagle", "auto")  # the drafters that load an EAGLE head
MODEL_DRAFTERS = ("draft-model", "ngram+draft", "auto")  # the drafters that run --draft


def _add_loading_options(sub: argparse.ArgumentParser, drafter: str = "draft-model", gamma: int = 6, path_confidence: float | None = None, tree_auto: bool = False) -> None:
    """Which target and drafter, and how they run: every command that decodes with a drafter.

    ``drafter`` / ``gamma`` / ``path_confidence``: the defaults. One stream (generate, compare) gets
    the fastest setting measured on HumanEval (lookup + draft model, ``STREAM_GAMMA`` drafts a round
    at most, ``STREAM_PATH_CONFIDENCE``); serve keeps the draft model with up to 6 and no stopping
    rule, the setting its concurrency measurements were made with."""
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    sub.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: built-in name, HF directory, .gguf file or hub id (default {DEFAULT_TARGET})")
    sub.add_argument("--drafter", choices=list(DRAFTERS), default=drafter, help=f"how drafts are made: a small draft model (draft-model), prompt lookup (ngram), prompt lookup on a 2+ token match and the draft model otherwise (ngram+draft), an EAGLE head (eagle, see --eagle-head), prompt lookup on a 2+ token match and the EAGLE head otherwise (ngram+eagle), ngram+draft for prompts shorter than --long-prompt tokens and ngram+eagle for longer ones (auto), a parallel head (parallel, see --parallel-head), or none (plain decoding); default {drafter}")
    sub.add_argument("--long-prompt", type=int, default=DEFAULT_LONG_PROMPT, metavar="N", help=f"--drafter auto: prompts of N tokens or more (chat template included) are drafted by ngram+eagle, shorter ones by ngram+draft (default {DEFAULT_LONG_PROMPT})")
    sub.add_argument("--eagle-head", type=Path, default=None, metavar="PATH", help="EAGLE head for --drafter eagle (default <cache>/eagle/<target>/head.safetensors, made by `verispec eagle build`, else the head bundled for the target)")
    from verispec.parallel_cli import add_parallel_drafter_options

    add_parallel_drafter_options(sub)
    from verispec.far_memory_cli import add_far_memory_options

    add_far_memory_options(sub)
    sub.add_argument("--draft", default=DEFAULT_DRAFT, help=f"the draft model for --drafter draft-model or ngram+draft, or 'none' for plain decoding (default {DEFAULT_DRAFT})")
    sub.add_argument("--gamma", type=int, default=gamma, help=f"draft tokens per target call; with --gamma-control adaptive the most a round drafts (default {gamma})")
    sub.add_argument("--gamma-control", choices=["adaptive", "fixed"], default="adaptive", help="adaptive (default): draft 0..gamma a round, chosen from this text's acceptance and the measured costs, decoding plainly while the text defeats the drafter (rejection attacks included); fixed: always gamma (serve: the batch policy's). Sampling with --seed (a seeded request) always drafts the fixed gamma, so its text depends on prompt and seed only, never on timings")
    sub.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    sub.add_argument("--cache-dir", type=Path, default=None, help="model cache (default $VERISPEC_CACHE or ~/.cache/verispec)")
    _add_kernel_options(sub, path_confidence, tree_auto)


def _add_serve_parsers(commands) -> None:  # noqa: ANN001 - argparse's private subparsers action
    from verispec.argtypes import positive_float, positive_int, slowdown_value
    from verispec.engine.monitor import MonitorConfig
    from verispec.serving.batch_plan import BatchPlanner
    from verispec.serving.gamma_policy import BatchGammaPolicy

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server batching concurrent requests through speculative decoding")
    _add_loading_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    serve.add_argument("--model-id", default=None, help="the model name clients pass (default: --target as given)")
    serve.add_argument("--max-batch", type=int, default=32, help="requests decoded together; more wait (default 32)")
    serve.add_argument("--prefill-budget", type=int, default=DEFAULT_PREFILL_BUDGET, metavar="TOKENS", help=f"prompt tokens prefilled between two decoding rounds (default {DEFAULT_PREFILL_BUDGET}): waiting requests join in order until their prompts pass it, the first always, the rest at the next round, so running requests and the first newcomer emit tokens in between instead of waiting for every prefill (four ~2.3K-token prompts arriving together: median first token after 85 s instead of 166 s here); 0 = admit every waiting request at once")
    serve.add_argument("--max-queue", type=int, default=64, help="waiting requests; beyond this the server answers 429 (default 64)")
    serve.add_argument("--gamma-full-batch", type=int, default=BatchGammaPolicy.full_until, help=f"batches up to this size draft the full --gamma (default {BatchGammaPolicy.full_until}: requests speculating together draft together; measured on 2 CPU cores, README)")
    serve.add_argument("--gamma-off-batch", type=int, default=BatchGammaPolicy.off_from, help=f"batches of this size or more decode plainly, gamma 0 (default {BatchGammaPolicy.off_from}); gamma tapers in between")
    serve.add_argument("--max-slowdown", type=slowdown_value, default=BatchPlanner.max_slowdown, metavar="F|off", help=f"with --gamma-control adaptive: the batch planner drafts only where no request's expected tokens/s fall more than F (a fraction) below a plain round's because of the other requests' drafts: a text that drafts badly is not slowed by the rest of the batch speculating; 0: no request may be slowed; off: the batch's total rate alone decides (default {BatchPlanner.max_slowdown})")
    serve.add_argument("--prefix-cache-mb", type=int, default=DEFAULT_PREFIX_CACHE_MB, metavar="MB", help=f"keep up to MB of the keys/values (and features) of earlier requests, for the target and for the draft model each, so that a request starts from the longest prefix it shares with them (the chat template's system prompt, a conversation's earlier turns and answers) and prefills only the rest; least recently used dropped first. The tokens are the same as without it (every pass then runs each row as alone through the fused stack; a cold prompt of 1K+ tokens may prefill slower). Needs lean batching; 0 = off (default {DEFAULT_PREFIX_CACHE_MB})")
    serve.add_argument("--batching", choices=["lean", "masked"], default="lean", help="lean (default): where the target runs the lean forward (panel kernels), each request keeps its own KV cache and a pass is one fused kernel call over every request's rows, a lone request exactly as `verispec generate` runs it; masked: transformers' forward over one shared, padded KV cache with an attention mask (what other targets always use)")
    serve.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of requests that give none (default 256)")
    serve.add_argument("--speedup-floor", type=positive_float, default=MonitorConfig.speedup_floor, metavar="F", help=f"log one structured warning (event speculation_below_floor; metric verispec_speculation_below_floor_total) when a request, an API key or the whole server realises less than F x plain decoding's speed over its last --monitor-window rounds, and again only after it recovered (default {MonitorConfig.speedup_floor})")
    serve.add_argument("--monitor-window", type=positive_int, default=MonitorConfig.window, metavar="N", help=f"rounds the acceptance monitor keeps per scope for /metrics' rolling gauges and the floor check; a verdict needs min(16, N) of them (default {MonitorConfig.window})")
    serve.set_defaults(handler=_serve)

    loadtest = commands.add_parser("loadtest", help="concurrent streamed chat requests against a running server: throughput and latency per concurrency")
    loadtest.add_argument("--url", action="append", default=None, metavar="[NAME=]URL", help="the server (default http://127.0.0.1:8000); repeat it to load several servers side by side, each level on each in turn (NAME labels the tables; the first is the one ratios are to)")
    loadtest.add_argument("--repeat", type=int, default=1, metavar="N", help="run the levels N times (servers visited in reversed order every other run) and report medians and ranges over the runs (default 1)")
    loadtest.add_argument("--concurrency", default="1,4,8,16,32", help="comma list of concurrent clients (default 1,4,8,16,32)")
    loadtest.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    loadtest.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends in turn (default 2)")
    loadtest.add_argument("--conversation", action="store_true", help="each client's requests are the turns of one chat: a HumanEval prompt, then the whole conversation so far plus a follow-up request; also reports the median time to first token of turns 2+ (what the server's --prefix-cache-mb saves) and of each turn")
    loadtest.add_argument("--long-prompts", type=int, default=None, metavar="N", help="send long prompts instead of HumanEval's: Python standard-library modules cut to about N tokens (by characters, ~4.4 a token) with a request to rewrite a function of them, a different one for every request; the table then reports the prompt tokens the server counted")
    loadtest.add_argument("--api-key", default=None)
    loadtest.set_defaults(handler=_loadtest)


def _add_bench_parser(commands) -> None:  # noqa: ANN001 - argparse's private subparsers action
    from verispec.bench.methods import DEFAULT_METHODS, METHOD_OPTIONS, METHODS, QUICK_METHODS
    from verispec.bench.long_context import DEFAULT_LONG_LENGTHS, LONG_REQUESTS, LONG_SPLITS
    from verispec.bench.prompts import DEFAULT_SPEC_BENCH
    from verispec.far_memory_cli import add_far_memory_options
    from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    method_column = max(map(len, [*METHODS, *METHOD_OPTIONS])) + 2  # a name as wide as a fixed column ran into its text
    bench = commands.add_parser(
        "bench",
        help="benchmark decoding methods side by side on prompt sets: speed-up, alpha, tau, identical outputs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run every method on every prompt (all methods on a prompt before the next prompt), on the same\n"
            "models, prompts and settings. Reports tokens/s, speed-up over plain decoding (ours and Hugging\n"
            "Face's), alpha, tau, acceptance by draft position, outputs identical to plain greedy, peak RSS,\n"
            "per category; writes results.json, report.md and PNG plots to --out. Ctrl-C stops the run and\n"
            "still writes what was measured."
        ),
        epilog=(
            "methods:\n"
            + "\n".join(f"  {m.name:<{method_column}}{m.description}" for m in METHODS.values())
            + "\n\nsettings per method, to compare them side by side in one run (NAME:key=value[:key=value]),\n"
            + "e.g. --methods plain,draft-model:gamma=6,draft-model:gamma=8:vocab=32768 (they override --gamma etc.):\n"
            + "\n".join(f"  {key:<{method_column}}{text}" for key, text in METHOD_OPTIONS.items())
        ),
    )
    bench.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: built-in name, HF directory, .gguf file or hub id (default {DEFAULT_TARGET})")
    bench.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for the methods that use one (default {DEFAULT_DRAFT}); loaded only if needed")
    bench.add_argument("--methods", default=None, metavar="A,B", help=f"comma list of methods (below), each optionally with :key=value settings; default: {','.join(DEFAULT_METHODS)}; with --quick: {','.join(QUICK_METHODS)}")
    bench.add_argument("--set", dest="sets", default=None, metavar="SETS", help="prompt sets, comma list of humaneval, spec-bench, file, long (default humaneval,spec-bench; file when --prompts is given); long: stdlib modules cut to --lengths tokens with a request at the end, one category per length")
    bench.add_argument("--lengths", default=",".join(map(str, DEFAULT_LONG_LENGTHS)), metavar="N,M", help=f"--set long: prompt lengths in tokens, chat template included (default {','.join(map(str, DEFAULT_LONG_LENGTHS))})")
    bench.add_argument("--split", choices=LONG_SPLITS, default="eval", help="--set long: dev (for choosing --local-window etc.) or eval modules, disjoint (default eval)")
    bench.add_argument("--long-request", choices=LONG_REQUESTS, default="rewrite", help="--set long: what is asked about the module's first function: rewrite it with type hints (an answer that copies much of the input; default) or explain it in words without its code (categories long-explain-<length>)")
    bench.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl", help='user prompts, one JSON object a line: {"id"?, "category"?, "prompt": str} or {..., "turns": [str, ...]}')
    bench.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH, metavar="PATH", help=f"Spec-Bench questions (default {DEFAULT_SPEC_BENCH}, relative to the current directory)")
    bench.add_argument("--categories", default=None, metavar="A,B", help="comma list of categories to keep (e.g. humaneval,coding,rag)")
    bench.add_argument("--num-prompts", type=int, default=None, metavar="N", help="at most N prompts per category; HumanEval is one category (default 8 HumanEval and 1 per Spec-Bench category, all of a --prompts file; --quick: 2 HumanEval, 1 per Spec-Bench category)")
    bench.add_argument("--first-prompt", type=int, default=0, metavar="N", help="skip the first N prompts of each category (default 0): e.g. --set humaneval --first-prompt 100 is a dev range of problems the default runs never use, for choosing settings")
    bench.add_argument("--raw", action="store_true", help="continue each prompt's text as it is, without the chat template (as /v1/completions does)")
    bench.add_argument("--multi-turn", action="store_true", help="also run the later turns of multi-turn prompts, after our plain decoding's answer to the earlier turns")
    bench.add_argument("--max-new-tokens", type=int, default=None, metavar="N", help="new tokens at most (default 128; --quick: 32)")
    bench.add_argument("--gamma", type=int, default=6, help="draft tokens per target call for our speculative methods (the maximum for -adaptive) (default 6, the best fixed value measured for the built-in pair on HumanEval)")
    _add_sampling_options(bench)
    bench.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bench.add_argument("--cache-dir", type=Path, default=None, help="model cache (default $VERISPEC_CACHE or ~/.cache/verispec)")
    _add_kernel_options(bench)
    bench.add_argument("--eagle-head", type=Path, action="append", default=None, metavar="PATH", help="EAGLE head for the eagle methods (default <cache>/eagle/<target>/head.safetensors, else the bundled head); repeat it to time several heads in one run, a method picking the N-th with :head=N (e.g. eagle:head=2; the first without it)")
    bench.add_argument("--parallel-head", type=Path, default=None, metavar="PATH", help="parallel head for the parallel methods (default <cache>/eagle/<target>/parallel.safetensors if it exists, else the bundled head)")
    add_far_memory_options(bench, with_mode=False)  # eagle-local / eagle-fold set the mode
    bench.add_argument("--out", type=Path, default=None, metavar="DIR", help="output directory (default bench-results/<timestamp>/)")
    bench.add_argument("--quick", action="store_true", help="a small preset for iteration: 2 HumanEval prompts + 1 per Spec-Bench category, 32 new tokens, methods plain,draft-model,ngram (about 10-15 minutes for the built-in models on a 2-core CPU); explicit options override it")
    bench.add_argument("--prefix-cache-mb", type=int, default=0, metavar="MB", help="each of our methods keeps its own prefix caches of MB (target and draft model): a prompt starts from the longest prefix of that method's earlier prompts and answers (here the chat template's system prompt; with --multi-turn the earlier turns); the warm-up's prompt is forgotten before timing. 0 = off (default): every prompt prefilled whole")
    bench.add_argument("--share-prefill", action="store_true", help=f"our methods share one target prefix cache (of --prefix-cache-mb MB, else {SHARED_PREFILL_MB}) instead of one each: the first method to run a prompt prefills it, the others start from its keys, values and features (the same tokens). For long prompts, whose prefill dwarfs decoding: compare the decode speed-ups (prefill excluded); wall-clock speed-ups then favour every method after the first. Needs the panel kernels' fused stack (not --target-kernels dense or packed)")
    bench.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the short untimed run of each method before timing")
    bench.set_defaults(handler=_bench)


def _sampling(args: argparse.Namespace):
    from verispec.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _load(args: argparse.Namespace):
    """Load target (and draft) and build plain and speculative decoders."""
    from verispec.engine import SpeculativeDecoder

    sampling = _check_decoding_options(args, args.max_new_tokens)  # before minutes of loading
    target, drafter = _load_target_and_drafter(args)
    screen = args.greedy_lm_head == "screened"
    plain = SpeculativeDecoder(target, screen_lm_head=screen)
    adaptive = gamma_is_adaptive(args.gamma_control, sampling)
    tree_max_context = AUTO_TREE_MAX_CONTEXT if getattr(args, "trees_by_auto", False) else None  # --tree-rows auto's trees end there
    speculative = (
        SpeculativeDecoder(target, drafter, gamma=args.gamma, adaptive_gamma=adaptive, screen_lm_head=screen, tree_rows=args.tree_rows, tree_max_context=tree_max_context)
        if drafter is not None
        else plain
    )
    return target, plain, speculative, sampling


def gamma_is_adaptive(gamma_control: str, sampling) -> bool:  # noqa: ANN001 - SamplingParams
    """Whether drafts per round follow the adaptive controller. Not for seeded sampling: the
    controller decides from timings, and the number of drafts decides how the seeded random stream
    is consumed, so the text would depend on the machine's speed. Greedy text never depends on it."""
    return gamma_control == "adaptive" and (sampling.is_greedy or sampling.seed is None)


def _load_target_and_drafter(args: argparse.Namespace):  # noqa: ANN202 - (LoadedModel, Drafter | None)
    """Load the target and build the drafter the options ask for (options checked already)."""
    import torch

    from verispec.drafters import DraftModel, NgramDrafter, lookup_then_model
    from verispec.models import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from verispec.parallel_cli import parallel_corrector_path, parallel_drafter_from_args, parallel_head_path

    plain_by_draft_none = args.drafter in MODEL_DRAFTERS and args.draft.lower() == "none"  # --draft none: plain decoding
    eagle_head = _eagle_head_path(args) if args.drafter in EAGLE_DRAFTERS and not plain_by_draft_none else parallel_corrector_path(args)
    if args.drafter == "auto" and eagle_head is None and not plain_by_draft_none:
        print(f"verispec: no EAGLE head for {args.target}: --drafter auto drafts every prompt with ngram+draft", file=sys.stderr)
        args.drafter = "ngram+draft"  # and is that drafter from here on (its trees, its name)
    parallel_head = parallel_head_path(args) if args.drafter == "parallel" else None
    started = time.perf_counter()
    target = load_model(args.target, cache_dir=args.cache_dir, dtype=target_dtype(args))
    draft = None
    if args.drafter in MODEL_DRAFTERS and args.draft.lower() != "none":
        draft = load_model(args.draft, cache_dir=args.cache_dir)
    _prepare_models(args, target, draft)
    if parallel_head is not None:
        drafter = parallel_drafter_from_args(args, target, parallel_head, corrector=eagle_head)
    elif eagle_head is not None:
        from verispec.drafters.eagle import EagleDrafter
        from verispec.drafters.draft_model import tree_alternatives
        from verispec.drafters.eagle.drafter import EAGLE_PATH_CONFIDENCE
        from verispec.far_memory_cli import far_memory_from_args

        alternatives = tree_alternatives(getattr(args, "tree_rows", 0))
        drafter = EagleDrafter(target, eagle_head, quantize=args.draft_quantize == "int8", far_memory=far_memory_from_args(args), path_confidence=EAGLE_PATH_CONFIDENCE, alternatives=alternatives)
        if args.drafter in ("ngram+eagle", "auto"):
            drafter = lookup_then_model(drafter)
        if args.drafter == "auto":
            from verispec.drafters.by_length import LengthSwitchDrafter

            drafter = LengthSwitchDrafter(lookup_then_model(draft_model_settings(args).build(draft, name=args.draft)), drafter, args.long_prompt)
    else:
        drafter = None  # no drafter, or --draft none: plain decoding
        if args.drafter == "ngram":
            drafter = NgramDrafter()
        elif draft is not None:
            drafter = draft_model_settings(args).build(draft, name=args.draft)
            if args.drafter == "ngram+draft":
                drafter = lookup_then_model(drafter)
    print(f"loaded in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return target, drafter


def _eagle_head_path(args: argparse.Namespace) -> Path | None:
    """The EAGLE head to load (--eagle-head or the default), checked to exist before minutes of model
    loading; None for --drafter auto when the target has none (it then drafts with the draft model)."""
    from verispec.drafters.eagle import existing_head_path
    from verispec.drafters.eagle.checkpoint import find_head

    if getattr(args, "drafter", None) == "auto" and args.eagle_head is None:
        return find_head(args.target, args.cache_dir)
    return existing_head_path(args.eagle_head, args.target, args.cache_dir)


def _bench_eagle_heads(args: argparse.Namespace, needed: int) -> list[Path]:
    """The bench's EAGLE heads (each --eagle-head, or the default head), checked to exist before
    model loading; empty when no method reads one (``needed``: the highest ``:head=N`` asked for)."""
    from verispec.drafters.eagle import existing_head_path

    if needed == 0:
        return []
    given = args.eagle_head or [None]  # None: the default head
    if needed > len(given):
        raise ValueError(f"--methods picks EAGLE head {needed} (:head={needed}), but --eagle-head gives {len(args.eagle_head or [])}: repeat --eagle-head PATH once per head")
    return [existing_head_path(path, args.target, args.cache_dir) for path in given]


def _encode(target, text: str, raw: bool) -> list[int]:
    from verispec.models import encode_prompt

    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; text prompts need one")
    return encode_prompt(target.tokenizer, text, chat=not raw)


def _generate(args: argparse.Namespace) -> int:
    from verispec.drafters.by_length import LengthSwitchDrafter
    from verispec.far_memory_cli import auto_attention_note

    target, _, decoder, sampling = _load(args)
    input_ids = _encode(target, args.prompt, args.raw)
    if isinstance(decoder.drafter, LengthSwitchDrafter):
        chosen = decoder.drafter.for_prompt(len(input_ids))
        print(f"verispec: drafting with {chosen.name} (--drafter auto: a prompt of {len(input_ids)} tokens, --long-prompt {decoder.drafter.long_prompt_tokens})", file=sys.stderr)
    if (note := auto_attention_note(decoder.drafter, len(input_ids))) is not None:
        print(note, file=sys.stderr)
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


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from verispec.serving import create_app

    # Everything cheap first: a bad option must not cost minutes of model loading.
    _check_model_options(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.tree_rows:  # it used to be accepted and ignored
        raise ValueError(f"--tree-rows {args.tree_rows}: serve verifies chains only (its batched passes take no draft trees); use generate or compare for trees")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it", file=sys.stderr)
    config = serve_config(args)
    target, drafter = _load_target_and_drafter(args)
    app = create_app(config, target, drafter)
    print(f"serving {config.model_id!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def serve_config(args: argparse.Namespace):  # noqa: ANN201 - a ServeConfig (verispec.serving imported lazily)
    """The server's configuration from ``verispec serve``'s options."""
    from verispec.engine.monitor import MonitorConfig
    from verispec.serving import BatchGammaPolicy, SchedulerConfig, ServeConfig

    policy = BatchGammaPolicy(full_until=args.gamma_full_batch, off_from=args.gamma_off_batch)
    monitor = MonitorConfig(window=args.monitor_window, min_rounds=min(MonitorConfig.min_rounds, args.monitor_window), speedup_floor=args.speedup_floor)
    scheduler = SchedulerConfig(
        gamma=args.gamma, max_batch=args.max_batch, max_queue=args.max_queue, gamma_policy=policy, adaptive_gamma=args.gamma_control == "adaptive", monitor=monitor,
        screen_lm_head=args.greedy_lm_head == "screened", lean_batching=args.batching == "lean", prefix_cache_mb=args.prefix_cache_mb, prefill_budget=args.prefill_budget,
        max_slowdown=args.max_slowdown,
    )
    return ServeConfig(model_id=args.model_id or args.target, api_key=args.api_key, default_max_tokens=args.default_max_tokens, scheduler=scheduler)


def _int_list(text: str, option: str) -> list[int]:
    """A comma list of integers from ``option``'s value; a clear error naming the option otherwise."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option} must be a comma list of integers, got {text!r}") from None


def _loadtest(args: argparse.Namespace) -> int:
    import asyncio

    from verispec.bench.prompts import humaneval_prompts
    from verispec.serving.loadtest import format_comparison, format_finished, format_table, parse_servers, run_level, served_model, side_by_side_order

    levels = _int_list(args.concurrency, "--concurrency")
    if not levels or min(levels) < 1 or args.max_tokens < 1 or args.requests_per_client < 1 or args.repeat < 1:
        raise ValueError("--concurrency levels, --max-tokens, --requests-per-client and --repeat must be >= 1")
    servers = parse_servers(args.url or ["http://127.0.0.1:8000"])
    if args.long_prompts is not None and args.long_prompts < 64:
        raise ValueError(f"--long-prompts must be at least 64 tokens, got {args.long_prompts}")
    if args.long_prompts is not None:
        from verispec.bench.long_context import approximate_long_texts

        prompts = approximate_long_texts(max(levels) * args.requests_per_client, args.long_prompts)
    else:
        prompts = [p.text for p in humaneval_prompts()]

    async def run() -> None:
        models = {server.name: await served_model(server.url, args.api_key) for server in servers}  # all reachable before any load
        for run_index in range(args.repeat):
            for index, level in enumerate(levels):
                for server in side_by_side_order(servers, run_index):
                    result = await run_level(server.url, models[server.name], prompts, level, args.max_tokens, args.requests_per_client, args.api_key, args.conversation)
                    where = f"run {run_index + 1}/{args.repeat}, " if args.repeat > 1 else ""
                    who = f", {server.name}" if len(servers) > 1 else ""
                    print(f"{where}concurrency {level}{who}: {result.tokens_per_s:.2f} tok/s", file=sys.stderr)
                    results[(index, server.name)].append(result)

    results: dict = {(index, server.name): [] for index in range(len(levels)) for server in servers}
    try:
        asyncio.run(run())
    except RuntimeError:  # a server failed mid-test: first the tables of the levels it finished, then the error
        if any(results.values()):
            print(format_finished(levels, servers, results))
        raise
    if len(servers) == 1 and args.repeat == 1:
        print(format_table([results[(index, servers[0].name)][0] for index in range(len(levels))]))
    else:
        print(format_comparison(levels, servers, results))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from verispec.bench.compare import compare_one, rows_to_dicts, summarize
    from verispec.bench.prompts import Prompt, humaneval_prompts

    if args.drafter == "none" or (args.drafter in MODEL_DRAFTERS and args.draft.lower() == "none"):
        raise ValueError("compare needs a drafter: --drafter ngram, or --drafter draft-model with --draft NAME")
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
    print(f"{args.target} + {speculative.drafter.name}, gamma {args.gamma}, {args.max_new_tokens} new tokens: {summary.line()}")
    if args.json is not None:
        payload = {"settings": {k: str(v) for k, v in vars(args).items() if k != "handler"}, "summary": summary.__dict__, "prompts": rows_to_dicts(rows)}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


def _head_if_any(find: Callable[[argparse.Namespace], Path], args: argparse.Namespace, given: Path | None) -> Path | None:
    """`verispec costs`: the head ``find`` resolves; an explicit path (``given``) must exist, the
    default head is timed only if there is one (None)."""
    try:
        return find(args)
    except FileNotFoundError:
        if given is not None:
            raise
        return None


def _costs(args: argparse.Namespace) -> int:
    import torch

    from verispec.bench.costs import CostTable, format_costs, forward_costs, stdlib_text_ids
    from verispec.models import load_model, quantize_int8
    from verispec.models.gqa_attention import use_gqa_attention
    from verispec.models.kernel_choice import fastest_target_kernels
    from verispec.models.packed_linear import PackedLinear, onednn_packing_available, pack_linears
    from verispec.models.panel_linear import panel_kernels_unavailable_reason, use_panel_kernels

    counts = _int_list(args.tokens, "--tokens")
    if not counts or min(counts) < 1 or args.context < 1 or args.repeats < 1:
        raise ValueError("--tokens counts, --context and --repeats must be >= 1")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = skip), got {args.draft_vocab}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from verispec.parallel_cli import parallel_head_path, print_proposal_costs

    # Both heads are found (or refused) now, not after minutes of timing.
    head_path = _head_if_any(_eagle_head_path, args, args.eagle_head)
    parallel_head = _head_if_any(parallel_head_path, args, args.parallel_head)
    table = CostTable(f"{args.context}-token cache" + (", random" if args.context_fill == "random" else ""), context_fill=args.context_fill)  # prints each setting as it is timed: at 8K a setting takes minutes
    target = load_model(args.target, cache_dir=args.cache_dir, dtype=target_dtype(args))
    float32 = target.model.dtype == torch.float32
    from verispec.models.panel_linear import bf16_kernels_available

    bf16_panel = target.model.dtype == torch.bfloat16 and bf16_kernels_available()  # what --target-kernels auto runs for it
    auto = fastest_target_kernels(target.model).name if float32 and (onednn_packing_available() or panel_kernels_unavailable_reason() is None) else "panel" if bf16_panel else "dense"
    mark = {auto: " (auto's choice here)"}
    table.add("target dense" + mark.get("dense", ""), forward_costs, target.model, args.context, counts, args.repeats)
    if onednn_packing_available() and float32:
        packed = use_gqa_attention(pack_linears(target.model))
        from_rows = next(module.min_packed_rows for module in packed.modules() if isinstance(module, PackedLinear))
        table.add(f"target packed (from {from_rows} rows)" + mark.get("packed", ""), forward_costs, packed, args.context, counts, args.repeats)
    if panel_kernels_unavailable_reason() is None and float32:
        # Swapping the packed layers releases their oneDNN copy: never three copies of the weights.
        panel = use_gqa_attention(use_panel_kernels(target.model))
        from verispec.engine.lean_lm import target_runs_lean

        if target_runs_lean(panel):  # what the engine runs: one kernel call per pass; and the same kernels under transformers' forward
            table.add("target panel, transformers forward", forward_costs, panel, args.context, counts, args.repeats, transformers_forward=True)
        table.add("target panel" + mark.get("panel", ""), forward_costs, panel, args.context, counts, args.repeats)
        if target.tokenizer is not None:
            # what greedy decoding pays: the LM head through its int8 screen, on real code (the screen's cost depends on the text)
            text_ids = stdlib_text_ids(target.tokenizer, args.context + max(counts))
            if max(text_ids) < target.model.get_output_embeddings().out_features:
                table.add("target panel, greedy, screened head (code text)", forward_costs, panel, args.context, counts, args.repeats, text_ids=text_ids, argmax_only=True)
    if bf16_panel:
        table.add("target panel, bfloat16" + mark.get("panel", ""), forward_costs, use_gqa_attention(use_panel_kernels(target.model)), args.context, counts, args.repeats)
    catch_ups: dict[str, float] = {}  # seconds of each head's catch-up over a prompt of code
    served_rounds: list[str] = []  # a server round's drafting, sessions alone and together
    if head_path is not None:
        from verispec.bench.costs import catch_up_cost, eagle_costs, served_round_cost
        from verispec.drafters.eagle import EagleDrafter
        from verispec.drafters.far_memory import FarMemoryConfig

        reduced = EagleDrafter(target, head_path)
        if reduced.vocab_ids is not None:
            prompt_ids = stdlib_text_ids(target.tokenizer, args.context + 1)[: args.context + 1] if target.tokenizer is not None else None
            quantized = EagleDrafter(target, head_path, quantize=True)
            heads = [(f"eagle, {len(reduced.vocab_ids)} vocab", reduced), (f"eagle int8, {len(reduced.vocab_ids)} vocab", quantized)]
            window = FarMemoryConfig().local_window
            if args.context > window:  # past the window the head's far-memory settings attend differently (Long context)
                heads += [(f"eagle int8, {mode} W {window}", EagleDrafter(target, head_path, quantize=True, far_memory=FarMemoryConfig(mode))) for mode in ("local", "fold")]
            for name, drafter in heads:
                table.add(name, eagle_costs, drafter, args.context, counts, args.repeats)
                if prompt_ids is not None:
                    catch_ups[name] = catch_up_cost(drafter, prompt_ids, args.repeats)
                    print(f"costs: {name}: catch-up over a {args.context}-token prompt: {catch_ups[name] * 1000:.0f} ms", file=sys.stderr, flush=True)
            # What a server round pays (sessions drafting together: propose_many), far-memory sessions too past the window.
            for name, drafter in [("eagle int8", quantized), *((name, drafter) for name, drafter in heads if drafter.far_memory is not None)]:
                for requests, drafts in ((4, 1), (8, 1), (8, 3)):
                    alone_s, together_s = served_round_cost(drafter, min(args.context, 2048), requests, drafts, args.repeats)
                    served_rounds.append(f"{name}: a server round of {requests} requests drafting {drafts} each: {alone_s * 1000:.1f} ms alone, {together_s * 1000:.1f} ms together ({alone_s / together_s:.1f}x)")
                    print(f"costs: {served_rounds[-1]}", file=sys.stderr, flush=True)
            del quantized, heads
        table.add("eagle, full vocab", eagle_costs, EagleDrafter(target, head_path, use_draft_vocab=False), args.context, counts, args.repeats)
        del reduced
    if parallel_head is not None:
        from verispec.parallel_cli import parallel_served_rounds

        served_rounds += parallel_served_rounds(min(args.context, 2048), args.repeats, target, parallel_head, head_path)
    if parallel_head is not None and args.context_fill == "prefill":
        print_proposal_costs(args.context, args.repeats, target, parallel_head, head_path)
    del target
    if args.draft.lower() != "none":
        draft = load_model(args.draft, cache_dir=args.cache_dir)
        from verispec.engine.lean_lm import lean_unsupported_reason

        lean = lean_unsupported_reason(draft.model) is None  # what DraftModel runs by default
        table.add("draft float32", forward_costs, draft.model, args.context, counts, args.repeats)
        if lean:
            table.add("draft float32, lean", forward_costs, draft.model, args.context, counts, args.repeats, lean=True)
        table.add("draft int8", forward_costs, quantize_int8(draft.model), args.context, counts, args.repeats)
        if lean:
            table.add("draft int8, lean, torch kernels", forward_costs, draft.model, args.context, counts, args.repeats, lean=True)
            if panel_kernels_unavailable_reason() is None:
                table.add("draft int8, lean, panel (default)", forward_costs, draft.model, args.context, counts, args.repeats, lean=True, panel_kernels=True)
                from verispec.drafters import DraftModel
                from verispec.models.int4_screen import Int4ScreenedHead

                screened = DraftModel(draft).greedy_head  # what greedy draft steps multiply by (1-2 rows; more: the int8 head)
                if isinstance(screened, Int4ScreenedHead):
                    table.add("draft int8, lean, panel, greedy 4-bit head", forward_costs, draft.model, args.context, counts, args.repeats, lm_head=screened, lean=True, panel_kernels=True)
        if args.draft_vocab:
            from verispec.drafters import DraftModel

            reduced = DraftModel(draft, draft_vocab=args.draft_vocab)
            table.add(f"draft int8, {len(reduced.vocab_ids)} vocab", forward_costs, draft.model, args.context, counts, args.repeats, lm_head=reduced.lm_head, lean=lean, panel_kernels=reduced.lean_decoder is not None and reduced.lean_decoder.panel_kernels)
    fill = ", random keys and values" if args.context_fill == "random" else ""
    print(f"median ms per forward pass over N new tokens after a {args.context}-token cache{fill} ({torch.get_num_threads()} threads)")
    print(format_costs(table.rows))
    for name, seconds in catch_ups.items():
        print(f"{name}: catch-up over a {args.context}-token prompt of standard-library code (a request's first draft): {seconds * 1000:.0f} ms")
    for line in served_rounds:
        print(line)
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


@dataclass(frozen=True)
class _BenchPreset:
    """Defaults of `verispec bench` that --quick changes; explicit options override either."""

    methods: tuple[str, ...]
    max_new_tokens: int
    per_category: dict[str, int | None]  # prompt set -> prompts per category (None: all)


def _bench_preset(quick: bool) -> _BenchPreset:
    from verispec.bench.methods import DEFAULT_METHODS, QUICK_METHODS

    if quick:
        # 15 prompts (~2,450 prompt tokens with the built-in tokenizer), 32 new tokens, 3 methods. On the
        # 2-core CPU with the built-in pair (target step ~0.3 s, draft step ~0.12 s, prefill ~25 ms a
        # token): per method ~60 s of target prefill + ~140 s of decoding (+25 s of draft prefill for
        # draft-model) -> ~11 min with warm-up and loading; 15 min if decoding runs at 0.45 s a token.
        return _BenchPreset(QUICK_METHODS, 32, {"humaneval": 2, "spec-bench": 1, "file": None, "long": 1})
    # The set: HumanEval x8 + Spec-Bench x1 per category (13), 128 new tokens, 8 methods:
    # ~4.5 min a prompt for all methods (prefill ~25 ms a token per method) -> ~95 minutes.
    return _BenchPreset(DEFAULT_METHODS, 128, {"humaneval": 8, "spec-bench": 1, "file": None, "long": 2})


def _bench(args: argparse.Namespace) -> int:
    import shlex

    import torch
    from tqdm import tqdm

    from verispec.bench import report
    from verispec.bench.methods import build_method, eagle_heads_needed, method_spec, parse_methods
    from verispec.bench.plots import write_plots
    from verispec.bench.runner import BenchRun, BenchSettings, count_runs, run_bench
    from verispec.bench.summary import reference_method, summarize
    from verispec.far_memory_cli import far_memory_from_args
    from verispec.models import load_model

    # Validate everything cheap before minutes of model loading.
    preset = _bench_preset(args.quick)
    names = parse_methods(args.methods if args.methods is not None else ",".join(preset.methods))
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else preset.max_new_tokens
    sampling = _check_decoding_options(args, max_new_tokens)
    prompts, per_set = _bench_prompts(args, preset)
    if args.raw and args.multi_turn:
        raise ValueError("--raw prompts are single texts to continue; they cannot be combined with --multi-turn")
    if args.share_prefill and args.target_kernels in ("dense", "packed"):
        raise ValueError(f"--share-prefill needs the panel kernels' fused stack (restored prompts must be exact), not --target-kernels {args.target_kernels}")
    needs_draft = any(method_spec(name).needs_draft for name in names)
    if needs_draft and args.draft.lower() == "none":
        raise ValueError(f"--draft none, but {', '.join(n for n in names if method_spec(n).needs_draft)} need(s) a draft model")
    eagle_heads = _bench_eagle_heads(args, eagle_heads_needed(names))
    from verispec.parallel_cli import parallel_head_path

    parallel_head = parallel_head_path(args) if any(name.startswith("parallel") for name in names) else None
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    out_dir = args.out if args.out is not None else Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loading = time.perf_counter()
    target = load_model(args.target, cache_dir=args.cache_dir, dtype=target_dtype(args))
    draft = load_model(args.draft, cache_dir=args.cache_dir) if needs_draft else None
    target_kernels = _prepare_models(args, target, draft)
    print(f"loaded in {time.perf_counter() - loading:.1f}s", file=sys.stderr)
    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; benchmark prompts are text")
    if args.multi_turn and not target.tokenizer.chat_template and any(p.follow_ups for p in prompts):
        raise ValueError("--multi-turn needs a target with a chat template (to place earlier answers in the conversation)")
    if "long" in per_set:  # its prompts are cut to token lengths: they need the tokenizer
        prompts, per_set = _bench_prompts(args, preset, target.tokenizer)
    shared_prefixes = None
    if args.share_prefill:
        from verispec.engine.lean_lm import prefix_reuse_unsupported_reason
        from verispec.engine.prefix_cache import prefix_cache_of_mb

        if (reason := prefix_reuse_unsupported_reason(target.model)) is not None:
            raise ValueError(f"--share-prefill cannot run this target: {reason}")
        shared_prefixes = prefix_cache_of_mb(args.prefix_cache_mb or SHARED_PREFILL_MB)
    head_quantize = args.draft_quantize == "int8"
    far_memory = far_memory_from_args(args, "fold")
    draft_settings, screen = draft_model_settings(args), args.greedy_lm_head == "screened"
    methods = {
        name: build_method(
            name, target, draft, args.gamma, eagle_head=eagle_heads, head_quantize=head_quantize, far_memory=far_memory, parallel_head=parallel_head,
            draft_settings=draft_settings, screen_lm_head=screen, tree_rows=args.tree_rows, prefix_cache_mb=args.prefix_cache_mb,
            shared_prefixes=shared_prefixes,
        )
        for name in names
    }
    answer_method = build_method("plain", target, None, args.gamma, screen_lm_head=screen) if args.multi_turn and "plain" not in methods else None
    settings = BenchSettings(max_new_tokens=max_new_tokens, sampling=sampling, multi_turn=args.multi_turn, warmup=args.warmup, chat=not args.raw)

    recorded = {
        "target": args.target,
        "draft": args.draft if needs_draft else None,
        "methods": names,
        "sets": list(per_set),
        "num_prompts_per_category": per_set,
        "categories": args.categories,
        "spec_bench": str(args.spec_bench) if "spec-bench" in per_set else None,
        "eagle_heads": [str(path) for path in eagle_heads],  # :head=N picks the N-th
        "long": {"lengths": args.lengths, "split": args.split, "request": args.long_request} if "long" in per_set else None,
        "far_memory": {"local_window": args.local_window, "memory_temperature": args.memory_temperature, "memory_weight": args.memory_weight},
        "prompts_file": str(args.prompts) if args.prompts else None,
        "multi_turn": args.multi_turn,
        "raw": args.raw,
        "max_new_tokens": max_new_tokens,
        "gamma": args.gamma,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "target_dtype": args.target_dtype,
        "target_kernels": target_kernels,
        "draft_kernels": _draft_kernels_used(args) if needs_draft else None,
        "quick": args.quick,
        "warmup": args.warmup,
        "share_prefill": args.share_prefill,
    }
    machine = report.machine_info()
    command = shlex.join(["verispec", *args.argv])
    prompt_list = [{"id": p.id, "category": p.category, "turns": len(p.turns)} for p in prompts]
    clock = time.perf_counter()

    def payload(run, summaries):  # noqa: ANN001, ANN202
        return report.results_payload(
            run, summaries, settings=recorded, machine=machine, command=command, started=started_at,
            elapsed_s=time.perf_counter() - clock, prompts=prompt_list,
            reference=reference_method(names) if sampling.is_greedy else None,
        )  # fmt: skip

    so_far = BenchRun()  # saved after every prompt turn, in case the process is killed outright

    def on_turn_done(rows):  # noqa: ANN001, ANN202
        bar.write(report.turn_line(rows))
        so_far.rows.extend(rows)
        report.write_json(payload(so_far, summarize(so_far.rows, names, sampling.is_greedy)), out_dir / "results.json")

    def on_row(row):  # noqa: ANN001, ANN202
        bar.update(1)
        bar.set_postfix_str(f"{row.method} {row.label}: {row.tokens_per_second:.2f} tok/s", refresh=True)

    print(f"{len(prompts)} prompts x {len(methods)} methods -> {out_dir}", file=sys.stderr)
    with tqdm(total=count_runs(prompts, methods, args.multi_turn), desc="bench", unit="run", file=sys.stderr) as bar:
        run = run_bench(prompts, methods, settings, target.tokenizer, answer_method=answer_method, on_row=on_row, on_turn_done=on_turn_done)

    summaries = summarize(run.rows, names, sampling.is_greedy, run.peak_rss)
    results = payload(run, summaries)
    report.write_json(results, out_dir / "results.json")
    baseline = reference_method([s.method for s in summaries])  # plain, else hf-plain, else None
    plots = write_plots(summaries, baseline, out_dir) if summaries else []
    (out_dir / "report.md").write_text(report.markdown_report(results, summaries, plots))
    if summaries:
        print(report.terminal_table(*report.summary_table(summaries, results["identical_reference"], run.rss_before)))
        if args.share_prefill:
            print(report.SHARED_PREFILL_NOTE.replace("**", ""))
        if baseline is not None and len(summaries) > 1:
            print(f"\nmedian speed-up vs {baseline} by category:")
            print(report.terminal_table(*report.category_table(summaries, baseline)))
            print(f"\ntau, alpha and decode speed-up (prefill excluded, median vs {baseline}) by category:")
            print(report.terminal_table(*report.category_detail_table(summaries, baseline)))
        split_header, split_rows = report.time_split_table(summaries)
        if split_rows:
            print("\nwhere the time went (our methods, all runs):")
            print(report.terminal_table(split_header, split_rows))
    state = "" if run.complete else f" (PARTIAL: {run.stopped_by})"
    print(f"\nresults{state}: {out_dir / 'results.json'}, {out_dir / 'report.md'}", file=sys.stderr)
    if isinstance(run.error, KeyboardInterrupt):
        return 130
    if run.error is not None:
        raise run.error
    return 0


def _bench_prompts(args: argparse.Namespace, preset: _BenchPreset, tokenizer=None):  # noqa: ANN001 - a transformers tokenizer
    """The prompts of the chosen sets, filtered; and the per-category limit used for each set.

    The long set needs the target's tokenizer: without one it is only validated (no prompts yet).
    """
    from verispec.bench.long_context import long_context_prompts, parse_lengths
    from verispec.bench.prompts import first_per_category, humaneval_prompts, prompts_from_file, spec_bench_prompts

    sets = list(dict.fromkeys(s.strip() for s in (args.sets or ("file" if args.prompts else "humaneval,spec-bench")).split(",") if s.strip()))
    unknown = [s for s in sets if s not in ("humaneval", "spec-bench", "file", "long")]
    if unknown or not sets:
        raise ValueError(f"--set: unknown {', '.join(map(repr, unknown)) or 'empty list'}; choose from humaneval, spec-bench, file, long")
    lengths = parse_lengths(args.lengths)
    if "file" in sets and args.prompts is None:
        raise ValueError("--set file needs --prompts FILE.jsonl")
    if "file" not in sets and args.prompts is not None:
        raise ValueError("--prompts is given but --set does not include 'file'")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.first_prompt < 0:
        raise ValueError(f"--first-prompt must be >= 0, got {args.first_prompt}")
    per_set = {s: args.num_prompts if args.num_prompts is not None else preset.per_category[s] for s in sets}
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    loaded = {
        "humaneval": lambda: humaneval_prompts(),
        "spec-bench": lambda: spec_bench_prompts(args.spec_bench),
        "file": lambda: prompts_from_file(args.prompts),
        "long": lambda: long_context_prompts(tokenizer, lengths, args.split, per_length=None, request=args.long_request) if tokenizer is not None else [],
    }
    every = {s: loaded[s]() for s in sets}
    if categories is not None:
        known = list(dict.fromkeys(p.category for ps in every.values() for p in ps))
        known += [f"long-{length}" for length in lengths if "long" in sets and tokenizer is None]
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"--categories: unknown {', '.join(unknown)}; the chosen sets have {', '.join(known)}")
    prompts = []
    for s in sets:
        kept = [p for p in every[s] if categories is None or p.category in categories]
        prompts += first_per_category(kept, per_set[s], skip=args.first_prompt)
    if not prompts and (tokenizer is not None or "long" not in sets):
        raise ValueError("no prompts selected (check --set and --categories)")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prompt id {next(i for i in ids if ids.count(i) > 1)!r} appears in more than one set")
    return prompts, per_set


if __name__ == "__main__":
    sys.exit(main())
