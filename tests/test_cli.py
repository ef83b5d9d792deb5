"""The command line on a tiny GGUF model (real tokenizer layout and chat template)."""

import json
import re
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_target, write_tiny_qwen2_gguf
from verispec.cli import main
from verispec.models.packed_linear import onednn_packing_available
from verispec.models.panel_linear import panel_kernels_unavailable_reason


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_qwen2_gguf(path)
    return str(path)


def test_generate_streams_text_and_stats(tiny_gguf, capsys):
    args = ["generate", "--target", tiny_gguf, "--draft", tiny_gguf, "--gamma", "3", "--max-new-tokens", "12", "the hello"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip()  # the tiny model's text
    assert "12 tokens" in err and "tau" in err and "alpha 1.00" in err  # identical draft: all accepted


def test_gamma_control_fixed_drafts_gamma_every_round_and_adaptive_keeps_the_text(tiny_gguf, capsys):
    # No path-confidence stop (generate's default stops where the tiny draft is unsure): fixed is gamma every round.
    with_stop = ["generate", "--target", tiny_gguf, "--drafter", "draft-model", "--draft", tiny_gguf, "--gamma", "3", "--max-new-tokens", "12", "--raw", "hello the"]
    common = [*with_stop, "--draft-path-confidence", "0"]
    assert main([*common, "--gamma-control", "fixed"]) == 0
    fixed_text, err = capsys.readouterr()
    # The draft is the target: 3 drafts accepted + 1 token, every round: 12 tokens in 3 calls.
    assert "target calls 3, tau 4.00" in err
    assert main([*with_stop, "--gamma-control", "fixed"]) == 0  # the default stop: shorter rounds, same text
    assert capsys.readouterr().out == fixed_text
    assert main(common) == 0  # adaptive, the default: greedy text cannot depend on gamma
    assert capsys.readouterr().out == fixed_text


def test_seeded_sampling_never_follows_the_adaptive_controller():
    from verispec.cli import gamma_is_adaptive
    from verispec.sampling import SamplingParams

    assert gamma_is_adaptive("adaptive", SamplingParams())  # greedy
    assert gamma_is_adaptive("adaptive", SamplingParams(temperature=0.7))  # unseeded sampling
    assert not gamma_is_adaptive("adaptive", SamplingParams(temperature=0.7, seed=3))  # its text must not depend on timings
    assert not gamma_is_adaptive("fixed", SamplingParams())


def test_generate_plain_matches_speculative_text(tiny_gguf, capsys):
    common = ["--target", tiny_gguf, "--max-new-tokens", "10", "--raw", "hello the"]
    assert main(["generate", "--draft", "none", *common]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--draft", tiny_gguf, *common]) == 0
    assert capsys.readouterr().out == plain


def test_draft_forward_option_picks_the_draft_models_forward_and_keeps_the_text(tiny_gguf, capsys):
    from verispec.cli import _build_parser, draft_model_settings

    parser = _build_parser()
    assert draft_model_settings(parser.parse_args(["generate", "x"])).lean is None  # lean where the model allows
    assert draft_model_settings(parser.parse_args(["bench", "--draft-forward", "transformers"])).lean is False
    assert draft_model_settings(parser.parse_args(["generate", "x"])).alternatives == 0  # no runner-ups without trees
    assert draft_model_settings(parser.parse_args(["generate", "x", "--tree-rows", "12"])).alternatives == 2
    settings = draft_model_settings(parser.parse_args(["bench", "--draft-vocab", "0", "--draft-path-confidence", "0", "--draft-kernels", "torch"]))
    assert (settings.draft_vocab, settings.path_confidence, settings.panel_kernels) == (None, None, False)  # 0 = off
    assert draft_model_settings(parser.parse_args(["serve", "--draft-window", "512"])).context_window == 512
    assert draft_model_settings(parser.parse_args(["generate", "x"])).context_window == 1024  # the default
    assert draft_model_settings(parser.parse_args(["bench", "--draft-window", "0"])).context_window is None  # 0 = the whole prompt
    common = ["generate", "--target", tiny_gguf, "--draft", tiny_gguf, "--max-new-tokens", "10", "--raw", "hello the"]
    texts = []
    for forward in ("lean", "transformers"):
        assert main([*common, "--draft-forward", forward]) == 0
        out, err = capsys.readouterr()
        texts.append(out)
        assert "alpha 1.00" in err  # the draft is the target itself: every draft accepted either way
    assert texts[0] == texts[1]
    with pytest.raises(SystemExit):
        main([*common, "--draft-forward", "fast"])
    assert "--draft-forward" in capsys.readouterr().err


def test_compare_writes_json(tiny_gguf, tmp_path, capsys):
    report = tmp_path / "report.json"
    args = ["compare", "--target", tiny_gguf, "--draft", tiny_gguf, "--max-new-tokens", "8", "--json", str(report), "hi"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "median speed-up" in out and "identical to plain 1/1" in out
    # The default drafter (auto) wants an EAGLE head for long prompts; this target has none.
    assert "no EAGLE head for" in err and "--drafter auto drafts every prompt with ngram+draft" in err
    payload = json.loads(report.read_text())
    assert payload["summary"]["identical"] == 1
    assert payload["prompts"][0]["speculative_tokens"] == 8


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gamma", "0"], "--gamma"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--draft-confidence", "1.5"], "--draft-confidence"),
        (["--draft-path-confidence", "1"], "--draft-path-confidence must be in [0, 1)"),
        (["--draft", "/nonexistent/model.gguf"], "does not exist"),
        (["--long-prompt", "0"], "--long-prompt must be >= 1"),
    ],
)
def test_bad_arguments_are_clear_errors(tiny_gguf, capsys, extra, message):
    assert main(["generate", "--target", tiny_gguf, *extra, "x"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--long-prompts", "32"], "--long-prompts must be at least 64 tokens, got 32"),
        (["--concurrency", "0"], "must be >= 1"),
        (["--repeat", "0"], "--repeat must be >= 1"),
        (["--url", "a=http://127.0.0.1:9"], "--url names must differ"),
        ([], "cannot list the models of http://127.0.0.1:9"),  # nothing listens: said, not a traceback
    ],
)
def test_loadtest_errors_are_clear_messages(capsys, extra, message):
    # Port 9 (discard): nothing listens, so bad options must be refused before connecting.
    assert main(["loadtest", "--url", "a=http://127.0.0.1:9", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_not_a_gguf_is_a_clear_error(tmp_path, capsys):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    assert main(["generate", "--target", str(fake), "--draft", "none", "x"]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


def test_ngram_drafter_and_plain_give_the_same_text(tiny_gguf, capsys):
    common = ["--target", tiny_gguf, "--max-new-tokens", "16", "--raw", "the hello the hello the"]
    assert main(["generate", "--drafter", "none", *common]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--drafter", "ngram", *common]) == 0
    assert capsys.readouterr().out == plain


def test_lookup_then_draft_model_gives_plain_text(tiny_gguf, capsys):
    common = ["--target", tiny_gguf, "--max-new-tokens", "16", "--raw", "the hello the hello the"]
    assert main(["generate", "--drafter", "none", *common]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--drafter", "ngram+draft", "--draft", tiny_gguf, *common]) == 0
    out, err = capsys.readouterr()
    assert out == plain and "16 tokens" in err
    assert main(["generate", "--draft", "none", *common]) == 0  # the default drafter, ngram+draft, without its model: plain
    out, err = capsys.readouterr()
    assert out == plain and "target calls 16" in err


def test_one_stream_commands_default_to_the_measured_fastest_setting():
    from verispec.cli import _build_parser
    from verispec.drafters.combined import STREAM_GAMMA, STREAM_PATH_CONFIDENCE

    for command in ("generate", "compare"):
        args = _build_parser().parse_args([command, "x"])
        # auto: ngram+draft below --long-prompt tokens (the fastest measured on HumanEval), ngram+eagle from there.
        assert (args.drafter, args.long_prompt, args.gamma, args.draft_path_confidence) == ("auto", 512, STREAM_GAMMA, STREAM_PATH_CONFIDENCE)
        assert _build_parser().parse_args([command, "--draft-path-confidence", "0", "x"]).draft_path_confidence == 0.0  # 0 = off
    serve = _build_parser().parse_args(["serve"])
    assert (serve.drafter, serve.gamma, serve.draft_path_confidence) == ("draft-model", 6, None)


def test_prefill_budget_reaches_the_scheduler_and_a_bad_one_is_refused_before_loading(capsys):
    from verispec.cli import _build_parser, serve_config

    assert serve_config(_build_parser().parse_args(["serve", "--prefill-budget", "0"])).scheduler.prefill_budget == 0
    assert serve_config(_build_parser().parse_args(["serve"])).scheduler.prefill_budget == 2048
    assert main(["serve", "--target", "/nonexistent/model.gguf", "--prefill-budget", "-1"]) == 2  # refused before the model is looked for
    err = capsys.readouterr().err
    assert "prefill_budget must be an integer >= 0" in err and "does not exist" not in err and "Traceback" not in err


def test_max_slowdown_reaches_the_batch_planner_and_a_bad_one_is_refused(capsys):
    from verispec.cli import _build_parser, serve_config
    from verispec.serving import SchedulerConfig

    assert serve_config(_build_parser().parse_args(["serve"])).scheduler.max_slowdown == 0.1
    assert serve_config(_build_parser().parse_args(["serve", "--max-slowdown", "0"])).scheduler.max_slowdown == 0.0
    assert serve_config(_build_parser().parse_args(["serve", "--max-slowdown", "off"])).scheduler.max_slowdown is None
    for bad in ("-0.1", "fast", "inf"):
        with pytest.raises(SystemExit):
            _build_parser().parse_args(["serve", "--max-slowdown", bad])
        assert "--max-slowdown: must be 'off' or a number >= 0" in capsys.readouterr().err
    for bad in (-1, True, "0.1"):
        with pytest.raises(ValueError, match="max_slowdown must be a number >= 0"):
            SchedulerConfig(max_slowdown=bad)


def test_greedy_lm_head_option_reaches_every_decoder_and_keeps_the_text(tiny_gguf, capsys):
    from verispec.cli import _build_parser, serve_config

    for command in ("generate", "compare", "bench", "serve"):
        assert _build_parser().parse_args([command, "x"] if command in ("generate", "compare") else [command]).greedy_lm_head == "screened"
    assert serve_config(_build_parser().parse_args(["serve"])).scheduler.screen_lm_head is True
    assert serve_config(_build_parser().parse_args(["serve", "--greedy-lm-head", "full"])).scheduler.screen_lm_head is False
    common = ["generate", "--target", tiny_gguf, "--draft", "none", "--max-new-tokens", "10", "--raw", "hello the"]
    texts = []
    for head in ("screened", "full"):
        assert main([*common, "--greedy-lm-head", head]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    with pytest.raises(SystemExit):
        main([*common, "--greedy-lm-head", "int8"])
    assert "--greedy-lm-head" in capsys.readouterr().err


def test_target_dtype_serves_the_target_in_that_precision_with_the_same_text_either_way(tiny_gguf, capsys):
    from verispec.cli import _build_parser, target_dtype
    from verispec.models.panel_linear import bf16_kernels_available, bf16_uses_amx, bf16_widened

    for command in ("generate", "compare", "bench", "serve", "costs"):
        args = _build_parser().parse_args([command, "x"] if command in ("generate", "compare") else [command])
        assert args.target_dtype == "float32" and target_dtype(args) == torch.float32
    assert target_dtype(_build_parser().parse_args(["generate", "--target-dtype", "bfloat16", "x"])) == torch.bfloat16
    common = ["generate", "--target", tiny_gguf, "--target-dtype", "bfloat16", "--max-new-tokens", "10", "--raw", "hello the"]
    assert main([*common, "--drafter", "none"]) == 0
    plain, err = capsys.readouterr()
    if bf16_kernels_available():  # AVX2 builds (16-column panels) widen the weights; AVX512-BF16 ones take dot products or tiles
        kernels = "panel (bfloat16 AMX tiles)" if bf16_uses_amx() else "panel (bfloat16 weights widened to float32)" if bf16_widened() else "panel (bfloat16 dot products)"
    else:
        kernels = "dense"
    assert f"target kernels: {kernels}" in err
    assert main([*common, "--drafter", "draft-model", "--draft", tiny_gguf]) == 0  # the draft stays float32 (int8)
    assert capsys.readouterr().out == plain
    with pytest.raises(SystemExit):
        main([*common, "--target-dtype", "float16"])
    assert "--target-dtype" in capsys.readouterr().err
    costs = ["costs", "--target", tiny_gguf, "--target-dtype", "bfloat16", "--draft", "none", "--context", "8", "--tokens", "1,3", "--repeats", "1"]
    assert main(costs) == 0
    out = capsys.readouterr().out
    assert ("target panel, bfloat16 (auto's choice here)" if bf16_kernels_available() else "target dense (auto's choice here)") in out


def test_target_dtype_bfloat16_without_the_kernels_runs_pytorchs_and_says_so(tiny_gguf, capsys, monkeypatch):
    from verispec.engine import lean_lm
    from verispec.models import panel_linear

    common = ["generate", "--target", tiny_gguf, "--target-dtype", "bfloat16", "--max-new-tokens", "10", "--raw", "hello the"]
    assert main([*common, "--drafter", "none", "--target-kernels", "dense"]) == 0
    dense = capsys.readouterr().out  # PyTorch's bfloat16 kernels under transformers' forward
    for module in (panel_linear, lean_lm):
        monkeypatch.setattr(module, "bf16_kernels_available", lambda: False)
    assert main([*common, "--drafter", "none"]) == 0
    plain, err = capsys.readouterr()
    assert "target kernels: dense (this CPU or build lacks the bfloat16 few-row kernels" in err
    assert plain == dense
    assert main([*common, "--drafter", "draft-model", "--draft", tiny_gguf]) == 0
    assert capsys.readouterr().out == plain


def test_compare_refuses_no_drafter(tiny_gguf, capsys):
    assert main(["compare", "--target", tiny_gguf, "--drafter", "none", "x"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_costs_prints_a_table_per_kernel_setting(tiny_gguf, capsys):
    args = ["costs", "--target", tiny_gguf, "--draft", tiny_gguf, "--context", "8", "--tokens", "1,4", "--repeats", "2"]
    assert main(args) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    settings = ["target dense", "draft float32", "draft float32, lean", "draft int8", "draft int8, lean, torch kernels"]
    if panel_kernels_unavailable_reason() is None:
        settings += ["target panel", "draft int8, lean, panel (default)", "target panel, greedy, screened head (code text)"]
    for setting in settings:
        assert setting in out
        # progress: each setting announced before it is timed and its passes printed once timed
        announced = err.index(f"costs: timing {setting}")
        assert re.search(rf"^costs: {re.escape(setting)}( \(auto's choice here\))?: 1: \d+ ms, 4: \d+ ms", err[announced:], re.MULTILINE)
    assert err.count("costs: timing ") == out.count("\n") - 2  # one announcement per table row (two header lines)
    assert "8-token cache" in err and "4: " in err
    assert out.count("(auto's choice here)") == 1  # --target-kernels auto's pick, timed on this model
    assert "1.00x" in out


def test_costs_after_a_random_context_times_our_lean_forward_and_skips_the_rest(tiny_gguf, capsys):
    args = ["costs", "--target", tiny_gguf, "--draft", tiny_gguf, "--context", "64", "--tokens", "1,4", "--repeats", "2", "--context-fill", "random", "--draft-vocab", "0"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "after a 64-token cache, random keys and values" in out
    timed = ["draft float32, lean", "draft int8, lean, torch kernels"] + (["target panel", "draft int8, lean, panel (default)"] if panel_kernels_unavailable_reason() is None else [])
    for setting in timed:
        assert re.search(rf"^{re.escape(setting)}( \(auto's choice here\))? +\d+ms", out, re.MULTILINE), setting
    for setting in ("target dense", "draft float32", "draft int8"):  # transformers' forward: no random fill, said so
        assert re.search(rf"^costs: {re.escape(setting)}( \(auto's choice here\))?: skipped \(--context-fill random: ", err, re.MULTILINE), setting
        assert not re.search(rf"^{re.escape(setting)}( \(auto's choice here\))? +\d+ms", out, re.MULTILINE)


def test_a_random_timing_context_fills_an_empty_lean_sequence_only():
    from verispec.bench.costs import ContextFillUnsupported, forward_costs
    from verispec.engine.lean_lm import LeanDecoder, LeanLM

    model = tiny_target()
    lm = LeanLM(model, LeanDecoder.shared(model, panel_kernels=False))
    lm.fill_for_timing(40, torch.Generator().manual_seed(0))
    assert len(lm) == 40 and all(layer_cache.length == 40 for layer_cache in lm.cache)
    assert lm.extend([5, 6, 7], num_logits=3).logits.shape[0] == 3 and len(lm) == 43  # passes run after it
    lm.crop(40)
    with pytest.raises(ValueError, match="fill_for_timing needs an empty sequence"):
        lm.fill_for_timing(8, torch.Generator())
    with pytest.raises(ContextFillUnsupported, match="lean forward's caches only"):
        forward_costs(model, 16, [1], repeats=1, context_fill="random")  # transformers' own forward
    with pytest.raises(ValueError, match="context_fill must be one of prefill, random"):
        forward_costs(model, 16, [1], repeats=1, context_fill="zeros")
    assert [cost.new_tokens for cost in forward_costs(model, 16, [1, 2], repeats=1, lean=True, context_fill="random")] == [1, 2]


def test_costs_bad_token_list(tiny_gguf, capsys):
    assert main(["costs", "--target", tiny_gguf, "--tokens", "1,x"]) == 2
    assert "--tokens" in capsys.readouterr().err


def test_costs_refuses_a_missing_head_before_loading_the_target(tiny_gguf, tmp_path, capsys, monkeypatch):
    import verispec.models

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the head paths were checked")

    monkeypatch.setattr(verispec.models, "load_model", no_loading)  # minutes on a real target: refuse first
    for option in ("--parallel-head", "--eagle-head"):
        assert main(["costs", "--target", tiny_gguf, "--cache-dir", str(tmp_path), option, str(tmp_path / "missing.safetensors")]) == 2
        err = capsys.readouterr().err
        assert "missing.safetensors" in err and "Traceback" not in err


def test_eagle_pipeline_extract_train_eval_and_generate(tiny_gguf, tmp_path, capsys):
    common = ["--target", tiny_gguf, "--cache-dir", str(tmp_path)]
    assert main(["eagle", "extract", *common, "--max-tokens", "600", "--max-seq-len", "200"]) == 0
    assert "600 tokens" in capsys.readouterr().err
    assert main(["eagle", "answers", *common, "--answer-tokens", "60", "--answer-batch", "2", "--answer-max-new-tokens", "8", "--max-seq-len", "200"]) == 0
    assert "60 tokens of answers" in capsys.readouterr().err
    train = ["--epochs", "1", "--tokens-per-step", "200", "--intermediate-size", "16", "--draft-vocab", "50", "--ce-weight", "0.5"]
    assert main(["eagle", "train", *common, *train]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["steps"] >= 2 and "head.safetensors" in err
    from safetensors import safe_open

    from verispec.drafters.eagle.train import default_precision

    with safe_open(err.split("head -> ")[1].strip(), "pt") as handle:  # --precision auto resolved to what this CPU does best
        training = json.loads(handle.metadata()["training"])
    assert training["precision"] == default_precision() and training["ce_weight"] == 0.5
    assert main(["eagle", "eval", *common, "--num-prompts", "1", "--max-new-tokens", "6", "--gamma", "3"]) == 0
    assert "tau" in capsys.readouterr().out
    # The replay's plumbing (prompts, rounds, report) matches decoding; its exactness with accepted drafts is tested in test_eagle.
    evaluate = ["eagle", "eval", *common, "--first-prompt", "3", "--num-prompts", "2", "--max-new-tokens", "12", "--gamma", "3"]
    assert main(evaluate) == 0
    decoded = capsys.readouterr().out
    assert main([*evaluate, "--teacher-forced"]) == 0
    replayed = capsys.readouterr().out
    assert "replayed" in replayed and replayed.splitlines()[1:] == decoded.splitlines()[1:]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": category, "turns": [f"question {i}"]}) + "\n" for i, category in enumerate(["math", "math", "coding"])))
    assert main(["eagle", "eval", *common, "--set", "spec-bench", "--spec-bench", str(questions), "--num-prompts", "1", "--max-new-tokens", "6", "--teacher-forced"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["math", "coding", "all"] and "1 prompts" in lines[1]
    # With an int8 head, far memory or the long set the rounds are replayed through the drafter's own
    # session on answers recorded through the engine's forward (exactness: test_eagle).
    assert main([*evaluate, "--teacher-forced", "--draft-quantize", "int8"]) == 0
    out = capsys.readouterr().out
    assert "int8 head" in out and "through the drafter's session" in out and "tau" in out
    long_eval = ["eagle", "eval", *common, "--set", "long", "--lengths", "300", "--num-prompts", "1", "--max-new-tokens", "6", "--gamma", "3", "--teacher-forced"]
    assert main([*long_eval, "--draft-attention", "fold", "--local-window", "16", "--memory-weight", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert "fold attention (W 16, T 1, λ 0.5)" in out and out.splitlines()[1].split()[:2] == ["long-300", "1"] and "ms a round" in out
    assert "1 recorded there" in err
    assert main([*long_eval, "--draft-attention", "local", "--local-window", "16"]) == 0
    assert "1 read from" in capsys.readouterr().err  # the recorded answer serves every setting
    for bad, named in ((["--lengths", "100"], "--lengths"), (["--first-prompt", "2"], "--first-prompt")):
        assert main([*long_eval, *bad]) == 2
        assert named in capsys.readouterr().err
    # The default head path is where `eagle train` put it; generate and costs find it there.
    assert main(["generate", *common, "--drafter", "eagle", "--max-new-tokens", "8", "hello"]) == 0
    assert "8 tokens" in capsys.readouterr().err
    # With draft trees the head offers runner-ups; the text stays plain decoding's.
    raw = ["generate", *common, "--max-new-tokens", "8", "--raw", "hello"]
    assert main([*raw, "--drafter", "none"]) == 0
    plain32 = capsys.readouterr().out
    assert main([*raw, "--drafter", "eagle", "--tree-rows", "8"]) == 0
    out, err = capsys.readouterr()
    assert out == plain32
    from verispec.models.panel_linear import panel_kernels_unavailable_reason

    if panel_kernels_unavailable_reason() is None:  # --target-kernels auto takes the stack trees run on
        assert "draft trees need the panel kernels' fused stack" in err
    # --drafter auto: lookup + draft model below --long-prompt tokens, lookup + the head from there; plain's text either way.
    for long_prompt, chosen in (("1000", f"ngram+{tiny_gguf}"), ("1", "ngram+eagle")):
        assert main([*raw, "--drafter", "auto", "--draft", tiny_gguf, "--long-prompt", long_prompt]) == 0
        out, err = capsys.readouterr()
        assert out == plain32 and f"drafting with {chosen} (--drafter auto" in err
    # The same head drafts for the target served in bfloat16 (its fingerprint is taken in bfloat16).
    bf16 = ["generate", *common, "--target-dtype", "bfloat16", "--max-new-tokens", "8", "--raw", "hello"]
    assert main([*bf16, "--drafter", "none"]) == 0
    plain = capsys.readouterr().out
    assert main([*bf16, "--drafter", "eagle"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*bf16, "--drafter", "ngram+eagle"]) == 0  # lookup first, the same head otherwise
    assert capsys.readouterr().out == plain
    assert main(["costs", *common, "--draft", "none", "--context", "8", "--tokens", "1,3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "eagle, 50 vocab" in out and "eagle int8, 50 vocab" in out and "eagle, full vocab" in out
    for name in ("eagle, 50 vocab", "eagle int8, 50 vocab"):  # what reading a prompt costs each head once a request
        assert re.search(rf"^{re.escape(name)}: catch-up over a 8-token prompt of standard-library code \(a request's first draft\): \d+ ms$", out, re.MULTILINE)
    assert "local W" not in out  # 8 tokens: within the window every far-memory setting is the trained attention
    # Past the window the int8 head is also timed with a local window and with far memory.
    assert main(["costs", *common, "--draft", "none", "--context", "300", "--tokens", "1", "--repeats", "1", "--context-fill", "random"]) == 0
    out = capsys.readouterr().out
    for name in ("eagle int8, local W 256", "eagle int8, fold W 256"):
        assert re.search(rf"^{re.escape(name)} .*\d", out, re.MULTILINE) and f"{name}: catch-up over a 300-token prompt" in out
        # and what a server round of far-memory sessions pays, drafting alone and together
        assert re.search(rf"^{re.escape(name)}: a server round of 8 requests drafting 3 each: [\d.]+ ms alone, [\d.]+ ms together", out, re.MULTILINE)
    # A rejection attack searched against the EAGLE head (the default head again).
    attack = ["attack", *common, "--surrogate", "eagle", "--prompt", "hello world", "--suffix-tokens", "2", "--steps", "1",
              "--candidates", "1", "--continuation-tokens", "3", "--search-only", "--out", str(tmp_path / "attack")]  # fmt: skip
    assert main(attack) == 0
    searched = json.loads((tmp_path / "attack" / "attack.json").read_text())
    assert searched["surrogate"] == "eagle" and len(searched["suffix"]) == 2 and 0 <= searched["expected_acceptance"] <= 1


def test_eagle_pipeline_on_a_bfloat16_target(tiny_gguf, tmp_path, capsys):
    """`eagle build --target-dtype bfloat16`: shards record the precision; features match float32's
    to bfloat16 rounding; a resumed run in another precision is refused, not mixed in."""
    from safetensors.torch import load_file

    common = ["--target", tiny_gguf, "--cache-dir", str(tmp_path / "bf16")]
    build = ["--max-tokens", "300", "--max-seq-len", "200", "--answer-tokens", "40", "--answer-batch", "2", "--answer-max-new-tokens", "6",
             "--epochs", "1", "--tokens-per-step", "200", "--intermediate-size", "16", "--draft-vocab", "50"]  # fmt: skip
    assert main(["eagle", "build", *common, "--target-dtype", "bfloat16", *build]) == 0
    assert "head.safetensors" in capsys.readouterr().err
    features_dir = next((tmp_path / "bf16" / "eagle").glob("*/features"))
    assert json.loads((features_dir / "manifest.json").read_text())["target_dtype"] == "bfloat16"
    assert json.loads((features_dir.parent / "answers" / "manifest.json").read_text())["target_dtype"] == "bfloat16"
    assert main(["eagle", "extract", "--target", tiny_gguf, "--cache-dir", str(tmp_path / "f32"), "--max-tokens", "300", "--max-seq-len", "200"]) == 0
    float32_dir = next((tmp_path / "f32" / "eagle").glob("*/features"))
    half, full = load_file(features_dir / "shard-00000.safetensors"), load_file(float32_dir / "shard-00000.safetensors")
    assert torch.equal(half["tokens"], full["tokens"])
    scale = full["features"].float().abs().mean()
    assert (half["features"].float() - full["features"].float()).abs().mean() < 0.05 * scale  # the same features, computed in bf16
    # Resuming the bfloat16 directory with a float32 target would mix precisions: refused, nothing written.
    shards = sorted(features_dir.iterdir())
    assert main(["eagle", "extract", *common, "--max-tokens", "600", "--max-seq-len", "200"]) == 2
    err = capsys.readouterr().err
    assert "target_dtype='bfloat16'" in err and "'float32'" in err and "Traceback" not in err
    assert sorted(features_dir.iterdir()) == shards
    assert main(["eagle", "eval", *common, "--target-dtype", "bfloat16", "--num-prompts", "1", "--max-new-tokens", "6", "--gamma", "3"]) == 0
    assert "tau" in capsys.readouterr().out


def test_eagle_drafter_without_a_head_is_a_clear_error(tiny_gguf, tmp_path, capsys):
    assert main(["generate", "--target", tiny_gguf, "--drafter", "eagle", "--eagle-head", str(tmp_path / "none.safetensors"), "x"]) == 2
    err = capsys.readouterr().err
    assert "EAGLE head" in err and "verispec eagle build" in err and "Traceback" not in err


def test_attack_on_an_eagle_head_that_does_not_exist_fails_before_loading(tmp_path, capsys):
    missing = tmp_path / "none.safetensors"
    assert main(["attack", "--surrogate", "eagle", "--eagle-head", str(missing), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "EAGLE head" in err and "verispec eagle build" in err and "Traceback" not in err


def test_eagle_train_refuses_keep_draft_vocab_without_init_from_before_loading(tmp_path, capsys):
    assert main(["eagle", "train", "--target", str(tmp_path / "missing.gguf"), "--keep-draft-vocab"]) == 2
    err = capsys.readouterr().err
    assert "--keep-draft-vocab needs --init-from" in err and "Traceback" not in err


def test_eagle_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["eagle", "train", "--threads", "0"])
    assert "--threads: must be >= 1" in capsys.readouterr().err


def test_attack_command_benchmarks_every_method_under_every_stressor(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "attack"
    methods = ["plain", "draft-model", "draft-model-adaptive", "ngram"]
    args = ["attack", "--target", tiny_gguf, "--draft", tiny_gguf, "--prompt", "hello world", "--suffix-tokens", "3", "--steps", "2",
            "--candidates", "2", "--continuation-tokens", "4", "--max-new-tokens", "6", "--gamma", "2",
            "--methods", ",".join(methods), "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    attack = json.loads((out / "attack.json").read_text())
    assert len(attack["suffix"]) == 3 and len(attack["history"]) == 2 and 0 < attack["expected_acceptance"] <= 1
    stressed = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert [p["category"] for p in stressed] == ["clean", "random", "language", "format", "attack"]
    assert stressed[0]["prompt"] == "hello world" and stressed[-1]["prompt"] == "hello world\n" + attack["suffix_text"]
    results = json.loads((out / "bench" / "results.json").read_text())
    assert results["command"].startswith("verispec bench --prompts") and results["settings"]["gamma"] == 2
    assert {(row["category"], row["method"]) for row in results["rows"]} == {(p["category"], m) for p in stressed for m in methods}
    by_method = {s["method"]: s for s in results["summaries"]}
    assert set(by_method["draft-model"]["by_category"]) == {p["category"] for p in stressed}
    # The draft is the target itself, so every stressed prompt's output is identical to plain decoding's.
    assert by_method["draft-model"]["identical"]["count"] == 5
    assert "expected acceptance" in capsys.readouterr().out


def test_attack_completion_placement_benchmarks_raw_prompts():
    from verispec.attack_cli import _bench_argv
    from verispec.cli import _build_parser

    args = _build_parser().parse_args(["attack", "--placement", "completion", "--temperature", "0.7", "--seed", "3"])
    argv = _bench_argv(args, Path("p.jsonl"), Path("out"))
    assert "--raw" in argv and argv[argv.index("--temperature") + 1] == "0.7" and argv[argv.index("--seed") + 1] == "3"
    assert "--raw" not in _bench_argv(_build_parser().parse_args(["attack"]), Path("p.jsonl"), Path("out"))


def test_attack_command_refuses_bad_options_before_loading(tiny_gguf, tmp_path, capsys):
    base = ["attack", "--target", tiny_gguf, "--draft", tiny_gguf, "--out", str(tmp_path / "x")]
    assert main([*base, "--stressors", "clean,nonsense"]) == 2
    assert "--stressors" in capsys.readouterr().err
    assert main([*base, "--methods", "plain,warp-drive"]) == 2
    assert "--methods" in capsys.readouterr().err
    assert main([*base, "--prompt", "hi", "--num-prompts", "3"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--steps", "0"])
    assert "--steps: must be >= 1" in capsys.readouterr().err


def test_serve_options_set_the_monitor_floor_and_window(capsys):
    from verispec.cli import _build_parser, serve_config
    from verispec.engine.monitor import MonitorConfig

    default = serve_config(_build_parser().parse_args(["serve"])).scheduler.monitor
    assert default == MonitorConfig()
    monitor = serve_config(_build_parser().parse_args(["serve", "--speedup-floor", "0.95", "--monitor-window", "8"])).scheduler.monitor
    assert (monitor.speedup_floor, monitor.window, monitor.min_rounds) == (0.95, 8, 8)
    for option, value in (("--speedup-floor", "0"), ("--speedup-floor", "nan"), ("--monitor-window", "0")):
        with pytest.raises(SystemExit):
            main(["serve", option, value])
        assert option in capsys.readouterr().err


def test_target_kernels_auto_says_what_it_picked(tiny_gguf, capsys):
    assert main(["generate", "--target", tiny_gguf, "--drafter", "none", "--max-new-tokens", "4", "--raw", "hello"]) == 0
    err = capsys.readouterr().err
    if panel_kernels_unavailable_reason() is None:
        assert "target kernels: panel (timed here" in err or "target kernels: packed (timed here" in err
    if panel_kernels_unavailable_reason() is None and onednn_packing_available():
        # greedy with the screened head (the defaults): panel's head share timed as the screen runs
        assert "LM-head rows (screened on panel)" in err
        for extra in (["--greedy-lm-head", "full"], ["--temperature", "0.8", "--seed", "1"]):
            assert main(["generate", "--target", tiny_gguf, "--drafter", "none", "--max-new-tokens", "4", "--raw", *extra, "hello"]) == 0
            err = capsys.readouterr().err
            assert "LM-head rows, ms" in err and "screened on panel" not in err, extra
    assert main(["generate", "--target", tiny_gguf, "--drafter", "none", "--max-new-tokens", "4", "--raw", "--target-kernels", "dense", "hello"]) == 0
    assert "target kernels:" not in capsys.readouterr().err  # an explicit choice is not timed


def test_tree_rows_auto_limits_trees_to_short_contexts_and_an_explicit_count_does_not(tiny_gguf):
    from verispec import cli

    def decoder(*extra):
        args = cli._build_parser().parse_args(["generate", "--target", tiny_gguf, "--draft", tiny_gguf, "--drafter", "ngram+draft", *extra, "hi"])
        return cli._load(args)[2]

    assert decoder().tree_max_context == cli.AUTO_TREE_MAX_CONTEXT
    explicit = decoder("--tree-rows", "8")
    assert explicit.tree_rows == 8 and explicit.tree_max_context is None


def test_bench_help_keeps_every_method_name_apart_from_its_description(capsys):
    from verispec.bench.methods import METHOD_OPTIONS, METHODS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for name in [*METHODS, *METHOD_OPTIONS]:  # "parallel-corrected-eagle" once ran into its text
        assert any(re.match(rf"  {re.escape(name)}  +\S", line) for line in lines), name
