"""Plots of an evaluation report: τ per task, conditional acceptance per position, the threshold sweep."""

from __future__ import annotations

from pathlib import Path


def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def plot_report(report: dict, output_dir: str | Path) -> list[Path]:
    """Writes tau_per_task.png, conditional_acceptance.png and (if swept) threshold_sweep.png; returns the paths."""
    output_dir = Path(output_dir)
    paths = []
    results = report["results"]
    drafters = list(results)
    tasks = list(next(iter(results[drafters[0]].values())))

    figure = _figure()
    axes = figure.add_subplot()
    series = [(name, temperature) for name in drafters for temperature in results[name]]
    width = 0.8 / len(series)
    for k, (name, temperature) in enumerate(series):
        values = [results[name][temperature][t]["tau"] or 0 for t in tasks]
        axes.bar([x + k * width for x in range(len(tasks))], values, width, label=f"{name} {temperature}")
    axes.set_xticks([x + 0.4 - width / 2 for x in range(len(tasks))], tasks)
    axes.set_ylabel("τ (accepted tokens per round, bonus included)")
    axes.legend(fontsize=8)
    paths.append(output_dir / "tau_per_task.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")

    temperatures = list(results[drafters[0]])
    figure = _figure(5 * len(temperatures), 4)
    styles = ["-", "--", ":", "-."]
    for column, temperature in enumerate(temperatures):
        axes = figure.add_subplot(1, len(temperatures), column + 1)
        for color, name in enumerate(drafters):
            for style, task in enumerate(tasks):
                values = results[name][temperature][task]["conditional_acceptance"]
                axes.plot(range(1, len(values) + 1), [v if v is not None else float("nan") for v in values],
                          marker="o", color=f"C{color}", linestyle=styles[style % len(styles)], label=f"{name} {task}")
        axes.set_title(f"temperature {temperature[1:]}")
        axes.set_xlabel("draft position k")
        axes.set_ylabel("P(draft k accepted | drafts < k accepted)")
        axes.set_ylim(0, 1.05)
        axes.legend(fontsize=7)
    paths.append(output_dir / "conditional_acceptance.png")
    figure.savefig(paths[-1], dpi=120, bbox_inches="tight")

    if report.get("threshold_sweep"):
        figure = _figure(10, 4)
        rate_axes, tau_axes = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
        for name, per_task in report["threshold_sweep"].items():
            for task, points in per_task.items():
                thresholds = [p["threshold"] for p in points]
                rate_axes.plot(thresholds, [p["acceptance_rate"] for p in points], marker="o", label=f"{name} {task}")
                tau_axes.plot(thresholds, [p["tau"] for p in points], marker="o", label=f"{name} {task}")
        rate_axes.set_xlabel("static confidence threshold")
        rate_axes.set_ylabel("acceptance rate of verified drafts")
        tau_axes.set_xlabel("static confidence threshold")
        tau_axes.set_ylabel("τ")
        rate_axes.legend(fontsize=7)
        paths.append(output_dir / "threshold_sweep.png")
        figure.savefig(paths[-1], dpi=120, bbox_inches="tight")
    return paths
