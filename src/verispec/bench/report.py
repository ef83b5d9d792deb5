"""Write a benchmark's results: the terminal table, ``results.json`` and ``report.md``."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verispec.bench.runner import BenchRun, Row
from verispec.bench.summary import CategorySummary, MethodSummary, SpeedUp

RSS_NOTE = (
    "Peak RSS is the whole process's resident memory, sampled every 20 ms while the method ran: it "
    "includes the loaded target and draft models (and allocator caches left by earlier runs); "
    "differences between methods show their extra working memory."
)
# bench --share-prefill: every method after the first restores each prompt instead of prefilling it.
SHARED_PREFILL_NOTE = (
    "**Prefill shared (--share-prefill):** the first method to run a prompt prefilled it, the others restored "
    "its keys, values and features (the same tokens): compare the decode speed-ups (prefill excluded); "
    "the wall-clock ones favour every method after the first."
)
SPEEDUP_NOTE = (
    "Every method ran on a prompt, in the order listed, before the next prompt started, so machine noise "
    "hit all methods alike. Speed-up: for each prompt, the method's tokens/s over the baseline's tokens/s on the same prompt "
    "(wall-clock, prefill included), then the median (and mean) over prompts. tok/s: all new tokens / "
    "all seconds. alpha: accepted / drafted tokens; tau: new tokens per target forward call (our "
    "separate prefill pass excluded; Hugging Face has none: its first call reads the prompt and emits a "
    "token); both pooled over all rounds. Hugging Face methods do not expose their rounds: alpha n/a."
)

TIME_SPLIT_NOTE = (
    "The engine's own timers, summed over every run of the method: the target's prompt prefill, drafting "
    "(the drafter's own pass over the prompt and its catch-up on the tokens last committed included), verification (target passes over the "
    "drafts, acceptance, cache crops) and the rest. ms / verify pass: verification seconds per target call; "
    "ms / draft pass: drafting seconds per drafter forward pass (prompt lookup makes none). "
    "branches kept: rounds that emitted a runner-up token of a one-level draft tree / runner-ups verified."
)


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    import verispec

    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": _memory_total(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "verispec": verispec.__version__,
    }


def results_payload(
    run: BenchRun,
    summaries: Sequence[MethodSummary],
    *,
    settings: dict[str, Any],
    machine: dict[str, Any],
    command: str,
    started: str,
    elapsed_s: float,
    prompts: list[dict[str, Any]],
    reference: str | None,
) -> dict[str, Any]:
    return {
        "partial": not run.complete,
        "stopped_by": run.stopped_by,
        "command": command,
        "started": started,
        "elapsed_s": elapsed_s,
        "settings": settings,
        "machine": machine,
        "identical_reference": reference,
        "prompts": prompts,
        "memory": {"rss_before_bytes": run.rss_before, "peak_rss_bytes": run.peak_rss, "note": RSS_NOTE},
        "summaries": [asdict(s) for s in summaries],
        "rows": [asdict(row) | {"tokens_per_second": row.tokens_per_second} for row in run.rows],
    }


def write_json(payload: dict[str, Any], path: Path) -> None:
    """Write atomically: a run interrupted mid-write never leaves a truncated file."""
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)


def summary_table(
    summaries: Sequence[MethodSummary], reference: str | None = None, rss_before: int | None = None
) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the main table; the terminal and Markdown render the same cells.

    ``reference``: the method whose greedy output the "identical" column compares with;
    ``rss_before``: the process's RSS before the first run, to show each peak's growth over it.
    """
    baselines = list(dict.fromkeys(b for s in summaries for b in s.speedup))
    header = ["method", "runs", "tok/s", *[f"vs {b} median (mean)" for b in baselines], "alpha", "tau", "identical", "peak RSS"]
    rows = []
    for s in summaries:
        cells = [s.method, str(s.runs), f"{s.tokens_per_second:.2f}"]
        cells += [_speedup_cell(s.speedup.get(b)) for b in baselines]
        cells += [_number(s.acceptance_rate, ".3f"), _number(s.tokens_per_call, ".2f"), _identical_cell(s, reference), _rss_cell(s.peak_rss, rss_before)]
        rows.append(cells)
    return header, rows


