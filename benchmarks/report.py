"""The report: text and Markdown tables from a run's bench.json, the legend, the environment, and
the PNG charts (matplotlib, optional). BENCHMARKS.md is ``markdown_report`` of one whole run.

``python -m benchmarks.report BENCH_JSON --markdown PATH`` writes the report of a bench.json again
without measuring anything (e.g. BENCHMARKS.md from a GPU run's bench.json, on another machine).

Everything works on one ``doc``, bench.json's content: ``env``, ``settings``, and per section its
rows, ``cases`` (KernelBench), ``host_time``, ``softmax`` and ``copy_bandwidth``, ``real_heads``,
``distributed`` (its results, or why it was not run). Table columns are lists of (header, cell)
pairs: a column the next measurements add is one more pair in ``MODEL_COLUMNS`` (as the peak
memory per implementation was). Rows of the autocast columns (amp-bf16, amp-fp16) get tables of
their own, after the forwards' and the steps'.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Callable, Optional, Sequence

import torch

from . import step_gemms
from .cases import DTYPES, PROBLEM_NAMES, SWEEP_PROBLEM, TRAIN_STEP

PAGE_MAX_LINES = 272  # BENCHMARKS.md: a page, not a log (the training loop's 36 rows and the
# plain Linear's 8 real-heads rows included)
SECTIONS = ("kernelbench", "host_time", "softmax", "real_heads", "small_batch", "loop",
            "distributed")
SECTION_NAMES = {"kernelbench": "KernelBench", "host_time": "host time", "softmax": "softmax",
                 "real_heads": "real heads", "small_batch": "small batches",
                 "loop": "training loop", "distributed": "2-GPU"}

# --------------------------------------------------------------------------- rows and cells


def dims(row: dict) -> str:
    return f"{row['M']}x{row['K']}->{row['N']}"


def ms(row: dict, impl: str) -> Optional[float]:
    t = row["timings_ms"].get(impl)
    return t["median_ms"] if t else None


def speedup(row: dict, baseline: str) -> Optional[float]:
    """baseline / ours; "kb" is eager fp32-ieee, the KernelBench reference."""
    ours, base = ms(row, "ours"), row["kb_reference_ms"] if baseline == "kb" else ms(row, baseline)
    return base / ours if ours and base else None


def tflops(row: dict, impl: str = "ours") -> Optional[float]:
    """GEMM TFLOP/s of one call (a step counts 3 GEMMs; the GEMM alone and torch.mm one)."""
    t = ms(row, impl)
    flops = 2.0 * row["M"] * row["K"] * row["N"] if impl in ("gemm", "torch_mm") else row["flops"]
    return flops / (t * 1e-3) / 1e12 if t else None


def peak_mib(row: dict, impl: str) -> Optional[float]:
    """The implementation's peak memory in MiB (rows from before it was measured: None)."""
    return (row.get("peak_mib") or {}).get(impl)


def peak_ratio(row: dict) -> Optional[float]:
    """Peak memory of ours / eager's."""
    ours, eager = peak_mib(row, "ours"), peak_mib(row, "eager")
    return ours / eager if ours is not None and eager else None


def is_autocast(row: dict) -> bool:
    spec = DTYPES.get(row["dtype"])
    return spec is not None and spec.autocast is not None


