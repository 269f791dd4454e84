"""PNG charts (matplotlib; skipped with a message when it is missing)."""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from typing import Callable, Sequence

from .configs import PROBLEM_NAMES
from .report import split_sweep

IMPL_COLORS = OrderedDict([("ours", "#1f77b4"), ("eager", "#ff7f0e"), ("compile", "#2ca02c")])


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _log_if_wide(ax, values: Sequence[float]) -> None:
    vals = [v for v in values if v and v > 0]
    if vals and max(vals) / min(vals) > 20:
        ax.set_yscale("log")


def draw(out_dir: str, env: dict, results, softmax, copy,
         log: Callable[[str], None]) -> list[str]:
    """Write the charts into ``out_dir``; returns their paths ([] without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        log("matplotlib is not installed: no chart drawn (pip install matplotlib)")
        return []
    paths = []
    main, sweep = split_sweep(results)
    for name, fn, data in (("bench.png", _bars, main), ("bench-sweep.png", _sweep, sweep),
                           ("softmax.png", _softmax, softmax)):
        if not data:
            continue
        try:
            fig = fn(plt, env, data, copy)
            path = os.path.join(out_dir, name)
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
        except Exception as e:  # noqa: BLE001 -- a chart must never lose the numbers
            log(f"chart {name} failed: {type(e).__name__}: {e}")
    return paths


def _title(env: dict, what: str) -> str:
    return f"{what} -- {env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}"


def _bars(plt, env, results, copy):
    """Grouped bars: one panel per problem shape, bars ours/eager/compile per dtype x mode."""
    groups: "OrderedDict[tuple, list]" = OrderedDict()
    for r in results:
        if not r.case.skip:
            groups.setdefault((r.case.shape.problem, str(r.case.shape)), []).append(r)
    n = len(groups)
    fig, axes = plt.subplots(n, 1, figsize=(max(8, 1.3 * max(len(g) for g in groups.values())),
                                            3.6 * n), squeeze=False)
    width = 0.27
    for ax, ((problem, shape), rs) in zip(axes[:, 0], groups.items()):
        labels = [f"{r.case.spec.name}\n{r.case.mode}" for r in rs]
        allv = []
        for j, (impl, color) in enumerate(IMPL_COLORS.items()):
            xs = [i + (j - 1) * width for i in range(len(rs))]
            vals = [r.ms(impl) or 0.0 for r in rs]
            allv += vals
            ax.bar(xs, vals, width, label=impl, color=color)
            for x, r in zip(xs, rs):
                if r.ms(impl) is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("ms per forward")
        ax.set_title(f"problem {problem} ({PROBLEM_NAMES[problem]}), {shape}", fontsize=10)
        _log_if_wide(ax, allv)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(env, "epifuse: time per forward (lower is better)"), fontsize=10)
    fig.tight_layout()
    return fig


def _sweep(plt, env, results, copy):
    """Time vs M (log-log), one panel per mode, one colour per impl, one marker per dtype."""
    modes = list(OrderedDict.fromkeys(r.case.mode for r in results))
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    markers = ["o", "s", "^", "D", "v"]
    for ax, mode in zip(axes[0], modes):
        rs = [r for r in results if r.case.mode == mode and not r.case.skip]
        dtypes = list(OrderedDict.fromkeys(r.case.spec.name for r in rs))
        for impl, color in IMPL_COLORS.items():
            for d, marker in zip(dtypes, markers):
                pts = sorted((r.case.shape.m, r.ms(impl)) for r in rs
                             if r.case.spec.name == d and r.ms(impl))
                if pts:
                    ax.plot(*zip(*pts), marker=marker, color=color, label=f"{impl} {d}",
                            linestyle="-" if impl == "ours" else "--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("M (batch)")
        ax.set_ylabel("ms per forward")
        k_n = f"{rs[0].case.shape.k}->{rs[0].case.shape.n}" if rs else ""
        ax.set_title(f"problem 84, {k_n}, {mode}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(_title(env, "M sweep"), fontsize=10)
    fig.tight_layout()
    return fig


def _softmax(plt, env, results, copy):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    dtypes = list(OrderedDict.fromkeys(r.dtype for r in results))
    for d, marker in zip(dtypes, ["o", "s", "^"]):
        rows = [r for r in results if r.dtype == d]
        # The row-length sweep shares one input size; other points (the head's own shape) are
        # drawn as lone markers rather than joined into the sweep's line.
        sweep_bytes = Counter(r.nbytes for r in rows).most_common(1)[0][0]
        for impl, color in (("ours", "#1f77b4"), ("torch", "#ff7f0e")):
            pts = [(r.n, r.gbps(impl)) for r in rows if r.nbytes == sweep_bytes and r.gbps(impl)]
            if pts:
                ax.plot(*zip(*pts), marker=marker, color=color, label=f"{impl} {d}",
                        linestyle="-" if d == dtypes[0] else "--")
            for r in rows:
                if r.nbytes != sweep_bytes and r.gbps(impl):
                    ax.plot([r.n], [r.gbps(impl)], marker="*", markersize=10, color=color,
                            linestyle="none", label=f"{impl} {d} {r.m}x{r.n}")
    if copy is not None and copy.gbps:
        ax.axhline(copy.gbps, color="gray", linestyle=":", label="tensor.copy_")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row length N")
    ax.set_ylabel("GB/s (read + write)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(_title(env, "row softmax bandwidth"), fontsize=10)
    fig.tight_layout()
    return fig
