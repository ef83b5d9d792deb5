"""`verispec bench`: prompt sets, the interleaved runner, the summary math, reports, and the CLI on a tiny GGUF."""

import json
import statistics
from pathlib import Path

import pytest
import torch

from marks import needs_kernels
from tiny_models import write_tiny_qwen2_gguf
from verispec.bench import methods as bench_methods
from verispec.bench.methods import RunOutput
from verispec.bench.prompts import Prompt, first_per_category, prompts_from_file, spec_bench_prompts
from verispec.bench.runner import WARMUP_PROMPT_TOKENS, WARMUP_TOKENS, BenchSettings, Row, run_bench
from verispec.bench.summary import first_difference, speedup, summarize
from verispec.drafters.draft_model import DraftModelSettings
from verispec.cli import main
from verispec.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_tiny_qwen2_gguf(path)
    return str(path)


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "rep", "category": "code", "prompt": "the hello the hello the hello"},
        {"id": "chat", "category": "chat", "turns": ["hello the", "the the hello"]},
        {"prompt": "hello hello the"},  # no id, no category
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def spec_bench_file(path: Path, categories: dict[str, int]) -> Path:
    """A Spec-Bench-format file: ``categories`` maps a category to its number of questions (the first has 2 turns)."""
    lines, question = [], 0
    for category, count in categories.items():
        for i in range(count):
            question += 1
            turns = [f"hello the {category} {i}"] + (["the hello again"] if i == 0 else [])
            lines.append(json.dumps({"question_id": question, "category": category, "turns": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path


def bench(tiny_gguf, out, *extra):
    return main(["bench", "--target", tiny_gguf, "--draft", tiny_gguf, "--max-new-tokens", "8", "--out", str(out), *extra])


# --- end to end ------------------------------------------------------------------------------


def test_bench_end_to_end_writes_results_report_and_plots(tiny_gguf, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    methods = ["plain", "draft-model", "ngram", "hf-plain"]
    assert bench(tiny_gguf, out, "--prompts", str(prompts_file), "--methods", ",".join(methods), "--gamma", "4") == 0
    stdout = capsys.readouterr().out
    assert "vs plain median (mean)" in stdout and "vs hf-plain median (mean)" in stdout

    results = json.loads((out / "results.json").read_text())
    for key in ["partial", "command", "settings", "machine", "prompts", "memory", "summaries", "rows"]:
        assert key in results
    assert results["partial"] is False and results["command"].startswith("verispec bench --target")
    assert results["settings"]["methods"] == methods and results["settings"]["max_new_tokens"] == 8
    # which kernels ran is part of what was measured: auto's pick with its timings, or dense
    assert results["settings"]["target_kernels"].startswith(("auto: panel (", "auto: packed (", "dense ("))
    assert results["settings"]["draft_kernels"].startswith(("panel, int8", "torch ("))  # --draft-quantize int8 is the default
    for key in ["cpu", "logical_cpus", "torch_threads", "torch", "transformers"]:
        assert key in results["machine"]
    assert [p["id"] for p in results["prompts"]] == ["rep", "chat", "line-3"]
    assert len(results["rows"]) == 3 * len(methods)  # first turns only without --multi-turn

    by_method = {s["method"]: s for s in results["summaries"]}
    assert list(by_method) == methods
    for summary in by_method.values():
        assert set(summary["speedup"]) == {"plain", "hf-plain"} and summary["speedup"]["plain"]["prompts"] == 3
        assert set(summary["by_category"]) == {"code", "chat", "user"}
        assert summary["peak_rss"] > 0
    assert by_method["plain"]["speedup"]["plain"]["median"] == pytest.approx(1.0)
    # The draft is the target itself: every draft is accepted, gamma+1 tokens per call until the budget ends.
    assert by_method["draft-model"]["acceptance_rate"] == pytest.approx(1.0)
    assert by_method["draft-model"]["acceptance_by_position"] == [1.0] * 4
    assert by_method["plain"]["acceptance_rate"] is None and by_method["hf-plain"]["acceptance_rate"] is None
    # Greedy: everything is token-identical to our plain decoding, Hugging Face included.
    assert by_method["plain"]["identical"] is None
    for method in ["draft-model", "ngram", "hf-plain"]:
        assert by_method[method]["identical"] == {"reference": "plain", "count": 3, "compared": 3, "differences": []}
    # Plain decoding, ours and HF's: one target call per new token (HF's first call is its prefill and emits a token).
    for row in results["rows"]:
        if row["method"] in ("plain", "hf-plain"):
            assert row["target_calls"] == row["new_tokens"] == 8
    assert by_method["hf-plain"]["tokens_per_call"] == pytest.approx(1.0)
    # Where the time went: ours from the engine's timers (parts within the wall-clock), none for Hugging Face.
    assert by_method["hf-plain"]["time_split"] is None
    for method in ("plain", "draft-model", "ngram"):
        split, seconds = by_method[method]["time_split"], by_method[method]["seconds"]
        assert split["prefill"] > 0 and split["verify"] > 0
        assert split["target_calls"] == sum(r["target_calls"] for r in results["rows"] if r["method"] == method)
        assert split["prefill"] + split["draft"] + split["verify"] + split["other"] == pytest.approx(seconds)
    assert by_method["plain"]["time_split"]["draft"] == 0 and by_method["draft-model"]["time_split"]["draft"] > 0
    assert "where the time went" in stdout

    report = (out / "report.md").read_text()
    assert "| method |" in report and "## Speed-up by category" in report and results["command"] in report
    assert "## Where the time went" in report and "| ms / verify pass |" in report
    assert "includes the loaded target and draft models" in report
    for name in ["speedup_by_category.png", "acceptance_by_position.png"]:
        assert_valid_png(out / name)


@needs_kernels
def test_shared_prefill_lets_every_method_after_the_first_restore_the_prompt(tiny_gguf, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    methods = ["plain", "ngram", "draft-model", "draft-model:gamma=2:prefix=0"]
    assert bench(tiny_gguf, out, "--prompts", str(prompts_file), "--methods", ",".join(methods), "--target-kernels", "panel", "--share-prefill") == 0
    assert "Prefill shared (--share-prefill)" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["share_prefill"] is True
    reused = {(row["prompt_id"], row["method"]): row["reused_prompt_tokens"] for row in results["rows"]}
    for row in results["rows"]:
        # The first method prefills (from the warm-up's prompt nothing is left; later prompts share
        # the chat template's opening with earlier ones); a method with its own :prefix setting (here
        # none at all) prefills whole; the others restore all but the last prompt token (the
        # decoder feeds that one with the first drafts).
        if row["method"] == "plain":
            assert row["reused_prompt_tokens"] < row["prompt_tokens"] - 1
        else:
            assert reused[row["prompt_id"], row["method"]] == (0 if row["method"].endswith("prefix=0") else row["prompt_tokens"] - 1), row["method"]
    assert reused["rep", "plain"] == 0
    by_method = {s["method"]: s for s in results["summaries"]}
    for method in methods[1:]:  # restored prompts are exact: the same tokens
        assert by_method[method]["identical"]["differences"] == []
    assert "Prefill shared (--share-prefill)" in (out / "report.md").read_text()


def test_method_settings_run_side_by_side_under_their_full_names(tiny_gguf, prompts_file, tmp_path):
    out = tmp_path / "out"
    methods = ["plain", "draft-model:gamma=3", "draft-model:gamma=3:vocab=40:confidence=0"]
    assert bench(tiny_gguf, out, "--prompts", str(prompts_file), "--methods", ",".join(methods), "--gamma", "5", "--draft-confidence", "0.99") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["methods"] == methods
    assert [s["method"] for s in results["summaries"]] == methods
    most_drafted = {name: max(max(r["drafted_per_round"]) for r in results["rows"] if r["method"] == name) for name in methods[1:]}
    # The draft is the target, so without a confidence stop it drafts all it may until the token
    # budget ends: its own gamma (3), not --gamma 5. The other variant keeps the run's 0.99 threshold,
    # which the tiny model's distributions do not reach on every token.
    assert most_drafted["draft-model:gamma=3:vocab=40:confidence=0"] == 3
    assert most_drafted["draft-model:gamma=3"] < 3
    by_method = {s["method"]: s for s in results["summaries"]}
    for name in methods[1:]:
        assert by_method[name]["identical"]["count"] == 3  # greedy: settings change the speed, never the output


def test_two_eagle_heads_run_side_by_side(tiny_gguf, prompts_file, tmp_path):
    from verispec.drafters.eagle import EagleConfig, EagleHead, save_head, target_fingerprint
    from verispec.models import load_model

    model = load_model(tiny_gguf).model
    paths = [tmp_path / "head-a.safetensors", tmp_path / "head-b.safetensors"]
    for seed, path in enumerate(paths):
        torch.manual_seed(seed)
        save_head(path, EagleHead(EagleConfig.for_target(model.config, 24)).eval(), draft_vocab=None, fingerprint=target_fingerprint(model))
    out = tmp_path / "out"
    methods = ["plain", "eagle", "eagle:head=2"]
    heads = [arg for path in paths for arg in ("--eagle-head", str(path))]
    assert bench(tiny_gguf, out, "--prompts", str(prompts_file), "--methods", ",".join(methods), "--gamma", "3", *heads) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["eagle_heads"] == [str(path) for path in paths]
    assert {s["method"]: s["identical"]["count"] for s in results["summaries"] if s["method"] != "plain"} == {"eagle": 3, "eagle:head=2": 3}


def test_method_settings_reach_the_drafter(tiny_gguf):
    from verispec.models import load_model

    model = load_model(tiny_gguf)
    run_settings = DraftModelSettings(confidence_threshold=0.5, draft_vocab=30)
    default = bench_methods.build_method("draft-model", model, model, gamma=4, draft_settings=run_settings)
    assert default.decoder.gamma == 4 and default.decoder.drafter.confidence_threshold == 0.5
    assert len(default.decoder.drafter.vocab_ids) >= 30
    variant = bench_methods.build_method("draft-model-adaptive:gamma=7:vocab=0:confidence=0.25", model, model, gamma=4, draft_settings=run_settings)
    assert variant.name == "draft-model-adaptive:gamma=7:vocab=0:confidence=0.25"
    assert variant.decoder.gamma == 7 and variant.decoder._gamma_controller is not None
    assert variant.decoder.drafter.confidence_threshold == 0.25 and variant.decoder.drafter.vocab_ids is None  # 0: the full vocabulary
    assert bench_methods.parse_variant("ngram+draft:vocab=64") == bench_methods.MethodVariant("ngram+draft", vocab=64)
    combined = bench_methods.build_method("ngram+draft-adaptive:gamma=7", model, model, gamma=4)
    assert combined.decoder.gamma == 7 and combined.decoder._gamma_controller is not None
    assert combined.decoder.drafter.name == f"ngram+{model.name}"
    assert combined.decoder.drafter.fallback.path_confidence is None
    path = bench_methods.build_method("ngram+draft-adaptive:path=0.45", model, model, gamma=4, draft_settings=DraftModelSettings(path_confidence=0.2))
    assert path.decoder.drafter.fallback.path_confidence == 0.45
    assert bench_methods.build_method("draft-model:path=0", model, model, gamma=4, draft_settings=DraftModelSettings(path_confidence=0.2)).decoder.drafter.path_confidence is None
    assert bench_methods.build_method("draft-model", model, model, gamma=4, draft_settings=DraftModelSettings(path_confidence=0.2)).decoder.drafter.path_confidence == 0.2
    assert bench_methods.build_method("plain", model, None, gamma=4).decoder.screen_lm_head is True
    assert bench_methods.build_method("plain:screen=0", model, None, gamma=4).decoder.screen_lm_head is False
    assert bench_methods.build_method("ngram:screen=1", model, None, gamma=4, screen_lm_head=False).decoder.screen_lm_head is True
    # Draft trees: the runner-ups they verify are drafted only where a method's passes take them.
    chains = bench_methods.build_method("ngram+draft-adaptive", model, model, gamma=4)
    assert chains.decoder.tree_rows == 0 and chains.decoder.drafter.fallback.alternatives == 0
    trees = bench_methods.build_method("ngram+draft-adaptive:tree=12", model, model, gamma=4)
    assert trees.decoder.tree_rows == 12 and trees.decoder.drafter.fallback.alternatives == 2
    off = bench_methods.build_method("draft-model:tree=0", model, model, gamma=4, tree_rows=8)
    assert off.decoder.tree_rows == 0 and off.decoder.drafter.alternatives == 0
    assert bench_methods.build_method("draft-model", model, model, gamma=4, tree_rows=8).decoder.drafter.alternatives == 2
    # The parallel methods: correction, and its pair fit by the EAGLE head, where the name asks for them.
    from verispec.drafters.eagle import EagleConfig, EagleHead
    from verispec.drafters.parallel import ParallelConfig, ParallelHead

    torch.manual_seed(0)
    parallel = ParallelHead(ParallelConfig.for_target(model.model.config, 24, block_size=3)).eval()
    eagle = EagleHead(EagleConfig.for_target(model.model.config, 24)).eval()
    built = {name: bench_methods.build_method(name, model, None, gamma=3, eagle_head=eagle, parallel_head=parallel).decoder.drafter for name in ("parallel", "parallel-corrected", "parallel-corrected-eagle")}
    assert [(d.correction, d.corrector is not None) for d in built.values()] == [(False, False), (True, False), (True, True)]
    assert all(drafter.path_confidence is None for drafter in built.values())  # no path stop unless the name asks for one
    stopped = bench_methods.build_method("parallel-corrected-eagle:path=0.2", model, None, gamma=3, eagle_head=eagle, parallel_head=parallel)
    assert stopped.decoder.drafter.path_confidence == 0.2
    from verispec.drafters.parallel.drafter import PARALLEL_CANDIDATES

    assert [drafter.candidates for drafter in built.values()][1:] == [PARALLEL_CANDIDATES] * 2
    wider = bench_methods.build_method("parallel-corrected-eagle:cand=6", model, None, gamma=3, eagle_head=eagle, parallel_head=parallel)
    assert wider.decoder.drafter.candidates == 6
    from verispec.drafters.parallel.drafter import PARALLEL_PATH_RULE

    # The EAGLE fit picks its path by generate's rule unless :rule= names one; the head's own fit has no successors.
    assert [d.path_rule for d in built.values()] == ["lattice", "lattice", PARALLEL_PATH_RULE]
    for rule in ("lattice", "successor"):
        assert bench_methods.build_method(f"parallel-corrected-eagle:rule={rule}", model, None, gamma=3, eagle_head=eagle, parallel_head=parallel).decoder.drafter.path_rule == rule
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        bench_methods.build_method("parallel-corrected-eagle", model, None, gamma=3, parallel_head=parallel)
    # Several EAGLE heads in one run: :head=N picks the N-th, the first without it; a head the run lacks is refused.
    other = EagleHead(EagleConfig.for_target(model.model.config, 24)).eval()
    heads = [eagle, other]
    assert bench_methods.build_method("eagle", model, None, gamma=3, eagle_head=heads).decoder.drafter.head is eagle
    assert bench_methods.build_method("ngram+eagle-adaptive:head=2", model, None, gamma=3, eagle_head=heads).decoder.drafter.fallback.head is other
    assert bench_methods.build_method("parallel-corrected-eagle:head=2", model, None, gamma=3, eagle_head=heads, parallel_head=parallel).decoder.drafter.corrector is other
    assert bench_methods.build_method("eagle:head=1", model, None, gamma=3, eagle_head=other).decoder.drafter.head is other
    with pytest.raises(ValueError, match=r"'eagle:head=3' picks EAGLE head 3, but the run has 2 \(repeat --eagle-head"):
        bench_methods.build_method("eagle:head=3", model, None, gamma=3, eagle_head=heads)
    # Deeper EAGLE trees only where a method asks (:expand=N, with trees): one-level by default.
    assert bench_methods.build_method("ngram+eagle-adaptive:tree=8", model, None, gamma=3, eagle_head=eagle).decoder.drafter.fallback.expand == 0
    assert bench_methods.build_method("ngram+eagle-adaptive:tree=8:expand=2", model, None, gamma=3, eagle_head=eagle).decoder.drafter.fallback.expand == 2
    assert bench_methods.build_method("eagle:tree=8:expand=4", model, None, gamma=3, eagle_head=eagle).decoder.drafter.expand == 4
    assert bench_methods.build_method("eagle:expand=2", model, None, gamma=3, eagle_head=eagle).decoder.drafter.expand == 0  # chains: nothing to expand
    with pytest.raises(ValueError, match="expand applies to eagle"):
        bench_methods.parse_variant("draft-model:expand=2")
    assert bench_methods.eagle_heads_needed(["plain", "draft-model"]) == 0
    assert bench_methods.eagle_heads_needed(["plain", "eagle", "auto"]) == 1
    assert bench_methods.eagle_heads_needed(["eagle", "ngram+eagle:head=3", "draft-model"]) == 3
    # The bench's default methods include exactly what generate/compare run by default.
    from verispec.drafters.combined import STREAM_GAMMA, STREAM_PATH_CONFIDENCE

    assert bench_methods.parse_variant(bench_methods.STREAM_DEFAULT_METHOD) == bench_methods.MethodVariant(
        "ngram+draft-adaptive", gamma=STREAM_GAMMA, path=STREAM_PATH_CONFIDENCE
    )
    assert bench_methods.STREAM_DEFAULT_METHOD in bench_methods.DEFAULT_METHODS
    assert bench_methods.method_spec("hf-lookup").family == "hf"
    # auto: generate's default, as its CLI builds it — the draft model below 512 prompt tokens
    # (the stream's path stop, chains), the head from there (its path stop, attention auto, trees
    # with :tree=N that end at LONG_CONTEXT_TREE_LIMIT tokens).
    from verispec.drafters.by_length import DEFAULT_LONG_PROMPT, LengthSwitchDrafter
    from verispec.drafters.eagle.drafter import EAGLE_PATH_CONFIDENCE
    from verispec.engine.decoder import LONG_CONTEXT_TREE_LIMIT

    auto = bench_methods.build_method("auto:tree=8", model, model, gamma=4, eagle_head=eagle, draft_settings=DraftModelSettings(path_confidence=0.2))
    switch = auto.decoder.drafter
    assert isinstance(switch, LengthSwitchDrafter) and switch.long_prompt_tokens == DEFAULT_LONG_PROMPT == 512
    assert (switch.short.fallback.path_confidence, switch.short.fallback.alternatives) == (STREAM_PATH_CONFIDENCE, 0)
    assert switch.long.fallback.path_confidence == EAGLE_PATH_CONFIDENCE and switch.long.fallback.far_memory.mode == "auto"
    assert switch.long.fallback.alternatives == 2 and auto.decoder.tree_rows == 8 and auto.decoder.tree_max_context == LONG_CONTEXT_TREE_LIMIT
    assert switch.long.fallback.expand == 0
    assert auto.decoder.gamma == STREAM_GAMMA and auto.decoder._gamma_controller is not None
    assert bench_methods.build_method("auto", model, model, gamma=4, eagle_head=eagle).decoder.tree_rows == 0
    assert bench_methods.build_method("ngram+eagle:tree=8", model, None, gamma=4, eagle_head=eagle).decoder.tree_max_context is None  # the others: trees at every length
    with pytest.raises(ValueError, match="method 'auto' needs an EAGLE head"):
        bench_methods.build_method("auto", model, model, gamma=4)
    assert "auto" not in bench_methods.DEFAULT_METHODS  # it needs a head


def assert_valid_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(str(path)).shape[:2]
    assert height > 100 and width > 100


def test_multi_turn_and_hf_methods_run(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    spec = spec_bench_file(tmp_path / "dev.jsonl", {"writing": 2, "rag": 1})
    args = ["--set", "spec-bench", "--spec-bench", str(spec), "--num-prompts", "3", "--multi-turn", "--methods", "ngram,hf-assisted,hf-lookup"]
    assert bench(tiny_gguf, out, *args) == 0
    results = json.loads((out / "results.json").read_text())
    # The first question of each category has two turns; "plain" is not among the methods, so an
    # untimed plain run answers turn 1.
    keys = sorted({(r["prompt_id"], r["turn"]) for r in results["rows"]})
    assert keys == [("spec-bench/1", 1), ("spec-bench/1", 2), ("spec-bench/2", 1), ("spec-bench/3", 1), ("spec-bench/3", 2)]
    turn2 = [r for r in results["rows"] if r["turn"] == 2]
    turn1 = [r for r in results["rows"] if r["prompt_id"] == "spec-bench/1" and r["turn"] == 1]
    assert turn2[0]["prompt_tokens"] > turn1[0]["prompt_tokens"] + 8  # the answer and the second user turn
    by_method = {s["method"]: s for s in results["summaries"]}
    assert by_method["hf-assisted"]["acceptance_rate"] is None and by_method["hf-assisted"]["tokens_per_call"] >= 1
    assert all(r["draft_calls"] > 0 for r in results["rows"] if r["method"] == "hf-assisted")
    # Neither plain nor hf-plain ran: no speed-up baseline, no identical-output reference.
    assert by_method["ngram"]["speedup"] == {} and by_method["ngram"]["identical"] is None
    assert_valid_png(out / "speedup_by_category.png")


def test_sampling_runs_and_skips_identical_accounting(tiny_gguf, prompts_file, tmp_path):
    out = tmp_path / "out"
    args = ["--prompts", str(prompts_file), "--methods", "plain,hf-plain", "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
    assert bench(tiny_gguf, out, *args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["identical_reference"] is None
    assert all(s["identical"] is None for s in results["summaries"])


def test_quick_preset(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    spec = spec_bench_file(tmp_path / "dev.jsonl", {"coding": 3, "qa": 2})
    assert main(["bench", "--quick", "--target", tiny_gguf, "--draft", tiny_gguf, "--spec-bench", str(spec), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["methods"] == ["plain", "draft-model", "ngram"] and settings["max_new_tokens"] == 32
    assert settings["num_prompts_per_category"] == {"humaneval": 2, "spec-bench": 1}
    assert [p["id"] for p in results["prompts"]] == ["HumanEval/0", "HumanEval/1", "spec-bench/1", "spec-bench/4"]


def test_ctrl_c_still_writes_partial_results(tiny_gguf, prompts_file, tmp_path, monkeypatch):
    real_run = bench_methods.OursMethod.run
    calls = []

    def interrupted_run(self, *args):
        calls.append(self.name)
        if len(calls) == 2 + 3:  # 2 warm-up runs, then the 3rd timed run
            raise KeyboardInterrupt
        return real_run(self, *args)

    monkeypatch.setattr(bench_methods.OursMethod, "run", interrupted_run)
    out = tmp_path / "out"
    assert bench(tiny_gguf, out, "--prompts", str(prompts_file), "--methods", "plain,ngram") == 130
    results = json.loads((out / "results.json").read_text())
    assert results["partial"] is True and "Ctrl-C" in results["stopped_by"]
    assert [(r["prompt_id"], r["method"]) for r in results["rows"]] == [("rep", "plain"), ("rep", "ngram")]
    assert "Partial results" in (out / "report.md").read_text()
    assert_valid_png(out / "speedup_by_category.png")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "plain,warp-drive"], "unknown method 'warp-drive'"),
        (["--methods", "plain,warp-drive:gamma=2"], "unknown method 'warp-drive'"),
        (["--methods", "draft-model:gamma=0"], "'draft-model:gamma=0': gamma out of range"),
        (["--methods", "draft-model:gamma=2:gamma=3"], "sets gamma twice"),
        (["--methods", "draft-model:speed=11"], "expected key=value with key one of gamma, vocab, confidence, path, tune, screen, tree, expand, dhead, dwin, prefix, cand, rule, head, attention, got 'speed=11'"),
        (["--methods", "draft-model:path=1.5"], "path out of range"),
        (["--methods", "ngram:dwin=512"], "dwin applies to draft-model, draft-model-adaptive, ngram+draft, ngram+draft-adaptive only"),
        (["--draft-window", "-1"], "--draft-window must be >= 0"),
        (["--methods", "ngram:path=0.4"], "path applies to draft-model, draft-model-adaptive, ngram+draft, ngram+draft-adaptive, eagle, eagle-adaptive, ngram+eagle, ngram+eagle-adaptive, parallel, parallel-corrected, parallel-corrected-eagle only"),
        (["--draft-path-confidence", "1"], "--draft-path-confidence must be in"),
        (["--methods", "parallel:cand=6"], "cand applies to parallel-corrected, parallel-corrected-eagle only"),
        (["--methods", "draft-model:head=2"], "head applies to eagle, eagle-adaptive, ngram+eagle, ngram+eagle-adaptive, eagle-local, eagle-fold, eagle-auto"),
        (["--methods", "eagle:head=0"], "head out of range"),
        (["--methods", "eagle,eagle:head=2"], "--methods picks EAGLE head 2 (:head=2), but --eagle-head gives 0: repeat --eagle-head PATH once per head"),
        (["--methods", "eagle,eagle:head=2", "--eagle-head", "/nonexistent/a.safetensors", "--eagle-head", "/nonexistent/b.safetensors"], "EAGLE head '/nonexistent/a.safetensors' not found"),
        (["--methods", "parallel-corrected:cand=1"], "cand out of range"),
        (["--methods", "parallel-corrected:rule=successor"], "rule applies to parallel-corrected-eagle only"),
        (["--methods", "parallel-corrected-eagle:rule=best"], "rule out of range"),
        (["--methods", "draft-model:vocab"], "got 'vocab'"),
        (["--methods", "draft-model:confidence=1"], "confidence out of range"),
        (["--methods", "draft-model:vocab=many"], "vocab must be a number, got 'many'"),
        (["--methods", "hf-assisted:gamma=3"], "gamma applies to our drafting methods only"),
        (["--methods", "plain:gamma=3"], "gamma applies to our drafting methods only"),
        (["--methods", "ngram:vocab=100"], "vocab applies to draft-model, draft-model-adaptive, ngram+draft, ngram+draft-adaptive only"),
        (["--set", "spec-bench", "--spec-bench", "/nonexistent/dev.jsonl"], "Spec-Bench file '/nonexistent/dev.jsonl' not found"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--first-prompt", "-1"], "--first-prompt must be >= 0"),
        (["--set", "humaneval,nonsense"], "--set: unknown 'nonsense'"),
        (["--set", "file"], "--set file needs --prompts"),
        (["--categories", "humaneval,poetry"], "--categories: unknown poetry"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--gamma", "0"], "--gamma"),
        (["--top-p", "2"], "top_p"),
        (["--share-prefill", "--target-kernels", "dense"], "--share-prefill needs the panel kernels' fused stack (restored prompts must be exact), not --target-kernels dense"),
    ],
)
def test_bad_arguments_are_clear_errors(tiny_gguf, tmp_path, capsys, extra, message):
    assert main(["bench", "--target", tiny_gguf, "--set", "humaneval", "--out", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    assert "verispec bench: error:" in err and message in err and "Traceback" not in err


def test_malformed_prompts_line_names_the_line(tiny_gguf, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n{"prompt": "broken"\n')
    assert main(["bench", "--target", tiny_gguf, "--prompts", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "line 3: not valid JSON" in err and "Traceback" not in err


# --- prompt sets -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('["a list"]', "line 2: expected a JSON object"),
        ('{"id": "x"}', "line 2: expected exactly one of 'prompt'"),
        ('{"prompt": "a", "turns": ["b"]}', "line 2: expected exactly one of 'prompt'"),
        ('{"prompt": 5}', "line 2: 'prompt' must hold non-empty strings"),
        ('{"turns": []}', "line 2: 'turns' must be a non-empty list"),
        ('{"turns": "not a list"}', "line 2: 'turns' must be a non-empty list"),
        ('{"prompt": "x", "category": ""}', "line 2: 'category' must be a non-empty string"),
        ('{"id": "a", "prompt": "again"}', "prompt id 'a' appears more than once"),
    ],
)
def test_prompts_file_errors(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        prompts_from_file(path)


def test_prompts_file_defaults_and_turns(prompts_file):
    prompts = prompts_from_file(prompts_file)
    assert prompts[0] == Prompt("rep", "code", "the hello the hello the hello")
    assert prompts[1].turns == ("hello the", "the the hello") and prompts[1].follow_ups == ("the the hello",)
    assert (prompts[2].id, prompts[2].category) == ("line-3", "user")


def test_spec_bench_loading_and_selection(tmp_path):
    path = spec_bench_file(tmp_path / "dev.jsonl", {"writing": 3, "qa": 2, "rag": 1})
    prompts = spec_bench_prompts(path)
    assert [p.category for p in prompts] == ["writing"] * 3 + ["qa"] * 2 + ["rag"]
    assert prompts[0].id == "spec-bench/1" and prompts[0].follow_ups == ("the hello again",)
    assert [p.id for p in first_per_category(prompts, 1)] == ["spec-bench/1", "spec-bench/4", "spec-bench/6"]
    assert first_per_category(prompts, None) == prompts
    # skip: a dev range past the prompts the default runs use (a category shorter than skip gives none)
    assert [p.id for p in first_per_category(prompts, 1, skip=1)] == ["spec-bench/2", "spec-bench/5"]
    assert [p.id for p in first_per_category(prompts, None, skip=2)] == ["spec-bench/3"]
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": ["x"]}\n')
    with pytest.raises(ValueError, match="line 1: missing 'category'"):
        spec_bench_prompts(tmp_path / "bad.jsonl")


def test_spec_bench_dev_split_if_present():
    path = REPO / "../shared/data/spec_bench/dev.jsonl"
    if not path.is_file():
        pytest.skip("the Spec-Bench dev split is not next to the repository")
    prompts = spec_bench_prompts(path)
    counts = {c: sum(p.category == c for p in prompts) for c in dict.fromkeys(p.category for p in prompts)}
    mt_bench = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    assert counts == {**{c: 10 for c in mt_bench}, **{c: 40 for c in ["translation", "summarization", "qa", "math_reasoning", "rag"]}}
    assert all(len(p.turns) == 2 for p in prompts if p.category in mt_bench)


# --- runner ------------------------------------------------------------------------------------


class CharTokenizer:
    """A stand-in tokenizer: one id per character, a visible chat template."""

    chat_template = "roles"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class RecordingMethod:
    """Answers with a fixed text and records (method, prompt text, max_new_tokens) for each call."""

    def __init__(self, name, log, answer="ok"):
        self.name, self.log, self.answer = name, log, answer

    def run(self, input_ids, max_new_tokens, sampling):
        self.log.append((self.name, "".join(map(chr, input_ids)), max_new_tokens))
        return RunOutput(token_ids=[ord(c) for c in self.answer], seconds=0.01, target_calls=len(self.answer), draft_calls=None)

    def forget(self):
        self.log.append((self.name, "forget", 0))


def test_runner_interleaves_methods_prompt_by_prompt():
    log = []
    methods = {name: RecordingMethod(name, log) for name in ["a", "b", "c"]}
    prompts = [Prompt("p1", "x", "one"), Prompt("p2", "x", "two")]
    run = run_bench(prompts, methods, BenchSettings(max_new_tokens=16, sampling=SamplingParams()), CharTokenizer())
    assert run.complete
    # Every method's warm-up, then every method forgets it (stored prefixes): the timed run of that
    # prompt starts cold, and methods sharing a prefix cache prefilled the warm-up prompt once.
    warmup = [(m, "<user>one<assistant>", WARMUP_TOKENS) for m in ["a", "b", "c"]] + [(m, "forget", 0) for m in ["a", "b", "c"]]
    timed = [(m, f"<user>{p}<assistant>", 16) for p in ["one", "two"] for m in ["a", "b", "c"]]
    assert log == warmup + timed
    assert [(r.prompt_id, r.method) for r in run.rows] == [(p, m) for p in ["p1", "p2"] for m in ["a", "b", "c"]]
    # A long first prompt: the warm-up reads only its first WARMUP_PROMPT_TOKENS tokens, the timed run all of it.
    log.clear()
    long_text = "y" * (2 * WARMUP_PROMPT_TOKENS)
    run_bench([Prompt("long", "x", long_text)], {"a": methods["a"]}, BenchSettings(max_new_tokens=4, sampling=SamplingParams()), CharTokenizer())
    assert [len(text) for _, text, _ in log if text != "forget"] == [WARMUP_PROMPT_TOKENS, len(f"<user>{long_text}<assistant>")]
    assert set(run.peak_rss) == {"a", "b", "c"}


def test_runner_multi_turn_puts_plains_answer_in_the_conversation():
    log = []
    methods = {"plain": RecordingMethod("plain", log, answer="PLAIN"), "fast": RecordingMethod("fast", log, answer="FAST")}
    prompts = [Prompt("p", "x", "first", follow_ups=("second",)), Prompt("q", "x", "only")]
    settings = BenchSettings(max_new_tokens=4, sampling=SamplingParams(), multi_turn=True, warmup=False)
    run = run_bench(prompts, methods, settings, CharTokenizer())
    turn2 = "<user>first<assistant>PLAIN<user>second<assistant>"
    assert [entry[:2] for entry in log] == [
        ("plain", "<user>first<assistant>"), ("fast", "<user>first<assistant>"),
        ("plain", turn2), ("fast", turn2),
        ("plain", "<user>only<assistant>"), ("fast", "<user>only<assistant>"),
    ]  # fmt: skip
    assert [(r.label, r.method) for r in run.rows][2:4] == [("p (turn 2)", "plain"), ("p (turn 2)", "fast")]


def test_runner_keeps_rows_when_a_method_fails():
    log = []

    class Failing(RecordingMethod):
        def run(self, input_ids, max_new_tokens, sampling):
            if len(log) >= 3:
                raise RuntimeError("out of cheese")
            return super().run(input_ids, max_new_tokens, sampling)

    methods = {"a": Failing("a", log), "b": Failing("b", log)}
    prompts = [Prompt("p1", "x", "one"), Prompt("p2", "x", "two")]
    run = run_bench(prompts, methods, BenchSettings(max_new_tokens=4, sampling=SamplingParams(), warmup=False), CharTokenizer())
    assert not run.complete and "out of cheese" in run.stopped_by and isinstance(run.error, RuntimeError)
    assert [(r.prompt_id, r.method) for r in run.rows] == [("p1", "a"), ("p1", "b"), ("p2", "a")]


# --- summary math ------------------------------------------------------------------------------


def row(prompt, method, new_tokens, seconds, category="x", tokens=None, drafted=None, accepted=None, calls=None):
    return Row(
        prompt_id=prompt, category=category, turn=1, method=method, prompt_tokens=10, new_tokens=new_tokens,
        seconds=seconds, target_calls=calls if calls is not None else new_tokens, draft_calls=None,
        drafted_per_round=drafted, accepted_per_round=accepted, token_ids=tokens if tokens is not None else [1] * new_tokens,
    )  # fmt: skip


def test_speedup_is_the_per_prompt_throughput_ratio_then_median_and_mean():
    rows = [
        # plain: 10, 20, 40 tok/s; spec: 20, 20, 100 tok/s -> ratios 2, 1, 2.5 (lengths differ: throughput, not time)
        row("p1", "plain", 10, 1.0, "a"), row("p1", "spec", 20, 1.0, "a"),
        row("p2", "plain", 20, 1.0, "a"), row("p2", "spec", 10, 0.5, "a"),
        row("p3", "plain", 40, 1.0, "b"), row("p3", "spec", 50, 0.5, "b"),
        # hf-plain: 20, 20, 20 tok/s -> spec ratios 1, 1, 5
        row("p1", "hf-plain", 20, 1.0, "a"), row("p2", "hf-plain", 20, 1.0, "a"), row("p3", "hf-plain", 20, 1.0, "b"),
        row("p4", "spec", 10, 1.0, "b"),  # no baseline on p4: left out of ratios
    ]  # fmt: skip
    value = speedup(rows, "spec", "plain")
    assert (value.median, value.mean, value.prompts) == (pytest.approx(2.0), pytest.approx(5.5 / 3), 3)
    summaries = {s.method: s for s in summarize(rows, ["plain", "spec", "hf-plain"], greedy=True)}
    spec = summaries["spec"]
    assert spec.speedup["plain"].median == pytest.approx(2.0) and spec.speedup["plain"].mean == pytest.approx(5.5 / 3)
    assert spec.speedup["hf-plain"].median == pytest.approx(1.0) and spec.speedup["hf-plain"].mean == pytest.approx(7 / 3)
    assert spec.tokens_per_second == pytest.approx(90 / 3.0)  # pooled: all tokens / all seconds
    assert spec.by_category["a"].speedup["plain"].median == pytest.approx(statistics.median([2, 1]))
    assert spec.by_category["b"].speedup["plain"].median == pytest.approx(2.5) and spec.by_category["b"].runs == 2
    assert summaries["plain"].speedup["hf-plain"].median == pytest.approx(1.0)
    assert speedup(rows, "spec", "missing") is None


def test_alpha_tau_and_acceptance_by_position_pool_all_rounds():
    rows = [
        row("p1", "spec", 7, 1.0, drafted=[4, 4], accepted=[4, 1], calls=2),
        row("p2", "spec", 3, 1.0, drafted=[2, 0], accepted=[1, 0], calls=2),
        row("p1", "hf", 7, 1.0, calls=3),  # Hugging Face: rounds not observed
    ]
    spec, hf = summarize(rows, ["spec", "hf"], greedy=True)
    assert spec.acceptance_rate == pytest.approx(6 / 10) and spec.tokens_per_call == pytest.approx(10 / 4)
    # Rounds drafted [4, 4, 2, 0], accepted [4, 1, 1, 0]. Position 1: proposed in 3 rounds, accepted in 3;
    # position 2: proposed 3, accepted 1; positions 3 and 4: proposed 2, accepted 1.
    assert spec.acceptance_by_position == pytest.approx([1.0, 1 / 3, 0.5, 0.5])
    assert hf.acceptance_rate is None and hf.acceptance_by_position is None and hf.tokens_per_call == pytest.approx(7 / 3)


def test_identical_output_accounting():
    rows = [
        row("p1", "plain", 3, 1.0, tokens=[1, 2, 3]), row("p1", "spec", 3, 1.0, tokens=[1, 2, 3]),
        row("p2", "plain", 3, 1.0, tokens=[1, 2, 3]), row("p2", "spec", 3, 1.0, tokens=[1, 9, 3]),
        row("p3", "plain", 3, 1.0, tokens=[1, 2, 3]), row("p3", "spec", 2, 1.0, tokens=[1, 2]),
    ]  # fmt: skip
    summaries = {s.method: s for s in summarize(rows, ["plain", "spec"], greedy=True)}
    identical = summaries["spec"].identical
    assert (identical.reference, identical.count, identical.compared) == ("plain", 1, 3)
    assert identical.differences == [{"prompt": "p2", "first_difference": 1}, {"prompt": "p3", "first_difference": 2}]
    assert summaries["plain"].identical is None  # the reference itself
    assert all(s.identical is None for s in summarize(rows, ["plain", "spec"], greedy=False))
    assert first_difference([1, 2], [1, 2]) is None and first_difference([], [5]) == 0


def test_categories_report_tau_alpha_and_the_speedup_of_decoding_after_the_prefill():
    from dataclasses import replace

    from verispec.bench.report import category_detail_table

    rows = [
        # Long prompt: 8 s of prefill in both runs; decoding 10 tokens takes 2 s plain, 1 s spec.
        replace(row("p1", "plain", 10, 10.0, "long-8192"), prefill_seconds=8.0),
        replace(row("p1", "spec", 10, 9.0, "long-8192", drafted=[3, 3], accepted=[3, 1], calls=4), prefill_seconds=8.0),
        row("p2", "plain", 10, 1.0, "long-512"),  # no prefill time known (as for Hugging Face): no decode ratio
        row("p2", "spec", 10, 0.5, "long-512", drafted=[4], accepted=[0], calls=10),
    ]  # fmt: skip
    spec = {s.method: s for s in summarize(rows, ["plain", "spec"], greedy=True)}["spec"]
    long = spec.by_category["long-8192"]
    assert long.speedup["plain"].median == pytest.approx(10 / 9)  # wall-clock: the prefill hides the gain
    assert long.decode_speedup["plain"].median == pytest.approx(2.0)
    assert (long.tokens_per_call, long.acceptance_rate) == (pytest.approx(2.5), pytest.approx(4 / 6))
    assert spec.by_category["long-512"].decode_speedup == {} and spec.by_category["long-512"].acceptance_rate == 0.0
    header, table = category_detail_table(list(summarize(rows, ["plain", "spec"], greedy=True)), "plain")
    assert header == ["category", "plain", "spec"]
    assert table[0] == ["long-8192", "τ 1.00 α - decode 1.00x", "τ 2.50 α 0.67 decode 2.00x"]


def test_peak_rss_growth_is_signed():
    from verispec.bench.report import _rss_cell

    assert _rss_cell(3 * 2**30, 3 * 2**30 - 5 * 2**20) == "3.00 GiB (+5 MiB)"
    assert _rss_cell(3 * 2**30, 3 * 2**30 + 140 * 2**20) == "3.00 GiB (-140 MiB)"  # was "+-140 MiB"
    assert _rss_cell(None, 1) == "n/a" and _rss_cell(2**30, None) == "1.00 GiB"


def test_time_split_sums_the_engine_timers_and_prices_a_pass():
    from dataclasses import replace

    from verispec.bench.report import time_split_table

    rows = [
        replace(row("p1", "spec", 10, 4.0, calls=4), prefill_seconds=1.0, draft_seconds=0.5, verify_seconds=2.0, draft_calls=5),
        replace(row("p2", "spec", 10, 2.0, calls=2), prefill_seconds=0.5, draft_seconds=0.5, verify_seconds=0.9, draft_calls=5,
                branches_verified=7, branches_accepted=2, reused_prompt_tokens=4),
        row("p1", "hf-plain", 10, 3.0),  # Hugging Face: no timers
    ]  # fmt: skip
    summaries = summarize(rows, ["spec", "hf-plain"], greedy=False)
    split = summaries[0].time_split
    assert (split.prefill, split.draft, split.verify, split.other) == (pytest.approx(1.5), 1.0, pytest.approx(2.9), pytest.approx(0.6))
    assert (split.target_calls, split.draft_calls, summaries[1].time_split) == (6, 10, None)
    header, table = time_split_table(summaries)
    prompt_tokens = sum(r.prompt_tokens for r in rows[:2])
    assert table == [["spec", "25% (1.5s)", "17% (1.0s)", "48% (2.9s)", "10% (0.6s)", "483", "100.0", "2 / 7", f"{4 / prompt_tokens:.0%} (4)"]]  # HF left out
    assert header[-4:] == ["ms / verify pass", "ms / draft pass", "branches kept", "prompt reused"]


def test_raw_prompts_skip_the_chat_template(tiny_gguf, prompts_file, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(tiny_gguf).parent), gguf_file=Path(tiny_gguf).name)
    runs = {}
    for label, extra in (("chat", []), ("raw", ["--raw"])):
        out = tmp_path / label
        assert bench(tiny_gguf, out, "--prompts", str(prompts_file), "--methods", "plain", *extra) == 0
        runs[label] = json.loads((out / "results.json").read_text())
    assert runs["raw"]["settings"]["raw"] is True and runs["chat"]["settings"]["raw"] is False
    raw_lengths = [row["prompt_tokens"] for row in runs["raw"]["rows"]]
    assert raw_lengths == [len(tokenizer("the hello the hello the hello")["input_ids"]), len(tokenizer("hello the")["input_ids"]), len(tokenizer("hello hello the")["input_ids"])]
    assert all(chat > raw for chat, raw in zip([row["prompt_tokens"] for row in runs["chat"]["rows"]], raw_lengths))  # the template adds tokens
    assert bench(tiny_gguf, tmp_path / "x", "--prompts", str(prompts_file), "--raw", "--multi-turn") == 2
    assert "--raw" in capsys.readouterr().err
