"""PNG plots of a benchmark: speed-up per category per method, acceptance by draft position.

Uses matplotlib's object API on the Agg canvas (no pyplot): no display, no global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from verispec.bench.summary import MethodSummary

SPEEDUP_PNG = "speedup_by_category.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"


def write_plots(summaries: Sequence[MethodSummary], baseline: str | None, out_dir: Path) -> list[str]:
    """Write both plots into ``out_dir``; return their file names."""
    _speedup_by_category(summaries, baseline, out_dir / SPEEDUP_PNG)
    _acceptance_by_position(summaries, out_dir / ACCEPTANCE_PNG)
    return [SPEEDUP_PNG, ACCEPTANCE_PNG]


def _figure(width: float, height: float):  # noqa: ANN202 - a matplotlib Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _speedup_by_category(summaries: Sequence[MethodSummary], baseline: str | None, path: Path) -> None:
    """Grouped bars: x = category (and "all"), one bar per method; median speed-up over ``baseline``.

    Without a baseline in the run the bars are plain tokens/s.
    """
    methods = [s for s in summaries if s.method != baseline]
    categories = list(dict.fromkeys(c for s in summaries for c in s.by_category)) + ["all"]
    figure = _figure(max(7.0, 0.9 * len(categories) + 3), 4.5)
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(methods))
    for index, summary in enumerate(methods):
        heights = [_category_value(summary, category, baseline) for category in categories]
        positions = [i - 0.4 + width * (index + 0.5) for i in range(len(categories))]
        axes.bar(positions, heights, width, label=summary.method)
    axes.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    if baseline is not None:
        axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        axes.set_ylabel(f"median speed-up vs {baseline}")
    else:
        axes.set_ylabel("tokens/s")
    if not methods:
        axes.text(0.5, 0.5, "only the baseline ran", transform=axes.transAxes, ha="center")
    else:
        figure.legend(loc="outside right upper", fontsize="small")  # beside the axes: never over the bars
    axes.set_title("Speed-up per category")
    figure.savefig(path, dpi=100)


def _category_value(summary: MethodSummary, category: str, baseline: str | None) -> float:
    if category == "all":
        value = summary.speedup.get(baseline) if baseline else None
        return value.median if value else (0.0 if baseline else summary.tokens_per_second)
    entry = summary.by_category.get(category)
    if entry is None:
        return 0.0
    if baseline is None:
        return entry.tokens_per_second
    value = entry.speedup.get(baseline)
    return value.median if value else 0.0


def _acceptance_by_position(summaries: Sequence[MethodSummary], path: Path) -> None:
    figure = _figure(7.0, 4.0)
    axes = figure.add_subplot()
    drafting = [s for s in summaries if s.acceptance_by_position]
    for summary in drafting:
        rates = summary.acceptance_by_position
        axes.plot(range(1, len(rates) + 1), rates, marker="o", label=summary.method)
    if drafting:
        figure.legend(loc="outside right upper", fontsize="small")
        axes.set_xticks(range(1, max(len(s.acceptance_by_position) for s in drafting) + 1))
    else:
        axes.text(0.5, 0.5, "no method drafted tokens we can observe", transform=axes.transAxes, ha="center")
    axes.set_ylim(0, 1.05)
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate")
    axes.set_title("Acceptance by draft position")
    figure.savefig(path, dpi=100)