def category_table(summaries: Sequence[MethodSummary], baseline: str) -> tuple[list[str], list[list[str]]]:
    """Median speed-up over ``baseline`` per category (rows) and method (columns)."""
    methods = [s for s in summaries if s.method != baseline]
    rows = _category_rows(summaries, methods, lambda entry: _speedup_cell(entry.speedup.get(baseline) if entry else None, mean=False))
    rows.append(["all", *[_speedup_cell(s.speedup.get(baseline), mean=False) for s in methods]])
    return ["category", *[s.method for s in methods]], rows


def category_detail_table(summaries: Sequence[MethodSummary], baseline: str) -> tuple[list[str], list[list[str]]]:
    """Per category and method: tau, alpha and the median speed-up of decoding after the prefill over ``baseline``.

    Long prompts need it: their prefill (the same for every method) dominates the wall-clock.
    """

    def cell(entry: CategorySummary | None) -> str:
        if entry is None:
            return "-"
        tau = "-" if entry.tokens_per_call is None else f"{entry.tokens_per_call:.2f}"
        alpha = "-" if entry.acceptance_rate is None else f"{entry.acceptance_rate:.2f}"
        return f"τ {tau} α {alpha} decode {_speedup_cell(entry.decode_speedup.get(baseline), mean=False)}"

    return ["category", *[s.method for s in summaries]], _category_rows(summaries, summaries, cell)


def time_split_table(summaries: Sequence[MethodSummary]) -> tuple[list[str], list[list[str]]]:
    """Where each of our methods' wall-clock went (share and seconds over all runs), and the mean
    cost of one verification pass and of one drafter pass: what to work on next, per method."""
    header = ["method", "prefill", "draft", "verify", "other", "ms / verify pass", "ms / draft pass", "branches kept", "prompt reused"]
    rows = []
    for s in summaries:
        split = s.time_split
        if split is None or split.total <= 0:
            continue
        shares = [f"{part / split.total:.0%} ({part:.1f}s)" for part in (split.prefill, split.draft, split.verify, split.other)]
        per_verify = f"{1000 * split.verify / split.target_calls:.0f}" if split.target_calls else "-"
        per_draft = f"{1000 * split.draft / split.draft_calls:.1f}" if split.draft_calls else "-"
        branches = f"{split.branches_accepted} / {split.branches_verified}" if split.branches_verified else "-"
        reused = f"{split.reused_prompt_tokens / split.prompt_tokens:.0%} ({split.reused_prompt_tokens})" if split.reused_prompt_tokens else "-"
        rows.append([s.method, *shares, per_verify, per_draft, branches, reused])
    return header, rows


def _category_rows(
    summaries: Sequence[MethodSummary], methods: Sequence[MethodSummary], cell: Callable[[CategorySummary | None], str]
) -> list[list[str]]:
    """One row per category (in order of appearance): the category, then ``cell`` of each method's entry."""
    categories = list(dict.fromkeys(c for s in summaries for c in s.by_category))
    return [[category, *[cell(s.by_category.get(category)) for s in methods]] for category in categories]


def terminal_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def turn_line(rows: Sequence[Row]) -> str:
    """One line per finished prompt turn: every method's tok/s, and its ratio to the first method's."""
    first = rows[0]
    parts = []
    for row in rows:
        part = f"{row.method} {row.tokens_per_second:.2f} tok/s"
        if row is not first and first.tokens_per_second > 0:
            part += f" ({row.tokens_per_second / first.tokens_per_second:.2f}x)"
        parts.append(part)
    return f"{first.label} [{first.category}]: " + " | ".join(parts)