def fmt_mib(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def fmt_ms(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1f}" if x >= 100 else f"{x:.3f}" if x >= 1 else f"{x:.4f}"


def fmt_x(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_num(x: Optional[float], digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def fmt_rate(x: Optional[float]) -> str:
    """TFLOP/s or GB/s: three significant figures or so."""
    return "n/a" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def fmt_pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def fmt_err(e: Optional[dict]) -> str:
    if e is None:
        return "n/a"
    return f"{e['rel_fro']:.1e} / {e['max_abs']:.1e}" if e["finite"] else "non-finite"


class Notes:
    """Numbered footnotes for failure messages and fallback reasons."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int,
          markdown: bool) -> str:
    """Markdown (pipes; the first ``left`` columns left-aligned) or aligned text."""
    if markdown:
        esc = [[c.replace("|", "\\|") for c in r] for r in [headers, *rows]]
        align = "|" + "|".join(":--" if i < left else "--:" for i in range(len(headers))) + "|"
        lines = ["| " + " | ".join(r) + " |" for r in esc]
        return "\n".join([lines[0], align, *lines[1:]])
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) if i < left else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def _time(row: dict, impl: str, notes: Notes, what: str = "") -> str:
    if impl in row["timings_ms"]:
        return fmt_ms(ms(row, impl))
    msg = row["failures"].get(impl)
    if msg is None:
        return "n/a"
    return "n/a " + notes.ref(msg if msg.startswith("not run") else f"{what}{impl}: {msg}")


def _path(row: dict, notes: Notes) -> str:
    if row["path"] in (None, "fused"):
        return row["path"] or "-"
    return "reference " + notes.ref(f"ModelNew ran its reference path: {row['path']}")


def _peaks(row: dict, notes: Notes) -> str:
    """ours / eager / compile, in MiB; an implementation that was not timed has none."""
    def one(impl: str) -> str:
        failure = row["failures"].get(f"memory:{impl}")
        if failure is not None:
            return "n/a " + notes.ref(f"peak memory of {impl}: {failure}")
        return fmt_mib(peak_mib(row, impl))
    return " / ".join(one(impl) for impl in ("ours", "eager", "compile"))


def _err(impl: str, key: str, what: str):
    def cell(row: dict, notes: Notes) -> str:
        failure = row["failures"].get(f"accuracy:{impl}")
        if failure is not None:
            return "n/a " + notes.ref(f"{what} of {impl}: {failure}")
        return fmt_err(row["errors_vs_fp64"].get(key))
    return cell


def _head(row: dict) -> list[str]:
    return [f"{row['problem']} {PROBLEM_NAMES[row['problem']]}", dims(row), row["dtype"]]


# Every model table: path, times, rate and speed-ups (then its error columns).
MODEL_COLUMNS = [
    ("ModelNew path", _path),
    ("ours ms", lambda r, n: _time(r, "ours", n)),
    ("TFLOP/s", lambda r, n: fmt_rate(tflops(r))),
    ("eager ms", lambda r, n: _time(r, "eager", n)),
    ("compile ms", lambda r, n: _time(r, "compile", n)),
    ("vs eager", lambda r, n: fmt_x(speedup(r, "eager"))),
    ("vs compile", lambda r, n: fmt_x(speedup(r, "compile"))),
    ("vs KB ref", lambda r, n: fmt_x(speedup(r, "kb"))),
    ("peak MiB ours / eager / compile", _peaks),
    ("peak ours / eager", lambda r, n: fmt_num(peak_ratio(r), 2)),
]
def _queued(row: dict, notes: Notes) -> str:
    """ours / eager / compile queued (the host ahead), ms per step; "-" for a row measured before
    the column existed."""
    if not row.get("queued_ms") and not any(k.startswith("queued:") for k in row["failures"]):
        return "-"

    def one(impl: str) -> str:
        t = row.get("queued_ms", {}).get(impl)
        if t is None:
            failure = row["failures"].get(f"queued:{impl}")
            return "n/a" if failure is None else "n/a " + notes.ref(f"queued {impl}: {failure}")
        cell = fmt_ms(t["median_ms"])
        if t.get("gpu_kept_busy") is False:
            cell += " " + notes.ref("queued: the GPU went idle while the host queued the steps "
                                    "(host time included)")
        return cell
    return " / ".join(one(impl) for impl in ("ours", "eager", "compile"))


def queued_speedup(row: dict, baseline: str = "eager") -> Optional[float]:
    q = row.get("queued_ms", {})
    ours, base = q.get("ours"), q.get(baseline)
    return base["median_ms"] / ours["median_ms"] if ours and base and ours["median_ms"] else None


STEP_QUEUED = [("queued ms ours / eager / compile", _queued),
               ("queued vs eager",
                lambda r, n: fmt_x(queued_speedup(r)) if r.get("queued_ms") else "-")]
FORWARD_ERRORS = [("err ours (rel / max)", _err("ours", "ours", "error check")),
                  ("err eager (rel / max)", _err("eager", "eager", "error check"))]
STEP_ERRORS = [(f"err {g} {impl} (rel / max)", _err(impl, f"{impl}:{g.lower()}", "gradient check"))
               for g in ("dX", "dW") for impl in ("ours", "eager")]


def _model_table(rows: Sequence[dict], notes: Notes, step: bool) -> tuple[list, list, int]:
    columns = MODEL_COLUMNS + (STEP_QUEUED + STEP_ERRORS if step else FORWARD_ERRORS)
    head = ["problem", "M x K -> N", "dtype"] + ([] if step else ["mode"])
    cells = []
    for r in rows:
        first = _head(r) + ([] if step else [r["mode"]])
        if r["skipped"]:
            skipped = f"skipped {notes.ref(r['skipped'])}"
            cells.append(first + [skipped] + ["-"] * (len(columns) - 1))
        else:
            cells.append(first + [cell(r, notes) for _, cell in columns])
    return head + [h for h, _ in columns], cells, len(head) + 1


def _host_table(rows: Sequence[dict], notes: Notes) -> tuple[list, list, int]:
    def t(r, impl):
        if impl in r["timings_us"]:
            return fmt_num(r["timings_us"][impl]["median_us"], 1)
        msg = r["failures"].get(impl)
        return "n/a" if msg is None else "n/a " + notes.ref(f"host time of {impl}: {msg}")

    def busy(r):
        flags = [t["gpu_kept_busy"] for t in r["timings_us"].values()]
        if not flags or any(f is None for f in flags):
            return "-"  # the CPU dry run: no GPU to keep busy
        return "yes" if all(flags) else "no " + notes.ref(
            "the GPU went idle during the calls in each of 3 attempts: the host time may include "
            "waiting for the GPU")

    cells = [_head(r) + [r["mode"], t(r, "ours"), t(r, "eager"), fmt_num(host_ratio(r), 2),
                         busy(r)] for r in rows]
    return (["problem", "M x K -> N", "dtype", "mode", "ours us", "eager us", "ours / eager",
             "GPU kept busy"], cells, 4)


def host_ratio(r: dict) -> Optional[float]:
    t = r["timings_us"]
    return (t["ours"]["median_us"] / t["eager"]["median_us"]
            if "ours" in t and "eager" in t and t["eager"]["median_us"] else None)


def _gemm_table(rows: Sequence[dict], notes: Notes, env: dict) -> tuple[list, list, int]:
    cells = []
    for r in rows:
        if r["gemm_alone"] and not r["skipped"]:
            over = ms(r, "ours") / ms(r, "gemm") if ms(r, "ours") and ms(r, "gemm") else None
            cells.append([dims(r), r["dtype"], r["mode"], r["gemm_op"] or "-",
                          _time(r, "gemm", notes), fmt_rate(tflops(r, "gemm")),
                          _time(r, "torch_mm", notes), fmt_rate(tflops(r, "torch_mm")),
                          _time(r, "ours", notes), fmt_num(over, 2)])
    return (["M x K -> N", "dtype", "mode", "our GEMM op", "GEMM ms", "TFLOP/s",
             f"{mm_label(env)} ms", "TFLOP/s", "end-to-end ms", "end-to-end / GEMM"], cells, 4)


def _step_gemm_cells(label: str, r: dict) -> list[str]:
    g = r["step_gemms"]
    forward = (g.get("forward") or {}).get("tflops")
    cells = [label, r["dtype"]]
    for kind in step_gemms.KINDS:
        e = g.get(kind) or {}
        cells += [fmt_ms(e.get("ms")), fmt_rate(e.get("tflops"))]
        if kind != "forward":
            rate = e.get("tflops")
            cells.append(fmt_pct(rate / forward if rate and forward else None))
    return cells


def _step_gemms_table(rows: Sequence[dict], heads: Sequence[dict]) -> tuple[list, list, int]:
    """Our training steps' three GEMMs (benchmarks/step_gemms.py) at PyTorch's default precision,
    where the 3x split's copies set the backward's rate: the KernelBench problems' and the real
    heads' (their heads summed). bench.json has them for every setting."""
    def shown(r: dict) -> bool:
        return bool(r.get("step_gemms")) and r["dtype"] == STEP_GEMMS_DTYPE

    cells = [_step_gemm_cells(f"problem {r['problem']} {dims(r)}", r) for r in rows if shown(r)]
    cells += [_step_gemm_cells(f"{r['model']} batch {r['batch']}", r) for r in heads if shown(r)]
    return (["step", "setting", "forward ms", "TFLOP/s", "dX ms", "TFLOP/s", "of forward's",
             "dW ms", "TFLOP/s", "of forward's"], cells, 2)


def softmax_gbps(r: dict, impl: str) -> Optional[float]:
    """Bytes read + written per second, in GB/s."""
    t = ms(r, impl)
    return r["bytes_read_plus_written"] / (t * 1e-3) / 1e9 if t else None


def _softmax_table(rows: Sequence[dict], notes: Notes, copy) -> tuple[list, list, int]:
    def err(r, impl):
        e = r["errors_vs_fp64"].get(impl)
        return "n/a" if e is None else f"{e['max_abs']:.1e}" if e["finite"] else "non-finite"

    def of_copy(g):
        return g / copy["gbps"] if g and copy and copy.get("gbps") else None

    cells = []
    for r in rows:
        ours, ref = ms(r, "ours"), ms(r, "torch")
        cells.append([r["dtype"], str(r["N"]), str(r["M"])] + [
            c for impl in ("ours", "torch") for c in (
                _time(r, impl, notes, "softmax "), fmt_rate(softmax_gbps(r, impl)),
                fmt_pct(of_copy(softmax_gbps(r, impl))))]
            + [fmt_x(ref / ours if ours and ref else None), err(r, "ours"), err(r, "torch")])
    return (["dtype", "N", "M", "ours ms", "ours GB/s", "of copy", "torch ms", "torch GB/s",
             "of copy", "vs torch", "max err ours", "max err torch"], cells, 1)


def split(rows: Sequence[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(forwards, training steps, the M sweep incl. the fixed shape that lies on it)."""
    fixed = [r for r in rows if r["tag"] != "sweep"]
    sweep = [r for r in rows if r["tag"] == "sweep"]
    if sweep:
        k, n = sweep[0]["K"], sweep[0]["N"]
        sweep = sorted(sweep + [r for r in fixed if r["problem"] == SWEEP_PROBLEM
                                and r["mode"] != TRAIN_STEP and (r["K"], r["N"]) == (k, n)],
                       key=lambda r: (r["mode"] != "train", r["dtype"], r["M"]))
    return ([r for r in fixed if r["mode"] != TRAIN_STEP],
            [r for r in fixed if r["mode"] == TRAIN_STEP], sweep)


FORWARD_TITLE = "Forwards: ModelNew vs PyTorch (median ms per forward)"
STEP_TITLE = "Training step (forward + backward): ModelNew vs PyTorch (median ms per step)"
AMP_FORWARD_TITLE = ("Autocast forwards (fp32 parameters and inputs under torch.autocast; median "
                     "ms per forward)")
AMP_STEP_TITLE = ("Autocast training steps (forward under torch.autocast, backward after it; "
                  "median ms per step)")
STEP_GEMMS_DTYPE = "fp32-3xtf32"
STEP_GEMMS_TITLE = ("The GEMMs of our default-precision training steps: forward x.W^T, dX = dZ.W, "
                    "dW = dZ^T.X (GPU ms per step from each op's kernels, its splits and copies "
                    "included)")
HOST_TITLE = "Host time per forward (median us of CPU time per Python call)"
GEMM_TITLE = "Our GEMM alone (KernelBench shapes)"
SOFTMAX_TITLE = "Row softmax: epifuse affine_softmax vs torch.softmax"
REAL_HEADS_TITLE = "Real heads: models fused by epifuse.fuse vs eager and torch.compile"
LOOP_TITLE = ("Training loop: zero_grad + forward + loss + backward + optimizer step (median ms "
              "per step)")
LOOP_HOST_TITLE = "Host time per head in the loop (median us of CPU time per call)"
DISTRIBUTED_TITLE = "Data-parallel training step on 2 GPUs or more"


def copy_line(copy: dict) -> str:
    if copy.get("gbps") is None:
        return f"n/a: {copy.get('failure')}"
    return (f"{copy['gbps']:.0f} GB/s: {copy['bytes_read_plus_written'] / 2 / 2**20:.0f} MiB "
            "tensor.copy_, bytes read + written")




def _rh_time(r: dict, impl: str, notes: Notes) -> str:
    t = r["timings_ms"].get(impl)
    if t is None:
        return "n/a" if r.get("compile_timed", True) or impl != "compile" else "-"
    if "error" in t:
        return "n/a " + notes.ref(f"{r['model']} {r['dtype']} {r['mode']}, {impl}: {t['error']}")
    return fmt_ms(t["median_ms"])


def _rh_ms(r: dict, impl: str) -> Optional[float]:
    t = r["timings_ms"].get(impl)
    return None if t is None or "error" in t else t["median_ms"]


def real_heads_speedup(r: dict, baseline: str) -> Optional[float]:
    ours, base = _rh_ms(r, "ours"), _rh_ms(r, baseline)
    return base / ours if ours and base else None


def _real_heads_table(rows: Sequence[dict], notes: Notes) -> tuple[list, list, int]:
    def peaks(r):
        pk = r.get("peak_mib") or {}
        return "-" if not pk else " / ".join(fmt_mib(pk.get(i)) for i in ("ours", "eager",
                                                                          "compile"))
    cells = [[r["model"], r["dtype"], r["mode"], str(len(r["fused"]))]
             + [_rh_time(r, i, notes) for i in ("ours", "eager", "compile")]
             + [fmt_x(real_heads_speedup(r, "eager")), fmt_x(real_heads_speedup(r, "compile")),
                peaks(r)] for r in rows]
    return (["model", "dtype", "mode", "fused heads", "ours ms", "eager ms", "compile ms",
             "vs eager", "vs compile", "peak MiB ours / eager / compile"], cells, 3)


def real_heads_markdown(env: dict, rows: Sequence[dict]) -> str:
    """``python -m benchmarks.real_heads``' own page: its table alone."""
    notes = Notes()
    headers, cells, left = _real_heads_table(rows, notes)
    batch = rows[0]["batch"] if rows else "-"
    lines = [f"## {REAL_HEADS_TITLE}", "",
             f"- GPU: {env.get('gpu')}; PyTorch {env.get('torch')}; batch {batch}",
             "- `python -m benchmarks.real_heads` (median ms per call; peak MiB of one call)", "",
             table(headers, cells, left, markdown=True), ""]
    lines += [f"[{i + 1}] {t}  " for i, t in enumerate(notes.items)]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- small batches

SMALL_BATCH_TITLE = ("Small batches and whole heads: SSL and tabular heads as their papers build "
                     "them, fused by epifuse.fuse (ms per step; GPU ms and where it goes)")
SMALL_BATCH_MODES = {"head": "head", "sgd": "+ SGD"}


def _sb_cell(r: dict, impl: str, notes: Notes, key: str = "timings_ms") -> str:
    t = (r.get(key) or {}).get(impl)
    if t is None:
        return "-"
    if "error" in t:
        return "n/a " + notes.ref(f"{r['model']} {r['batch']} {r['setting']} {r['mode']}, "
                                  f"{impl}: {t['error']}")
    return fmt_ms(t["median_ms"])


def _sb_ratio(r: dict, base: str, ours: str, key: str = "timings_ms") -> Optional[float]:
    def one(impl):
        t = (r.get(key) or {}).get(impl) or {}
        return t.get("median_ms")
    a, b = one(base), one(ours)
    return a / b if a and b else None


def _sb_breakdown(r: dict, impl: str) -> str:
    g = (r.get("gpu_ms") or {}).get(impl)
    if not g:
        return "-"
    return " / ".join(fmt_ms(g.get(k)) for k in ("gemm", "operands", "other"))


def _sb_peaks(r: dict) -> str:
    pk = r.get("peak_mib") or {}
    fused, eager = pk.get("fused"), pk.get("eager")
    if fused is None or eager is None:
        return "-"
    return f"{fmt_mib(fused)} / {fmt_mib(eager)} ({fused / eager:.2f})" if eager else "-"


def _sb_path(r: dict, notes: Notes) -> str:
    back = [(i, p["reason"]) for i, p in (r.get("path") or {}).items() if p.get("reason")]
    return f"{len(r.get('fused') or [])}" + "".join(
        " " + notes.ref(f"{r['model']} {r['setting']}, {i} fell back: {why}") for i, why in back)


def _sb_head(r: dict) -> str:
    """The row's model and shape: "barlow_twins 2 x 128", "tabular 1 x 4096"."""
    name = ("ResNet-50 + barlow_twins" if r["model"] == "resnet50_barlow_twins" else r["model"])
    return f"{name} {r.get('views', 2)} x {r['batch']}"


def _small_batch_table(rows: Sequence[dict], notes: Notes) -> tuple[list, list, int]:
    cells = []
    for r in rows:
        times = " / ".join(_sb_cell(r, i, notes) for i in ("eager", "compile", "fused",
                                                            "compile_fused"))
        gpu = " / ".join(_sb_cell(r, i, notes, "queued_ms") for i in ("eager", "fused"))
        vs_compile = " / ".join(fmt_x(_sb_ratio(r, "compile", i))
                                for i in ("fused", "compile_fused"))
        cells.append([_sb_head(r), r["setting"], SMALL_BATCH_MODES.get(r["mode"], r["mode"]),
                      _sb_path(r, notes), times, fmt_x(_sb_ratio(r, "eager", "fused")),
                      vs_compile, gpu,
                      _sb_breakdown(r, "fused") + " | " + _sb_breakdown(r, "eager"),
                      _sb_peaks(r)])
    return (["head (views x rows)", "setting", "step", "fused chains",
             "ms eager / compile / fused / compile(fused)", "fused vs eager",
             "vs compile: fused / compile(fused)", "GPU ms eager / fused",
             "GPU ms GEMM / operands / other: fused | eager", "peak MiB fused / eager"], cells, 4)


def small_batch_legend(rows: Sequence[dict]) -> str:
    dims = {r["model"]: r.get("dims") for r in rows if r.get("dims")}
    models = []

    def have(name: str):
        return dims.get(name) or (None, None, None)

    if "barlow_twins" in dims:
        d_in, h, d_out = have("barlow_twins")
        models.append(f"barlow_twins = Barlow Twins' projector, Linear({d_in}, {h}) -> BN -> ReLU "
                      f"-> Linear({h}, {h}) -> BN -> ReLU -> Linear({h}, {d_out})")
    if "moco_v3" in dims:
        d_in, h, d_out = have("moco_v3")
        models.append(f"moco_v3 = MoCo v3's projector Linear({d_in}, {h}) -> BN -> ReLU -> "
                      f"Linear({h}, {h}) -> BN -> ReLU -> Linear({h}, {d_out}) -> "
                      f"BatchNorm1d({d_out}, affine=False) and predictor Linear({d_out}, {h}) -> "
                      f"BN -> ReLU -> Linear({h}, {d_out})")
    if "byol" in dims:
        d_in, h, d_out = have("byol")
        models.append(f"byol = BYOL's projector Linear({d_in}, {h}) -> BN -> ReLU -> "
                      f"Linear({h}, {d_out}) and predictor Linear({d_out}, {h}) -> BN -> ReLU -> "
                      f"Linear({h}, {d_out})")
    if "simclr_v1" in dims:
        d_in, h, d_out = have("simclr_v1")
        models.append(f"simclr_v1 = SimCLR v1's projection head Linear({d_in}, {h}) -> ReLU -> "
                      f"Linear({h}, {d_out}), no BatchNorm")
    if "tabular" in dims:
        d_in, h, d_out = have("tabular")
        models.append(f"tabular = a tabular MLP Linear({d_in}, {h}) -> BN -> ReLU -> "
                      f"Linear({h}, {h}) -> BN -> ReLU -> Linear({h}, {d_out})")
    e2e = [r for r in rows if r["model"] == "resnet50_barlow_twins"]
    if e2e:
        source = e2e[0].get("backbone") or "torchvision"
        models.append("ResNet-50 + barlow_twins = end to end: a ResNet-50 backbone ("
                      + ("torchvision's" if source == "torchvision"
                         else "torchvision's architecture, from benchmarks/resnet.py")
                      + ", its fc dropped) under the same projector, images of "
                      f"{e2e[0].get('image')} x {e2e[0].get('image')}, the "
                      "whole step timed; the head and its loss are a small part of such a step, "
                      "so a few percent is what fusing the head can give it; not compiled")
    return ("Small batches (`python -m benchmarks.small_batch`): " + "; ".join(models)
            + "; a Linear that a BatchNorm follows without bias, the others with one. Plain "
            "Linears (no BatchNorm after them) run fused at fp32 default precision and PyTorch's "
            "own GEMM at 16 bits and in TF32. One step = each view through the model (its own "
            "call; 2 x rows: two views, -cosine_similarity(z1, z2).mean(); 1 x 4096: one call, "
            "mean(z^2); in one autocast region for amp-bf16), backward; "
            "'head': the parameters' versions bumped as an optimizer's update would, no "
            "optimizer; '+ SGD': SGD(momentum=0.9, fused) steps. ms per step queued back to back "
            "(a host slower than its GPU counts); GPU ms: the same steps with the host ahead. "
            "Where the GPU time goes: one profiled run of 3 steps, kernels by name (GEMM = "
            "CUTLASS and cuBLAS GEMMs and the backbone's convolutions; operands = "
            "the 3x splits, 16-bit casts and operand copies; other = BatchNorm, activations, "
            "the loss, reductions, the optimizer). 'fused chains' = what `epifuse.fuse` fused "
            "(Linear -> BN chains and plain Linears); a footnote marks a step that did not run "
            "them. "
            "peak MiB: one step's peak above what was allocated before it. torch.compile "
            "only at the batches the row shows ('-' elsewhere), compile of the fused model for "
            "barlow_twins and moco_v3.")


def small_batch_markdown(doc: dict) -> str:
    """``python -m benchmarks.small_batch``' own page: its table alone."""
    notes, env = Notes(), doc.get("env") or {}
    rows = doc.get("small_batch") or []
    headers, cells, left = _small_batch_table(rows, notes)
    lines = [f"## {SMALL_BATCH_TITLE}", "", f"- GPU: {env.get('gpu')}; PyTorch {env.get('torch')}",
             "- `python -m benchmarks.small_batch`", "", table(headers, cells, left, True), ""]
    lines += [f"[{i + 1}] {t}  " for i, t in enumerate(notes.items)]
    if rows:
        lines += ["", small_batch_legend(rows)]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- training loop

LOOP_OPTIMIZERS = {"sgd": "SGD", "adamw": "AdamW"}


def loop_ms(r: dict, impl: str, key: str = "timings_ms") -> Optional[float]:
    t = (r.get(key) or {}).get(impl)
    return None if t is None or "error" in t else t["median_ms"]


def loop_speedup(r: dict, base: str, ours: str, key: str = "timings_ms") -> Optional[float]:
    """base's ms / ours' (> 1: ours is faster)."""
    a, b = loop_ms(r, base, key), loop_ms(r, ours, key)
    return a / b if a and b else None


def _loop_label(r: dict) -> str:
    return f"{r['model']} batch {r['batch']} {r['setting']} {LOOP_OPTIMIZERS[r['optimizer']]}"


def _loop_time(r: dict, impl: str, notes: Notes, key: str = "timings_ms") -> str:
    t = (r.get(key) or {}).get(impl)
    if t is None:
        return "n/a" if r.get("compile_timed", True) or not impl.startswith("compile") else "-"
    if "error" in t:
        return "n/a " + notes.ref(f"{_loop_label(r)}, {impl}: {t['error']}")
    cell = fmt_ms(t["median_ms"])
    skipped = (r.get("cudagraph_skips") or {}).get(impl)
    if skipped:
        cell += " " + notes.ref(f"{impl}: inductor ran {skipped} graph(s) without CUDA graphs "
                                "(see TORCH_LOGS=perf_hints)")
    if key == "queued_ms" and t.get("gpu_kept_busy") is False:
        cell += " " + notes.ref("queued: the GPU went idle while the host queued the steps (a "
                                "step synchronized): the time includes the host's")
    if key == "host_ms" and t.get("gpu_kept_busy") is False:
        cell += " " + notes.ref("host: a step synchronized (GradScaler's check for infs), so its "
                                "host time includes waiting for the GPU")
    return cell


def loop_path(r: dict) -> list[tuple[str, str]]:
    """(implementation, reason) of each fused implementation whose step ran fewer
    epifuse::fused_head (or backward) calls than the model has fused heads."""
    return [(impl, p.get("reason") or "fewer fused-op calls than heads")
            for impl, p in (r.get("path") or {}).items()
            if p["forward"] < p["heads"] or p["backward"] < p["heads"]]


def _loop_path_cell(r: dict, notes: Notes) -> str:
    path = r.get("path") or {}
    if not path:
        return "-"
    back = loop_path(r)
    if not back:
        return f"yes ({r.get('fused_heads', '?')} heads)"
    reasons = sorted({reason for _, reason in back})
    note = notes.ref(f"{', '.join(i for i, _ in back)}: the fused heads ran their modules, not "
                     f"epifuse::fused_head ({'; '.join(reasons)})")
    return ("no " if len(back) == len(path) else "partly ") + note


def _loop_optimizer(r: dict, notes: Notes) -> str:
    name, how = LOOP_OPTIMIZERS[r["optimizer"]], r.get("optimizer_impl") or "n/a"
    if how == "fused":
        return f"{name} fused"
    return f"{name} default " + notes.ref(f"{name}(fused=True) not supported here: {how}")


def _loop_table(rows: Sequence[dict], notes: Notes) -> tuple[list, list, int]:
    def pair(r, impls, key="timings_ms"):
        return " / ".join(_loop_time(r, i, notes, key) for i in impls)

    impls = ("eager", "fused", "compile_ro", "compile_fused_ro")
    host = any(r.get("host_ms") for r in rows)  # rows measured before the column had none
    cells = [[r["model"], str(r["batch"]), r["setting"], _loop_optimizer(r, notes),
              _loop_path_cell(r, notes)]
             + [_loop_time(r, i, notes) for i in ("eager", "fused", "compile_ro",
                                                   "compile_fused_ro")]
             + [fmt_x(loop_speedup(r, "eager", "fused")),
                fmt_x(loop_speedup(r, "compile_ro", "compile_fused_ro")),
                pair(r, ("compile", "compile_fused")),
                pair(r, impls, "queued_ms")] + ([pair(r, impls, "host_ms")] if host else [])
             for r in rows]
    return (["model", "batch", "setting", "optimizer", "fused path", "eager ms", "fused ms",
             "compile-RO ms", "compile-RO fused ms", "fused vs eager", "RO fused vs RO",
             "compile ms unfused / fused", "queued ms eager / fused / RO / RO fused"]
            + (["host ms eager / fused / RO / RO fused"] if host else []), cells, 5)


def _loop_host_table(rows: Sequence[dict], notes: Notes) -> tuple[list, list, int]:
    def us(r, impl, what):
        t = r["timings_us"].get(impl)
        if t is None:
            msg = r["failures"].get(impl)
            return "n/a" if msg is None else "n/a " + notes.ref(
                f"host time per head, {r['setting']}, {impl}: {msg}")
        return fmt_num(t["backward_us"] if what == "backward" else t["forward"]["median_us"], 1)

    def rel(r, what):
        t = r["timings_us"]
        if "eager" not in t or "fused" not in t:
            return "n/a"
        get = (lambda d: d["backward_us"]) if what == "backward" else (
            lambda d: d["forward"]["median_us"])
        return fmt_num(get(t["fused"]) / get(t["eager"]), 2) if get(t["eager"]) > 0 else "n/a"

    def path(r):
        p = r.get("path")
        if not p:
            return "-"
        if p["forward"] >= 1 and p["backward"] >= 1:
            return "yes"
        return "no " + notes.ref(f"host time per head: the fused head ran its modules, not "
                                 f"epifuse::fused_head ({p.get('reason')})")

    def busy(r):
        flags = [t[w]["gpu_kept_busy"] for t in r["timings_us"].values()
                 for w in ("forward", "forward_backward")]
        if not flags or any(f is None for f in flags):
            return "-"
        return "yes" if all(flags) else "no " + notes.ref(
            "the GPU went idle during the calls in each of 3 attempts: the host time may include "
            "waiting for the GPU")

    cells = [[r["setting"], f"{r['batch']}x{r['dims'][0]}->{r['dims'][1]}",
              us(r, "eager", "forward"), us(r, "fused", "forward"), rel(r, "forward"),
              us(r, "eager", "backward"), us(r, "fused", "backward"), rel(r, "backward"),
              path(r), busy(r)] for r in rows]
    return (["setting", "head", "eager fwd us", "fused fwd us", "fused / eager", "eager bwd us",
             "fused bwd us", "fused / eager", "fused path", "GPU kept busy"], cells, 2)


def loop_tables(doc: dict, notes: Notes) -> list[tuple]:
    out = []
    if doc.get("loop"):
        out.append((LOOP_TITLE, *_loop_table(doc["loop"], notes)))
    if doc.get("loop_host"):
        out.append((LOOP_HOST_TITLE, *_loop_host_table(doc["loop_host"], notes)))
    return out


def loop_legend(doc: dict) -> str:
    """The training loop's paragraph, with the models and settings as this run ran them."""
    rows = doc.get("loop") or []
    env = doc.get("env") or {}
    dims = {r["model"]: r["dims"] for r in rows if r.get("dims")}
    models = []
    if "projection" in dims and len(dims["projection"]) == 3:
        d_in, hidden, d_out = dims["projection"]
        models.append(f"projection = MoCo v3's projector as MoCo v3 builds it, "
                      f"Linear({d_in}, {hidden}, bias=False) -> BN -> ReLU -> Linear({hidden}, "
                      f"{hidden}, bias=False) -> BN -> ReLU -> Linear({hidden}, {d_out}, "
                      f"bias=False) -> BatchNorm1d({d_out}, affine=False)")
    if "classifier" in dims:
        d_in, hidden, d_out = dims["classifier"]
        models.append(f"classifier = Linear({d_in}, {hidden}) -> BN -> GELU -> Linear({hidden}, "
                      f"{d_out}) -> BN -> Softmax")
    cuda = on_cuda(env)
    return (
        "Training loop (`python -m benchmarks.loop`): " + "; ".join(models) + ". One timed step "
        "= `optimizer.zero_grad(set_to_none=True)`, the forward and the loss `(y * g).sum()` "
        "(g fixed, N(0, 1) / batch) in the setting's autocast region, `backward()`, "
        "`optimizer.step()`; amp-fp16 through `torch.amp.GradScaler` (`scaler.scale(loss)."
        "backward(); scaler.step(opt); scaler.update()`); x requires grad (dX computed, as on a "
        "backbone). Optimizers SGD(momentum=0.9) and AdamW, `fused=True` where supported "
        "('default' with a note otherwise). fused = `epifuse.fuse` of a copy; compile = "
        "`torch.compile(model)` with the loss, backward and optimizer eager around it (the "
        "common pattern), RO = `mode=\"reduce-overhead\"` (CUDA graphs, "
        "`torch.compiler.cudagraph_mark_step_begin()` each step)"
        + (_compile_note(env) if not cuda else "") + "; each implementation trains its own "
        "copy of the same initial parameters; compiled once per model, batch and setting (the "
        "compile warm-up is not timed). ms = median of "
        f"{timer_name(env)} timings of single steps, each from an idle device (synchronized "
        "before it: host latency included), inputs rotated, implementations interleaved in 3 "
        "rounds; queued = the GPU time per step with steps queued back to back "
        "behind a spin kernel (the host hidden, as behind a backbone's GPU work)"
        + ("; host = the host's time to issue one step while a spin kernel keeps the GPU busy "
           "(Python, dispatch, allocations, launches, the optimizer and the autograd engine "
           "included)" if any(r.get("host_ms") for r in doc.get("loop") or []) else "")
        + ". 'fused vs "
        "eager' = eager ms / fused ms, 'RO fused vs RO' = compile-RO ms / compile-RO fused ms. "
        "fused path = one step of each fused implementation (eager, compiled, reduce-overhead's "
        "recording step) under torch.profiler ran `epifuse::fused_head` and "
        "`epifuse::head_grad_coefficients` (every fused backward's) once per head ('no' with the reason otherwise). Host "
        "time per head: the projection's first head alone, eager modules vs the fused head, "
        "forward and backward ((forward + backward) - forward) "
        + ("issued while a spin kernel keeps the GPU busy (host time only)." if cuda
           else "(dry run: time.perf_counter around whole CPU calls)."))


def loop_markdown(doc: dict) -> str:
    """``python -m benchmarks.loop``'s own page: its tables alone."""
    notes, env = Notes(), doc.get("env") or {}
    lines = [f"- GPU: {env.get('gpu')}; PyTorch {env.get('torch')}",
             "- `python -m benchmarks.loop`", ""]
    for title, headers, cells, left in loop_tables(doc, notes):
        lines += [f"## {title}", "", table(headers, cells, left, markdown=True), ""]
    lines += [f"[{i + 1}] {t}  " for i, t in enumerate(notes.items)]
    if doc.get("loop") or doc.get("loop_host"):
        lines += ["", loop_legend(doc)]
    return "\n".join(lines).rstrip() + "\n"


def distributed_table(results: Sequence[dict], nproc: int, device_name: str,
                      markdown: bool = True) -> str:
    """The 2-GPU section's table (``benchmarks.distributed``'s results as dicts)."""
    headers = ["problem (per rank)", "dtype", "DDP", "ours ms", "SyncBatchNorm ms", "speedup",
               "output err vs SyncBN", "path", "host ms ours / SyncBN"]

    def host(r: dict) -> str:
        cell = f"{fmt_ms(r['ours_host_ms'])} / {fmt_ms(r['reference_host_ms'])}"
        return cell if r["gpu_kept_busy"] else cell + " (a step synchronized: GPU went idle)"

    rows = [[f"{r['problem']}: {r['shape']}", r["dtype"], "yes" if r["ddp"] else "no",
             fmt_ms(r["ours_ms"]), fmt_ms(r["reference_ms"]),
             fmt_x(r["reference_ms"] / r["ours_ms"] if r["ours_ms"] else None),
             f"{r['output_err']:.1e}", r["path"], host(r)] for r in results]
    return (f"Training step on {nproc} x {device_name}, synchronized batch statistics (slowest "
            f"rank's median; host ms: the host's time to issue one step)\n\n"
            + table(headers, rows, 3, markdown))


def tables(doc: dict) -> tuple[list[tuple], Notes]:
    """[(title, headers, cells, left)] of the KernelBench section, the softmax and the real
    heads, in the page's order, and the notes they refer to."""
    env, rows, notes = doc["env"], doc.get("cases") or [], Notes()
    forwards, steps, sweep = split(rows)
    out = []
    for title, part, step in ((FORWARD_TITLE, forwards, False), (STEP_TITLE, steps, True),
                              (AMP_FORWARD_TITLE, forwards, False), (AMP_STEP_TITLE, steps, True)):
        part = [r for r in part if is_autocast(r) == title.startswith("Autocast")]
        if part:
            out.append((title, *_model_table(part, notes, step)))
    gemm = _gemm_table(rows, notes, env)
    if gemm[1]:
        out.append((GEMM_TITLE, *gemm))
    step_gemm = _step_gemms_table(steps, doc.get("real_heads") or [])
    if step_gemm[1]:
        out.append((STEP_GEMMS_TITLE, *step_gemm))
    if doc.get("host_time"):
        out.append((HOST_TITLE, *_host_table(doc["host_time"], notes)))
    if sweep:
        out.append((f"M sweep, problem {SWEEP_PROBLEM}", *_model_table(sweep, notes, False)))
    if doc.get("real_heads"):
        out.append((REAL_HEADS_TITLE, *_real_heads_table(doc["real_heads"], notes)))
    if doc.get("small_batch"):
        out.append((SMALL_BATCH_TITLE, *_small_batch_table(doc["small_batch"], notes)))
    out += loop_tables(doc, notes)
    if doc.get("softmax"):
        copy, title = doc.get("copy_bandwidth"), SOFTMAX_TITLE
        if copy is not None:
            title += f" (copy bandwidth {copy_line(copy)})"
        out.append((title, *_softmax_table(doc["softmax"], notes, copy)))
    return out, notes


def unmeasured(doc: dict) -> str:
    """For a run that did not finish (bench.json's "complete" false), which of the sections it
    was asked for have no rows ("" for a finished run): what the page lacks."""
    if doc.get("complete", True):
        return ""
    settings = doc.get("settings") or {}
    rows = {"host_time": doc.get("host_time"), "softmax": doc.get("softmax"),
            "real_heads": doc.get("real_heads"), "small_batch": doc.get("small_batch"),
            "loop": doc.get("loop"), "kernelbench": doc.get("cases")}
    empty = [SECTION_NAMES[k] for k, v in rows.items()
             if not v and settings.get(k, k == "kernelbench")]
    partial = (f"the training loop has the rows measured before the stop ({len(doc['loop'])})"
               if doc.get("loop") and not doc.get("loop_host") else "")
    parts = ([f"not measured: {', '.join(empty)}"] if empty else []) + ([partial] if partial
                                                                        else [])
    return "; ".join(parts) or "every section has rows, the last one may be partial"


def distributed_text(doc: dict, markdown: bool) -> Optional[str]:
    """The 2-GPU section: its table, or the line saying why it was not run (None: not asked)."""
    d = doc.get("distributed")
    if not d:
        return None
    if d.get("not_run"):
        return f"Not run: {d['not_run']}."
    if d.get("failure"):
        return f"Failed: {d['failure']}"
    return distributed_table(d["results"], d["nproc"], d["device_name"], markdown)

# --------------------------------------------------------------------------- documents

def on_cuda(env: dict) -> bool:
    """Whether the run measured a GPU (else a CPU dry run: no CUDA events, no cuBLAS)."""
    return str(env.get("device") or "").startswith("cuda")


def timer_name(env: dict) -> str:
    return "CUDA-event" if on_cuda(env) else "time.perf_counter"


def mm_label(env: dict) -> str:
    return "cuBLAS mm" if on_cuda(env) else "torch.mm (CPU)"


COLUMNS_LEGEND = (
    "Columns: `fp32-3xtf32` = PyTorch's default fp32 precision ('highest'): eager and compile in "
    "IEEE fp32 (SGEMM; this eager is the KernelBench reference), ours in 3xTF32 (what "
    "`ModelNew(precision=None)` runs there); `fp32-tf32` = TF32 on for both (`'high'` / "
    "`precision='tf32'`); `fp32-ieee` = both in IEEE fp32; `bf16`, `fp16` = models and inputs in "
    "that dtype; `amp-bf16`, `amp-fp16` = torch.autocast, below.")
STEP_LEGEND = (
    "Training step = one training-mode forward + backward per timed call: x requires grad "
    "(dX is computed, as for a head inside a network), all parameters require grad, and their "
    "gradients (and x's) are set to None before each step; the upstream gradient is a fixed "
    "random g per input, applied as y.backward(g) (the gradients of (y * g).sum(), without "
    "timing that stand-in loss); each step first bumps every parameter's version counter "
    "(torch.autograd.graph.increment_version: no kernel), as an optimizer's in-place update "
    "would, so that no implementation reuses a cast or split of a weight that in training "
    "changes every step (ModelNew keeps those only while the weight is unchanged). Its TFLOP/s "
    "count 3 GEMMs (forward, dX, dW); 'vs KB ref' divides eager fp32's step at 'highest'. "
    "queued = the same steps' GPU time with the host ahead (10 steps queued behind a spin "
    "kernel, timed back to back; median of 5 rounds), where each step above is timed alone from "
    "an idle GPU, the host's latency before its first kernel included. "
    "Clocks: ours, eager and compile take turns in rounds, so our steps start after turns that "
    "kept the card under its power cap; run back to back for seconds, ours at default precision "
    "draw the card's power cap and its SM clock falls 16-27% (eager's stays at full clock), "
    "up to ~10% of their time (docs/performance.md, 'What bounds 4x eager'). "
    "err dX / err dW = the input's and gemm.weight's gradients against a float64 step with the "
    "same (rounded) parameters, x and g.")
AMP_LEGEND = (
    "Autocast (amp-bf16, amp-fp16): parameters and inputs in fp32 (x = torch.rand, as "
    "KernelBench's), every timed call entering its own torch.autocast('{device}', dtype=bfloat16"
    " / float16) region around the forward (torch.compile(Model) compiled once and called inside "
    "the region), a step's backward after the region exits, as PyTorch recommends; torch's fp32 "
    "matmul precision is its default ('highest'); ModelNew(precision=None). Errors against the "
    "float64 twin of the fp32 parameters; dW in fp32 (the parameters' dtype). In forwards "
    "ModelNew keeps the weight's 16-bit cast while the weight is unchanged (eager casts it in "
    "every region); steps bump the weights' versions, so there it casts every step.")
MEMORY_LEGEND = (
    "peak MiB = the most memory one call allocated above what was allocated before it "
    "(torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated "
    "before the call), in one more, un-timed call after the timed ones (caches and workspaces "
    "warmed up): output, saved activations, gradients and workspaces count; parameters, inputs "
    "and what stays allocated between calls (in forwards, ModelNew's kept 16-bit cast or "
    "3xTF32 split of an unchanged weight) do not. 'peak ours / eager' is their ratio.")
def real_heads_legend(heads: Sequence[dict]) -> str:
    """The real heads' paragraph, with the models' sizes as this run ran them."""
    dims = {r["model"]: r.get("dims") for r in heads if r.get("dims")}
    models = []
    if "projection" in dims:
        d_in, hidden, d_out = dims["projection"]
        models.append(f"projection = MoCo v3's projector (on a ResNet-50 at full size), "
                      f"Linear({d_in}, {hidden}) -> BN -> ReLU -> Linear({hidden}, {hidden}) -> "
                      f"BN -> ReLU -> Linear({hidden}, {d_out}) -> BatchNorm1d({d_out}, "
                      "affine=False)")
    if "classifier" in dims:
        d_in, hidden, d_out = dims["classifier"]
        models.append(f"classifier = Linear({d_in}, {hidden}) -> BN -> GELU -> "
                      f"Linear({hidden}, {d_out}) -> BN -> Softmax")
    if "linear" in dims:
        d_in, _, d_out = dims["linear"]
        models.append(f"linear = one plain Linear({d_in}, {d_out}) (fused at fp32 default "
                      "precision, PyTorch's GEMM at 16 bits and in TF32)")
    return (f"Real heads (batch {heads[0]['batch']}): " + "; ".join(models) + ". ours = a copy "
            "fused by `epifuse.fuse(model, precision=...)` ('fused heads': how many Linear -> BN "
            "chains and plain Linears it fused), eager = the model, compile = torch.compile of it; columns, steps "
            "and autocast as above. `train-step-queued` = the same step's GPU time with the host "
            "ahead (steps queued behind a spin kernel, timed back to back): what the head costs "
            "inside a model whose GPU work hides the host, where `train-step` times each step "
            "alone, host latency included.")


DISTRIBUTED_LEGEND = (
    "2 GPUs: `python -m benchmarks.distributed`, one process per GPU (NCCL); each rank holds the "
    "KernelBench batch; ours = ModelNew after `epifuse.convert_sync_batchnorm`, reference = Model "
    "after `nn.SyncBatchNorm.convert_sync_batchnorm`, with and without DDP (then the weight "
    "gradient's all-reduce is in both steps); fixed counts of steps on every rank, the slowest "
    "rank's median.")


def _compile_note(env: dict) -> str:
    return "" if on_cuda(env) else (" (CPU dry run: backend='eager', dynamo's trace without "
                                    "inductor's code)")


def legend(doc: dict) -> list[str]:
    """The footer's paragraphs; names only what this run measured (a CPU dry run has no CUDA
    events)."""
    env, rows, heads = doc["env"], doc.get("cases") or [], doc.get("real_heads") or []
    timed = any(r["compile_timed"] for r in rows) or any(
        r.get("compile_timed") for r in list(heads) + list(doc.get("loop") or []))
    impls = "ours = ModelNew (epifuse); eager = reference Model" + (
        f"; compile = torch.compile(Model), default mode{_compile_note(env)}" if timed
        else "; torch.compile not timed (--no-compile)")
    out = [f"{impls}. Times: median of {timer_name(env)} timings after warm-up, inputs "
           "rotated so that they do not stay in L2; the implementations of a row are timed in 3 "
           "interleaved rounds, so that a slow spell of the machine falls on all of them. "
           "TFLOP/s = 2*M*N*K / time. 'vs KB ref' = eager fp32 with TF32 off (the KernelBench "
           "reference) / ours. err = ||out - ref64|| / ||ref64|| and max |out - ref64| against a "
           "float64 forward of the same (rounded) parameters and input. All implementations "
           "hold identical parameters; eval uses running statistics primed from one batch.",
           COLUMNS_LEGEND]
    if any(r["mode"] == TRAIN_STEP for r in rows):
        out.append(STEP_LEGEND)
    if any(is_autocast(r) for r in rows) or any(is_autocast(r) for r in heads):
        out.append(AMP_LEGEND.format(device="cuda" if on_cuda(env) else "cpu"))
    out.append(MEMORY_LEGEND if on_cuda(env) else
               "peak MiB: measured on CUDA only (n/a in a CPU dry run).")
    if doc.get("host_time"):
        how = ("time.perf_counter around each Python call of a forward (under torch.no_grad()) "
               "while a spin kernel queued ahead keeps the GPU busy, so calls only queue their "
               "kernels: host time (Python, dispatch, allocation, launches), no GPU time; median "
               "over rounds of back-to-back calls after warm-up" if on_cuda(env)
               else "time.perf_counter around whole CPU calls (dry run: no GPU)")
        out.append(f"Host time: {how}.")
    if any(r.get("step_gemms") for r in list(rows) + list(heads)):
        out.append("GEMMs of our training steps: one profiled run of 3 steps after the timed ones; "
                   "each GEMM op's GPU time is the sum of the kernels it launched (the 3x FP16 "
                   "splits, K-major copies and chunks included), per step; a real head's row sums "
                   "its heads. 'of forward's' = the GEMM's TFLOP/s / the forward GEMM's.")
    if heads:
        out.append(real_heads_legend(heads))
    if doc.get("small_batch"):
        out.append(small_batch_legend(doc["small_batch"]))
    if doc.get("loop") or doc.get("loop_host"):
        out.append(loop_legend(doc))
    if doc.get("softmax"):
        out.append("Softmax: each call alone, L2 flushed before it (a buffer larger than L2 "
                   "overwritten, as triton.testing.do_bench does); GB/s count bytes read + "
                   "written; 'of copy' = the share of tensor.copy_'s bandwidth.")
    if (doc.get("distributed") or {}).get("results"):
        out.append(DISTRIBUTED_LEGEND)
    return out


def _seconds(env: dict) -> str:
    parts = [f"{SECTION_NAMES[k]} {v:.0f} s" for k, v in (env.get("sections_s") or {}).items()]
    total = env.get("elapsed_s")
    return ("" if total is None else f" in {total:.0f} s") + (
        f" ({', '.join(parts)})" if parts else "")


def text_report(doc: dict) -> str:
    env = doc["env"]
    ts, notes = tables(doc)
    parts = [f"epifuse benchmark -- {env.get('gpu')} | torch {env.get('torch')} | CUDA "
             f"{env.get('cuda')} | {env.get('date')}", ""]
    for title, headers, cells, left in ts:
        parts += [title, table(headers, cells, left, markdown=False), ""]
    dist = distributed_text(doc, markdown=False)
    if dist is not None:
        parts += [DISTRIBUTED_TITLE, dist, ""]
    if notes.items:
        parts += ["Notes:", *(f"[{i + 1}] {t}" for i, t in enumerate(notes.items)), ""]
    return "\n".join(parts + legend(doc))


def markdown_report(doc: dict, charts: Sequence[str] = (), md_path: Optional[str] = None) -> str:
    """The whole page (BENCHMARKS.md) of one run."""
    env, settings = doc["env"], doc.get("settings") or {}
    ts, notes = tables(doc)
    commands = env.get("commands") or [env.get("command")]
    lines = [
        "# epifuse benchmarks", "",
        "Generated, whole, by one command on a GPU machine (`scripts/bench.sh --markdown "
        "BENCHMARKS.md`; the code is in `benchmarks/`"
        + (", the charts in `BENCHMARKS-charts/`" if charts else
           "; no charts: matplotlib was not installed where the page was written")
        + "); edit the generator, not this page. Every number below is from the run named "
        "here; earlier runs are in git's history.", "",
        "## Environment", "",
        f"- GPU: **{env.get('gpu')}**" + (
            f" ({env['capability']}, {env.get('sm_count')} SMs, {env.get('gpu_memory_gib')} GiB, "
            f"driver {env.get('driver') or 'unknown'}; {env.get('gpu_count')} GPU(s) in the "
            "machine)" if env.get("capability") else ""),
        f"- PyTorch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
        f"- epifuse {env.get('epifuse_version')}, commit `{env.get('git_commit') or 'unknown'}`"
        + (f" (library: {env['epifuse_build']})" if env.get("epifuse_build") else ""),
        f"- Run: {env.get('date')}{_seconds(env)}"
        + (f"; with results reused from a run on {env['resumed_from']}"
           if env.get("resumed_from") else ""),
        "- Command" + ("s (in this order; later ones reused the earlier results): "
                       if len(commands) > 1 else ": ") + ", ".join(f"`{c}`" for c in commands),
        f"- Timing: median of {settings.get('iters')} calls (fewer for slow calls, at least "
        f"{settings.get('min_iters')}) after {settings.get('warmup')} warm-up calls", ""]
    if settings.get("dry_run"):
        lines += ["**Dry run on the CPU at tiny sizes (`--device cpu`): the timings only test "
                  "the benchmark's plumbing.**", ""]
    unfinished = unmeasured(doc)
    if unfinished:
        lines += [f"**This run stopped before its end: {unfinished}.**", ""]
    kb_titles = {FORWARD_TITLE, STEP_TITLE, AMP_FORWARD_TITLE, AMP_STEP_TITLE, GEMM_TITLE,
                 HOST_TITLE}
    if any(t[0] in kb_titles or t[0].startswith("M sweep") for t in ts):
        problems = sorted({r["problem"] for r in doc.get("cases") or []}, reverse=True)
        lines += ["## KernelBench problems " + " and ".join(map(str, problems)), "",
                  "ModelNew (`epifuse.problems`) against the reference Model, eager and "
                  "torch.compile, at the problems' KernelBench sizes.", ""]
    for title, headers, cells, left in ts:
        level = ("###" if title in kb_titles or title.startswith("M sweep")
                 or title == LOOP_HOST_TITLE else "##")
        lines += [f"{level} {title}", "", table(headers, cells, left, markdown=True), ""]
    dist = distributed_text(doc, markdown=True)
    if dist is None and settings.get("distributed") is False and on_cuda(env) \
            and (env.get("gpu_count") or 0) < 2:
        dist = (f"Not run: this machine has {env.get('gpu_count')} GPU (the section runs on a "
                "machine with 2 or more).")
    if dist is not None:
        lines += [f"## {DISTRIBUTED_TITLE}", "", dist, ""]
    if notes.items:
        lines += ["## Notes", ""] + [f"[{i + 1}] {t}  " for i, t in enumerate(notes.items)] + [""]
    lines += ["## Legend", ""]
    for paragraph in legend(doc):
        lines += [paragraph, ""]
    if charts:
        lines += ["## Charts", ""]
    for chart in charts:
        target = chart if not md_path else os.path.relpath(
            os.path.abspath(chart), os.path.dirname(os.path.abspath(md_path)))
        lines += [f"![{os.path.basename(chart)}]({target})", ""]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- environment

def _run(*cmd: str) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> Optional[str]:
    """This checkout's commit (-dirty with local changes); EPIFUSE_GIT_COMMIT names it for a
    copy without .git (a remote GPU machine)."""
    if os.environ.get("EPIFUSE_GIT_COMMIT"):
        return os.environ["EPIFUSE_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    head = _run("git", "-C", here, "rev-parse", "--short", "HEAD")
    dirty = _run("git", "-C", here, "status", "--porcelain", "--untracked-files=no")
    return None if head is None else head + ("-dirty" if dirty else "")


def environment(device: torch.device) -> dict:
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    command = os.environ.get("EPIFUSE_BENCH_CMD") or "python -m benchmarks"  # or bench.sh's name
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": f"{command} {args}".strip(),
            "argv": list(sys.argv), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "git_commit": git_commit(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        info.update({"gpu": torch.cuda.get_device_name(device),
                     "capability": "sm_%d%d" % torch.cuda.get_device_capability(device),
                     "sm_count": props.multi_processor_count,
                     "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                     "l2_cache_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
                     "driver": driver.splitlines()[0] if driver else None,
                     "gpu_count": torch.cuda.device_count()})
    else:
        info["gpu"] = f"none (CPU dry run: {platform.processor() or platform.machine()})"
        info["gpu_count"] = torch.cuda.device_count()
    import epifuse

    # The library's own record (its commit may predate git_commit's), where the package exports
    # it as epifuse.build_info().
    build = epifuse.build_info() if hasattr(epifuse, "build_info") else None
    info.update({"epifuse_version": epifuse.__version__,
                 "epifuse_build": build.summary() if build else None,
                 "epifuse_cuda_kernels": _has_cuda_kernels(),
                 "epifuse_path": os.path.dirname(epifuse.__file__)})
    return info


def _has_cuda_kernels() -> bool:
    """Whether the loaded library has CUDA kernels (its GEMM op's, as a stand-in for all)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("epifuse::gemm_affine", "CUDA")


# --------------------------------------------------------------------------- charts

COLORS = {"ours": "#1f77b4", "eager": "#ff7f0e", "compile": "#2ca02c", "torch": "#ff7f0e",
          "vs eager": "#ff7f0e", "vs compile": "#2ca02c"}
CHARTS = ("bench.png", "bench-train-step.png", "bench-sweep.png", "real-heads.png", "softmax.png")


def impls_drawn(rows: Sequence[dict]) -> list[str]:
    """ours and eager always; compile only where it was timed (not under --no-compile)."""
    return ["ours", "eager"] + (["compile"] if any(r.get("compile_timed") for r in rows) else [])


def _panels(rows, key, label, keep=lambda r: not r.get("skipped")) -> dict:
    out: dict = {}
    for r in rows:
        if keep(r):
            out.setdefault(key(r), []).append(r)
    return {k: (v, [label(r) for r in v]) for k, v in out.items()}


def _rh_ratio(r: dict, series: str) -> Optional[float]:
    return real_heads_speedup(r, series.removeprefix("vs "))


def draw(out_dir: str, doc: dict, log: Callable[[str], None]) -> list[str]:
    """The charts with data (``CHARTS``) in ``out_dir``: grouped bars, a panel per shape (sweep:
    per dtype and mode; real heads: per model, ours' speed-up; softmax: per dtype); [] with a
    message without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed, so no chart was drawn (pip install matplotlib)")
        return []
    env, rows = doc["env"], doc.get("cases") or []
    heads, softmax, copy = doc.get("real_heads") or [], doc.get("softmax") or [], doc.get(
        "copy_bandwidth")
    forwards, steps, sweep = split(rows)

    def shape(r: dict) -> str:
        return f"problem {r['problem']} ({PROBLEM_NAMES[r['problem']]}), {dims(r)}"

    charts = [
        ("bench.png", _panels(forwards, shape, lambda r: f"{r['dtype']}\n{r['mode']}"),
         impls_drawn(rows), ms, "ms per forward"),
        ("bench-train-step.png", _panels(steps, shape, lambda r: r["dtype"]), impls_drawn(rows),
         ms, "ms per step"),
        ("bench-sweep.png", _panels(sweep, lambda r: f"{r['dtype']} {r['mode']}, problem 84, "
                                    f"{r['K']}->{r['N']}", lambda r: str(r["M"])),
         impls_drawn(rows), ms, "ms per forward, by batch M"),
        ("real-heads.png", _panels(heads, lambda r: f"{r['model']}, batch {r['batch']}",
                                   lambda r: f"{r['dtype']}\n{r['mode']}", keep=lambda r: True),
         ["vs eager"] + (["vs compile"] if any(r.get("compile_timed") for r in heads) else []),
         _rh_ratio, "ours' speed-up (x)"),
        ("softmax.png", _panels(softmax, lambda r: f"row softmax {r['dtype']}",
                                lambda r: f"{r['M']}x{r['N']}"), ["ours", "torch"],
         softmax_gbps, "GB/s (read + write)")]
    paths = []
    for name, panels, impls, value, unit in charts:
        if not panels:
            continue
        try:
            fig, axes = plt.subplots(len(panels), 1, squeeze=False, figsize=(
                max(8, 1.1 * max(len(p[0]) for p in panels.values())), 3.6 * len(panels)))
            width = 0.8 / len(impls)
            for ax, (title, (rs, labels)) in zip(axes[:, 0], panels.items()):
                values = []
                for j, impl in enumerate(impls):
                    vals = [value(r, impl) or 0.0 for r in rs]
                    values += vals
                    ax.bar([i + (j - (len(impls) - 1) / 2) * width for i in range(len(rs))], vals,
                           width, label=impl, color=COLORS[impl])
                if value is softmax_gbps and copy and copy.get("gbps"):
                    ax.axhline(copy["gbps"], color="gray", linestyle=":", label="tensor.copy_")
                if value is _rh_ratio:
                    ax.axhline(1.0, color="gray", linestyle=":")
                positive = [v for v in values if v > 0]
                if value is ms and positive and max(positive) / min(positive) > 20:
                    ax.set_yscale("log")
                ax.set_xticks(range(len(rs)), labels, fontsize=7)
                ax.set(ylabel=unit, title=title)
                ax.grid(axis="y", alpha=0.3)
                ax.legend(fontsize=8)
            fig.suptitle(f"epifuse {name[:-4]} -- {env.get('gpu')}, torch {env.get('torch')}, "
                         f"CUDA {env.get('cuda')}", fontsize=10)
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, name), dpi=100, bbox_inches="tight")
            plt.close(fig)
            paths.append(os.path.join(out_dir, name))
        except Exception as e:  # noqa: BLE001 -- a chart must never lose the numbers
            log(f"chart {name} failed: {type(e).__name__}: {e}")
    return paths


def write_markdown(doc: dict, path: str, log: Callable[[str], None]) -> list[str]:
    """The page at ``path``, its charts (with matplotlib) in ``<stem>-charts/`` beside it,
    replacing the charts an earlier run left there; the paths written."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    chart_dir = os.path.splitext(path)[0] + "-charts"
    for old in glob.glob(os.path.join(chart_dir, "*.png")):  # a page's charts are its run's
        os.remove(old)
    os.makedirs(chart_dir, exist_ok=True)
    charts = draw(chart_dir, doc, log)
    if not os.listdir(chart_dir):
        os.rmdir(chart_dir)
    text = markdown_report(doc, charts, path)
    lines = text.count("\n")
    if lines > PAGE_MAX_LINES:
        log(f"note: {path} has {lines} lines, more than the page's {PAGE_MAX_LINES}")
    with open(path, "w") as f:
        f.write(text)
    return [path] + charts


# --------------------------------------------------------------------------- a report again

def main(argv: Optional[list[str]] = None) -> int:
    """The text report of a bench.json on stdout, and its Markdown report to --markdown (charts,
    with matplotlib, into <name>-charts/ beside it, as ``python -m benchmarks --markdown``)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Write the report of a benchmark run's bench.json again, measuring nothing.")
    p.add_argument("bench_json", help="a bench.json written by python -m benchmarks")
    p.add_argument("--markdown", metavar="PATH", help="write the Markdown report to PATH "
                                                       "(e.g. BENCHMARKS.md)")
    args = p.parse_args(argv)
    with open(args.bench_json) as f:
        doc = json.load(f)
    if not doc.get("complete", True):
        print(f"note: {args.bench_json} is from a run that did not finish", file=sys.stderr)
    print(text_report(doc))
    if args.markdown:
        written = write_markdown(doc, args.markdown, lambda m: print(m, file=sys.stderr))
        print(f"wrote: {', '.join(written)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
