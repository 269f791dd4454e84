"""The report: text and Markdown tables from bench.json's rows, the legend, the environment, and
the PNG charts (matplotlib, optional).

``python -m benchmarks.report BENCH_JSON --markdown PATH`` writes the report of a bench.json again
without measuring anything (e.g. BENCHMARKS.md from a GPU run's bench.json, on another machine).

Table columns are lists of (header, cell) pairs: a column the next measurements add is one more
pair in ``MODEL_COLUMNS`` (as the peak memory per implementation was). Rows of the autocast columns
(amp-bf16, amp-fp16) get tables of their own, after the forwards' and the steps'.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Callable, Optional, Sequence

import torch

from .cases import DTYPES, PROBLEM_NAMES, SWEEP_PROBLEM, TRAIN_STEP

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
FORWARD_ERRORS = [("err ours (rel / max)", _err("ours", "ours", "error check")),
                  ("err eager (rel / max)", _err("eager", "eager", "error check"))]
STEP_ERRORS = [(f"err {g} {impl} (rel / max)", _err(impl, f"{impl}:{g.lower()}", "gradient check"))
               for g in ("dX", "dW") for impl in ("ours", "eager")]


def _model_table(rows: Sequence[dict], notes: Notes, step: bool) -> tuple[list, list, int]:
    columns = MODEL_COLUMNS + (STEP_ERRORS if step else FORWARD_ERRORS)
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


FORWARD_TITLE = "ModelNew vs PyTorch (median ms per forward)"
STEP_TITLE = "Training step (forward + backward): ModelNew vs PyTorch (median ms per step)"
AMP_FORWARD_TITLE = ("Autocast forwards (fp32 parameters and inputs under torch.autocast): "
                     "ModelNew vs PyTorch, median ms per forward")
AMP_STEP_TITLE = ("Autocast training steps (forward under torch.autocast, backward after it): "
                  "ModelNew vs PyTorch, median ms per step")
HOST_TITLE = "Host time per forward (median us of CPU time per Python call)"


def tables(env: dict, rows, softmax, copy, host=()) -> tuple[list[tuple], Notes]:
    """[(title, headers, cells, left)], and the notes they refer to."""
    notes = Notes()
    forwards, steps, sweep = split(rows)
    out = []
    for title, part, step in ((FORWARD_TITLE, forwards, False), (STEP_TITLE, steps, True),
                              (AMP_FORWARD_TITLE, forwards, False), (AMP_STEP_TITLE, steps, True)):
        part = [r for r in part if is_autocast(r) == title.startswith("Autocast")]
        if part:
            out.append((title, *_model_table(part, notes, step)))
    if host:
        out.append((HOST_TITLE, *_host_table(host, notes)))
    if sweep:
        out.append((f"M sweep, problem {SWEEP_PROBLEM}", *_model_table(sweep, notes, False)))
    gemm = _gemm_table(rows, notes, env)
    if gemm[1]:
        out.append(("Our GEMM alone (KernelBench shapes)", *gemm))
    if softmax:
        title = "Row softmax: epifuse affine_softmax vs torch.softmax"
        if copy is not None:
            title += f" (copy bandwidth {copy_line(copy)})"
        out.append((title, *_softmax_table(softmax, notes, copy)))
    return out, notes


def copy_line(copy: dict) -> str:
    if copy.get("gbps") is None:
        return f"n/a: {copy.get('failure')}"
    return (f"{copy['gbps']:.0f} GB/s: {copy['bytes_read_plus_written'] / 2 / 2**20:.0f} MiB "
            "tensor.copy_, bytes read + written")


# --------------------------------------------------------------------------- documents

def on_cuda(env: dict) -> bool:
    """Whether the run measured a GPU (else a CPU dry run: no CUDA events, no cuBLAS)."""
    return str(env.get("device") or "").startswith("cuda")


def timer_name(env: dict) -> str:
    return "CUDA-event" if on_cuda(env) else "time.perf_counter"


def mm_label(env: dict) -> str:
    return "cuBLAS mm" if on_cuda(env) else "torch.mm (CPU)"


STEP_LEGEND = (
    "Training step = one training-mode forward + backward per timed call: x requires grad "
    "(dX is computed, as for a head inside a network), all parameters require grad, and their "
    "gradients (and x's) are set to None before each step; the upstream gradient is a fixed "
    "random g per input, applied as y.backward(g) (the gradients of (y * g).sum(), without "
    "timing that stand-in loss); each step first bumps every parameter's version counter "
    "(torch.autograd.graph.increment_version: no kernel), as an optimizer's in-place update "
    "would, so that no implementation reuses a cast or split of a weight that in training "
    "changes every step (ModelNew keeps those only while the weight is unchanged). Its TFLOP/s "
    "count 3 GEMMs (forward, dX, dW); 'vs KB ref' "
    "divides eager fp32-ieee's step. err dX / err dW = the input's and gemm.weight's gradients "
    "against a float64 step with the same (rounded) parameters, x and g.")


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


def legend(env: dict, rows: Sequence[dict], host=()) -> str:
    """The footer; names only what this run measured (a CPU dry run has no CUDA events)."""
    impls = "ours = ModelNew (epifuse); eager = reference Model" + (
        "; compile = torch.compile(Model), default mode" if any(r["compile_timed"] for r in rows)
        else "; torch.compile not timed (--no-compile)")
    text = (f"{impls}. Times: median of {timer_name(env)} timings after warm-up, inputs "
            "rotated; the implementations of a row are timed in 3 interleaved rounds. TFLOP/s = "
            "2*M*N*K / time. 'vs KB ref' = eager fp32 with TF32 off (the KernelBench reference) / "
            "ours. err = ||out - ref64|| / ||ref64|| and max |out - ref64| against a float64 "
            "forward of the same (rounded) parameters and input.")
    if any(r["mode"] == TRAIN_STEP for r in rows):
        text += " " + STEP_LEGEND
    if any(is_autocast(r) for r in rows):
        text += " " + AMP_LEGEND.format(device="cuda" if on_cuda(env) else "cpu")
    text += " " + (MEMORY_LEGEND if on_cuda(env) else
                   "peak MiB: measured on CUDA only (n/a in a CPU dry run).")
    if host:
        how = ("time.perf_counter around each Python call of a forward (under torch.no_grad()) "
               "while a spin kernel queued ahead keeps the GPU busy, so calls only queue their "
               "kernels: host time (Python, dispatch, allocation, launches), no GPU time; median "
               "over rounds of back-to-back calls after warm-up" if on_cuda(env)
               else "time.perf_counter around whole CPU calls (dry run: no GPU)")
        text += f" Host time: {how}."
    return text


def text_report(env: dict, rows, softmax, copy, host=()) -> str:
    ts, notes = tables(env, rows, softmax, copy, host)
    parts = [f"epifuse benchmark -- {env.get('gpu')} | torch {env.get('torch')} | CUDA "
             f"{env.get('cuda')} | {env.get('date')}", ""]
    for title, headers, cells, left in ts:
        parts += [title, table(headers, cells, left, markdown=False), ""]
    if notes.items:
        parts += ["Notes:", *(f"[{i + 1}] {t}" for i, t in enumerate(notes.items)), ""]
    return "\n".join(parts + [legend(env, rows, host)])


def markdown_report(env: dict, settings: dict, rows, softmax, copy, charts: Sequence[str] = (),
                    md_path: Optional[str] = None, host=()) -> str:
    ts, notes = tables(env, rows, softmax, copy, host)
    commands = env.get("commands") or [env.get("command")]
    lines = [
        "# epifuse benchmark", "",
        f"- GPU: **{env.get('gpu')}**" + (
            f" ({env['capability']}, {env.get('sm_count')} SMs, {env.get('gpu_memory_gib')} GiB, "
            f"driver {env.get('driver') or 'unknown'})" if env.get("capability") else ""),
        f"- PyTorch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
        f"- Date: {env.get('date')}"
        + (f" (with results reused from a run on {env['resumed_from']})"
           if env.get("resumed_from") else "")
        + (f", epifuse commit `{env['git_commit']}`" if env.get("git_commit") else ""),
        "- Command" + ("s (in this order; later ones reused the earlier results):"
                       if len(commands) > 1 else ":"),
        "", "  ```", *(f"  {c}" for c in commands), "  ```", ""]
    if settings.get("dry_run"):
        lines += ["**Dry run on the CPU at tiny sizes (`--device cpu`): the timings only test "
                  "the benchmark's plumbing.**", ""]
    lines += [
        "Method: forward passes under `torch.no_grad()` (training steps: forward + backward "
        "with autograd, see below); each time is the median of "
        f"{settings.get('iters')} (or fewer for slow calls, at least {settings.get('min_iters')}) "
        f"{timer_name(env)} timings after {settings.get('warmup')} warm-up calls, cycling several "
        "distinct inputs so that the activations do not stay in L2; ours, eager and compile take "
        "turns in 3 rounds of a third of the calls each, so that a slow spell of the machine "
        "falls on all of them. fp32 rows: `fp32-ieee` = TF32 off "
        "(`torch.set_float32_matmul_precision('highest')`, `ModelNew(precision='ieee')`), "
        "`fp32-3xtf32` = ours in 3xTF32 (`precision='3xtf32'`) against PyTorch in IEEE fp32, "
        "`fp32-tf32` = TF32 on for both (`'high'` / `precision='tf32'`). All implementations "
        "hold identical parameters; eval uses running statistics primed from one batch. "
        "In train mode every call updates the running statistics; the error check runs on fresh "
        "copies with identical state.", ""]
    for title, headers, cells, left in ts:
        lines += [f"## {title}", "", table(headers, cells, left, markdown=True), ""]
    if notes.items:
        lines += ["Notes:", ""] + [f"[{i + 1}] {t}  " for i, t in enumerate(notes.items)] + [""]
    lines += [legend(env, rows, host), ""]
    for chart in charts:
        target = chart if not md_path else os.path.relpath(
            os.path.abspath(chart), os.path.dirname(os.path.abspath(md_path)))
        lines += [f"![{os.path.basename(chart)}]({target})", ""]
    return "\n".join(lines)


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
                     "driver": driver.splitlines()[0] if driver else None})
    else:
        info["gpu"] = f"none (CPU dry run: {platform.processor() or platform.machine()})"
    import epifuse
    from epifuse._library import build_info

    build = build_info()  # the library's own record: its commit may predate git_commit's
    info.update({"epifuse_version": epifuse.__version__,
                 "epifuse_build": build.summary() if build else None,
                 "epifuse_cuda_kernels": epifuse.ops.has_cuda_kernels(),
                 "epifuse_path": os.path.dirname(epifuse.__file__)})
    return info


# --------------------------------------------------------------------------- charts

COLORS = {"ours": "#1f77b4", "eager": "#ff7f0e", "compile": "#2ca02c", "torch": "#ff7f0e"}


def impls_drawn(rows: Sequence[dict]) -> list[str]:
    """ours and eager always; compile only where it was timed (not under --no-compile)."""
    return ["ours", "eager"] + (["compile"] if any(r["compile_timed"] for r in rows) else [])


def _panels(rows, key, label) -> dict:
    out: dict = {}
    for r in rows:
        if not r.get("skipped"):
            out.setdefault(key(r), []).append(r)
    return {k: (v, [label(r) for r in v]) for k, v in out.items()}


def draw(out_dir: str, env: dict, rows, softmax, copy, log: Callable[[str], None]) -> list[str]:
    """bench.png, bench-train-step.png, bench-sweep.png and softmax.png (those with data) in
    ``out_dir``: grouped bars, a panel per shape (sweep: per dtype and mode; softmax: per dtype);
    [] with a message without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed, so no chart was drawn (pip install matplotlib)")
        return []
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
        ("softmax.png", _panels(softmax, lambda r: f"row softmax {r['dtype']}",
                                lambda r: f"{r['M']}x{r['N']}"), ["ours", "torch"],
         softmax_gbps, "GB/s (read + write)")]
    paths = []
    for name, panels, impls, value, unit in charts:
        if not panels:
            continue
        try:
            fig, axes = plt.subplots(len(panels), 1, squeeze=False, figsize=(
                max(8, 1.3 * max(len(p[0]) for p in panels.values())), 3.6 * len(panels)))
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
                positive = [v for v in values if v > 0]
                if value is ms and positive and max(positive) / min(positive) > 20:
                    ax.set_yscale("log")
                ax.set_xticks(range(len(rs)), labels, fontsize=8)
                ax.set(ylabel=unit, title=title)
                ax.grid(axis="y", alpha=0.3)
                ax.legend(fontsize=8)
            fig.suptitle(f"epifuse {name[:-4]} -- {env.get('gpu')}, torch {env.get('torch')}, "
                         f"CUDA {env.get('cuda')}", fontsize=10)
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, name), dpi=110, bbox_inches="tight")
            plt.close(fig)
            paths.append(os.path.join(out_dir, name))
        except Exception as e:  # noqa: BLE001 -- a chart must never lose the numbers
            log(f"chart {name} failed: {type(e).__name__}: {e}")
    return paths


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
    env, rows, host = doc["env"], doc["cases"], doc.get("host_time") or []
    softmax, copy = doc.get("softmax") or [], doc.get("copy_bandwidth")
    if not doc.get("complete", True):
        print(f"note: {args.bench_json} is from a run that did not finish", file=sys.stderr)
    print(text_report(env, rows, softmax, copy, host))
    if args.markdown:
        path = os.path.abspath(args.markdown)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        chart_dir = os.path.splitext(path)[0] + "-charts"
        os.makedirs(chart_dir, exist_ok=True)
        charts = draw(chart_dir, env, rows, softmax, copy, lambda m: print(m, file=sys.stderr))
        if not os.listdir(chart_dir):
            os.rmdir(chart_dir)
        with open(path, "w") as f:
            f.write(markdown_report(env, doc.get("settings") or {}, rows, softmax, copy, charts,
                                    path, host))
        print(f"wrote: {', '.join([args.markdown] + charts)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