def markdown_report(payload: dict[str, Any], summaries: Sequence[MethodSummary], plots: Sequence[str]) -> str:
    """The report: main table, per-category table, acceptance by position, differences, settings, machine."""
    out = ["# verispec bench", ""]
    if payload["partial"]:
        done = len({(r["prompt_id"], r["turn"]) for r in payload["rows"]})
        out += [f"**Partial results** ({payload['stopped_by']}): {len(payload['rows'])} runs on {done} prompt turns.", ""]
    out += [f"Started {payload['started']}, {payload['elapsed_s'] / 60:.1f} min. Command:", "", "```", payload["command"], "```", ""]
    out += ["## Results", ""]
    if summaries:
        table = summary_table(summaries, payload["identical_reference"], payload["memory"]["rss_before_bytes"])
        warmup = " Each method first ran once briefly, untimed (warm-up)." if payload["settings"].get("warmup") else ""
        shared = f" {SHARED_PREFILL_NOTE}" if payload["settings"].get("share_prefill") else ""
        out += [markdown_table(*table), "", SPEEDUP_NOTE + warmup + shared, ""]
    else:
        out += ["No run finished.", ""]
    baseline = next((b for b in ("plain", "hf-plain") if any(b in s.speedup for s in summaries)), None)
    if baseline is not None and len(summaries) > 1:
        out += [f"## Speed-up by category (median over prompts, vs {baseline})", ""]
        out += [markdown_table(*category_table(summaries, baseline)), ""]
        out += [f"## τ, α and decode speed-up (prefill excluded, median vs {baseline}) by category", ""]
        out += [markdown_table(*category_detail_table(summaries, baseline)), ""]
    split_header, split_rows = time_split_table(summaries)
    if split_rows:
        out += ["## Where the time went (our methods, all runs)", "", TIME_SPLIT_NOTE, ""]
        out += [markdown_table(split_header, split_rows), ""]
    positions = [s for s in summaries if s.acceptance_by_position]
    if positions:
        longest = max(len(s.acceptance_by_position) for s in positions)
        header = ["method", *[str(i + 1) for i in range(longest)]]
        rows = [[s.method, *[f"{r:.2f}" for r in s.acceptance_by_position], *[""] * (longest - len(s.acceptance_by_position))] for s in positions]
        out += ["## Acceptance by draft position", "", "Share of rounds that accepted draft position i among rounds that proposed it.", ""]
        out += [markdown_table(header, rows), ""]
    differing = [s for s in summaries if s.identical is not None and s.identical.differences]
    if differing:
        out += [f"## Outputs that differ from {differing[0].identical.reference}", ""]
        for s in differing:
            where = ", ".join(f"{d['prompt']} (token {d['first_difference']})" for d in s.identical.differences)
            out.append(f"- {s.method}: {len(s.identical.differences)}/{s.identical.compared}: {where}")
        out.append("")
    if plots:
        out += ["## Plots", ""] + [f"![{name}]({name})" for name in plots] + [""]
    out += ["## Settings", ""] + [f"- {key}: {_plain(value)}" for key, value in payload["settings"].items()] + [""]
    out += ["## Machine", ""] + [f"- {key}: {_plain(value)}" for key, value in payload["machine"].items()] + [""]
    rss_before = payload["memory"]["rss_before_bytes"]
    before = f" Before the first run (models loaded): {_gib(rss_before)}; the table shows each peak's growth over it." if rss_before else ""
    out += ["## Memory", "", RSS_NOTE + before, ""]
    return "\n".join(out)


def _plain(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k} {v if v is not None else 'all'}" for k, v in value.items())
    return "-" if value is None else str(value)


def _speedup_cell(value: SpeedUp | None, mean: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value.median:.2f}x ({value.mean:.2f}x)" if mean else f"{value.median:.2f}x"


def _identical_cell(summary: MethodSummary, reference: str | None) -> str:
    if summary.method == reference:
        return "reference"
    if summary.identical is None:
        return "n/a"
    return f"{summary.identical.count}/{summary.identical.compared}"


def _rss_cell(peak: int | None, before: int | None) -> str:
    if peak is None:
        return "n/a"
    # Signed: the peak can sit below the RSS before the first run (memory freed after loading).
    growth = f" ({(peak - before) / 2**20:+.0f} MiB)" if before is not None else ""
    return _gib(peak) + growth


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
