"""PNG charts (matplotlib; skipped with a message when it is missing)."""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from typing import Callable, Optional, Sequence

from . import EXTRA_HINT
from .configs import DTYPES, PROBLEM_NAMES
from .report import split_steps, split_sweep

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
        log(f"matplotlib is not installed, so no chart was drawn; {EXTRA_HINT}")
        return []
    paths = []
    main, sweep = split_sweep(results)
    forwards, steps = split_steps(main)
    for name, fn, data in (("bench.png", _bars, forwards), ("bench-train-step.png", _step_bars, steps),
                           ("bench-sweep.png", _sweep, sweep), ("softmax.png", _softmax, softmax)):
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


def impls_drawn(results) -> list[str]:
    """ours and eager always; compile only where it was timed (not under --no-compile)."""
    return [i for i in IMPL_COLORS if i != "compile" or any(r.case.compile for r in results)]


def _step_bars(plt, env, results, copy):
    """The training steps, drawn like the forwards (their own chart: ms per step)."""
    return _bars(plt, env, results, copy, unit="step", what="training step (forward + backward)")


def _bars(plt, env, results, copy, unit: str = "forward", what: Optional[str] = None):
    """Grouped bars: one panel per problem shape, bars per implementation for each dtype x mode."""
    groups: "OrderedDict[tuple, list]" = OrderedDict()
    for r in results:
        if not r.case.skip:
            groups.setdefault((r.case.shape.problem, str(r.case.shape)), []).append(r)
    impls = impls_drawn(results)
    n = len(groups)
    fig, axes = plt.subplots(n, 1, figsize=(max(8, 1.3 * max(len(g) for g in groups.values())),
                                            3.6 * n), squeeze=False)
    width = 0.8 / len(impls)
    for ax, ((problem, shape), rs) in zip(axes[:, 0], groups.items()):
        labels = [f"{r.case.spec.name}\n{r.case.mode}" for r in rs]
        allv = []
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(rs))]
            vals = [r.ms(impl) or 0.0 for r in rs]
            allv += vals
            ax.bar(xs, vals, width, label=impl, color=IMPL_COLORS[impl])
            for x, r in zip(xs, rs):
                if r.ms(impl) is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel(f"ms per {unit}")
        ax.set_title(f"problem {problem} ({PROBLEM_NAMES[problem]}), {shape}", fontsize=10)
        _log_if_wide(ax, allv)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(env, f"epifuse: time per {what or unit} (lower is better)"), fontsize=10)
    fig.tight_layout()
    return fig


def _sweep(plt, env, results, copy):
    """Small multiples of time vs M (log-log): a row per mode, a column per dtype/precision.

    Each panel holds only the implementations of one dtype (2-3 lines), so ours vs eager can
    be read at every M; one legend serves all panels (same colours throughout).
    """
    rs_all = [r for r in results if not r.case.skip]
    modes = list(OrderedDict.fromkeys(r.case.mode for r in rs_all))
    order = list(DTYPES)  # fp32-ieee, fp32-3xtf32, fp32-tf32, bf16, fp16: the tables' order
    dtypes = sorted({r.case.spec.name for r in rs_all}, key=order.index)
    impls = impls_drawn(rs_all)
    fig, axes = plt.subplots(len(modes), len(dtypes), figsize=(3.4 * len(dtypes), 2.9 * len(modes)),
                             squeeze=False, sharex=True)
    for row, mode in enumerate(modes):
        for col, d in enumerate(dtypes):
            ax = axes[row, col]
            rs = [r for r in rs_all if r.case.mode == mode and r.case.spec.name == d]
            for impl in impls:
                pts = sorted((r.case.shape.m, r.ms(impl)) for r in rs if r.ms(impl))
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, color=IMPL_COLORS[impl],
                            label=impl, linestyle="-" if impl == "ours" else "--")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{d}, {mode}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.tick_params(labelsize=7)
            if row == len(modes) - 1:
                ax.set_xlabel("M (batch)", fontsize=8)
            if col == 0:
                ax.set_ylabel("ms per forward", fontsize=8)
    handles = [plt.Line2D([], [], color=IMPL_COLORS[i], marker="o", markersize=3,
                          linestyle="-" if i == "ours" else "--", label=i) for i in impls]
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(impls))
    k_n = f"{rs_all[0].case.shape.k}->{rs_all[0].case.shape.n}" if rs_all else ""
    fig.suptitle(_title(env, f"M sweep, problem 84, {k_n}"), fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
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
