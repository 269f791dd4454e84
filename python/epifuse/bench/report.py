"""The results as an aligned text table, Markdown and JSON."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .configs import PROBLEM_NAMES, SWEEP_PROBLEM, TRAIN_STEP
from .hosttime import HostResult
from .kernels import CopyResult, SoftmaxResult
from .runner import CaseResult

# --------------------------------------------------------------------------- the device's words


def on_cuda(env: dict) -> bool:
    """Whether the run measured a GPU (else a CPU dry run: no CUDA events, no cuBLAS)."""
    return str(env.get("device") or "").startswith("cuda")


def timer_name(env: dict) -> str:
    return "CUDA-event" if on_cuda(env) else "time.perf_counter"


def mm_label(env: dict) -> str:
    """The baseline GEMM, torch.mm: cuBLAS on CUDA, the CPU BLAS in a dry run."""
    return "cuBLAS mm" if on_cuda(env) else "torch.mm (CPU)"


# --------------------------------------------------------------------------- formatting


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "n/a"
    if ms >= 100:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.3f}"
    return f"{ms:.4f}"


def fmt_x(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def fmt_num(x: Optional[float], digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def fmt_rate(x: Optional[float]) -> str:
    """TFLOP/s or GB/s: three significant figures or so."""
    if x is None:
        return "n/a"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def fmt_pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def fmt_err(stats) -> str:
    if stats is None:
        return "n/a"
    if not stats.finite:
        return "non-finite"
    return f"{stats.rel_fro:.1e} / {stats.max_abs:.1e}"


class Notes:
    """Numbered footnotes for failure messages and fallback reasons."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"[{i + 1}] {t}" for i, t in enumerate(self.items)]


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    left: int = 0  # the first `left` columns are left-aligned, the rest right-aligned

    def text(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]

        def line(cells):
            return "  ".join(c.ljust(w) if i < self.left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        out = [self.title, line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        return "\n".join(out)

    def markdown(self) -> str:
        def esc(c: str) -> str:
            return c.replace("|", "\\|")

        align = [":--" if i < self.left else "--:" for i in range(len(self.headers))]
        out = ["| " + " | ".join(esc(h) for h in self.headers) + " |",
               "|" + "|".join(align) + "|"]
        out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in self.rows]
        return "\n".join(out)


# --------------------------------------------------------------------------- tables


def _time_cell(r: CaseResult, impl: str, notes: Notes) -> str:
    if impl in r.timings:
        return fmt_ms(r.ms(impl))
    if impl in r.failures:
        msg = r.failures[impl]
        return "n/a " + notes.ref(msg if msg.startswith("not run") else f"{impl}: {msg}")
    return "n/a"


def _path_cell(r: CaseResult, notes: Notes) -> str:
    if r.path is None:
        return "-"
    if r.path == "fused":
        return "fused"
    return "reference " + notes.ref(f"ModelNew ran its reference path: {r.path}")


def _acc_cell(r: CaseResult, impl: str, notes: Notes) -> str:
    key = f"accuracy:{impl}"
    if key in r.failures:
        return "n/a " + notes.ref(f"error check of {impl}: {r.failures[key]}")
    return fmt_err(r.accuracy.get(impl))


MODEL_HEADERS = ["problem", "M x K -> N", "dtype", "mode", "ModelNew path", "ours ms", "TFLOP/s",
                 "eager ms", "compile ms", "vs eager", "vs compile", "vs KB ref",
                 "err ours (rel / max)", "err eager (rel / max)"]


def _timing_cells(r: CaseResult, notes: Notes) -> list[str]:
    """The cells every model table shares: path, times, rate and speed-ups."""
    return [_path_cell(r, notes),
            _time_cell(r, "ours", notes), fmt_rate(r.tflops("ours")),
            _time_cell(r, "eager", notes), _time_cell(r, "compile", notes),
            fmt_x(r.speedup("eager")), fmt_x(r.speedup("compile")), fmt_x(r.speedup("kb"))]


def _case_rows(results: Sequence[CaseResult], notes: Notes, head_of, error_cells,
               width: int) -> list[list[str]]:
    rows = []
    for r in results:
        head = head_of(r.case)
        if r.case.skip:
            rows.append(head + ["skipped " + notes.ref(r.case.skip)] + ["-"] * (width - 1))
        else:
            rows.append(head + _timing_cells(r, notes) + error_cells(r))
    return rows


def _case_head(c, with_mode: bool) -> list[str]:
    s = c.shape
    return [f"{s.problem} {PROBLEM_NAMES[s.problem]}", str(s), c.spec.name] + (
        [c.mode] if with_mode else [])


def model_rows(results: Sequence[CaseResult], notes: Notes) -> list[list[str]]:
    return _case_rows(results, notes, lambda c: _case_head(c, True),
                      lambda r: [_acc_cell(r, "ours", notes), _acc_cell(r, "eager", notes)], 10)


STEP_HEADERS = ["problem", "M x K -> N", "dtype", "ModelNew path", "ours ms", "TFLOP/s",
                "eager ms", "compile ms", "vs eager", "vs compile", "vs KB ref",
                "err dX ours (rel / max)", "err dX eager (rel / max)",
                "err dW ours (rel / max)", "err dW eager (rel / max)"]


def _grad_cell(r: CaseResult, impl: str, grad: str, notes: Notes) -> str:
    key = f"accuracy:{impl}"
    if key in r.failures:
        return "n/a " + notes.ref(f"gradient check of {impl}: {r.failures[key]}")
    return fmt_err(r.accuracy.get(f"{impl}:{grad}"))


def step_rows(results: Sequence[CaseResult], notes: Notes) -> list[list[str]]:
    """Training-step rows: the forward table's columns, with dX and dW errors for the output's."""
    return _case_rows(results, notes, lambda c: _case_head(c, False),
                      lambda r: [_grad_cell(r, "ours", "dx", notes),
                                 _grad_cell(r, "eager", "dx", notes),
                                 _grad_cell(r, "ours", "dw", notes),
                                 _grad_cell(r, "eager", "dw", notes)], 12)


HOST_HEADERS = ["problem", "M x K -> N", "dtype", "mode", "ours us", "eager us", "ours / eager",
                "GPU kept busy"]


def host_rows(results: Sequence[HostResult], notes: Notes) -> list[list[str]]:
    rows = []

    def t(r: HostResult, impl: str) -> str:
        if impl in r.timings:
            return fmt_num(r.us(impl), 1)
        if impl in r.failures:
            return "n/a " + notes.ref(f"host time of {impl}: {r.failures[impl]}")
        return "n/a"

    def busy(r: HostResult) -> str:
        flags = [t.gpu_kept_busy for t in r.timings.values()]
        if not flags or any(f is None for f in flags):
            return "-"  # the CPU dry run: no GPU to keep busy
        if all(flags):
            return "yes"
        return "no " + notes.ref("the GPU went idle during the calls in each of 3 attempts: the "
                                 "host time may include waiting for the GPU")

    for r in results:
        p, s = r.point, r.point.shape
        rows.append([f"{s.problem} {PROBLEM_NAMES[s.problem]}", str(s), p.spec.name, p.mode,
                     t(r, "ours"), t(r, "eager"), fmt_num(r.ratio(), 2), busy(r)])
    return rows


def gemm_rows(results: Sequence[CaseResult], notes: Notes) -> list[list[str]]:
    rows = []
    for r in results:
        if not r.case.gemm_alone or r.case.skip:
            continue
        c = r.case
        e2e_over = r.ms("ours") / r.ms("gemm") if r.ms("ours") and r.ms("gemm") else None
        rows.append([str(c.shape), c.spec.name, c.mode, r.gemm_op or "-",
                     _time_cell(r, "gemm", notes), fmt_rate(r.tflops("gemm")),
                     _time_cell(r, "torch_mm", notes), fmt_rate(r.tflops("torch_mm")),
                     _time_cell(r, "ours", notes), fmt_num(e2e_over, 2)])
    return rows


def gemm_headers(env: dict) -> list[str]:
    return ["M x K -> N", "dtype", "mode", "our GEMM op", "GEMM ms", "TFLOP/s",
            f"{mm_label(env)} ms", "TFLOP/s", "end-to-end ms", "end-to-end / GEMM"]

SOFTMAX_HEADERS = ["dtype", "N", "M", "ours ms", "ours GB/s", "of copy", "torch ms",
                   "torch GB/s", "of copy", "vs torch", "max err ours", "max err torch"]


def softmax_rows(results: Sequence[SoftmaxResult], notes: Notes) -> list[list[str]]:
    rows = []

    def t(r, impl):
        if impl in r.timings:
            return fmt_ms(r.timings[impl].median_ms)
        if impl in r.failures:
            return "n/a " + notes.ref(f"softmax {impl}: {r.failures[impl]}")
        return "n/a"

    def err(r, impl):
        s = r.accuracy.get(impl)
        return "n/a" if s is None else (f"{s.max_abs:.1e}" if s.finite else "non-finite")

    for r in results:
        rows.append([r.dtype, str(r.n), str(r.m),
                     t(r, "ours"), fmt_rate(r.gbps("ours")), fmt_pct(r.of_copy("ours")),
                     t(r, "torch"), fmt_rate(r.gbps("torch")), fmt_pct(r.of_copy("torch")),
                     fmt_x(r.speedup()), err(r, "ours"), err(r, "torch")])
    return rows


def split_sweep(results: Sequence[CaseResult]) -> tuple[list[CaseResult], list[CaseResult]]:
    """(the fixed-shape cases, the M-sweep cases incl. the fixed shape that lies on the sweep)."""
    main = [r for r in results if r.case.shape.tag != "sweep"]
    sweep = [r for r in results if r.case.shape.tag == "sweep"]
    if sweep:
        k, n = sweep[0].case.shape.k, sweep[0].case.shape.n
        on_line = [r for r in main if r.case.shape.problem == SWEEP_PROBLEM
                   and r.case.mode != TRAIN_STEP  # the sweep is of forwards
                   and (r.case.shape.k, r.case.shape.n) == (k, n)]
        sweep = sorted(sweep + on_line,
                       key=lambda r: (r.case.mode != "train", r.case.spec.name, r.case.shape.m))
    return main, sweep


def split_steps(results: Sequence[CaseResult]) -> tuple[list[CaseResult], list[CaseResult]]:
    """(the forward cases, the training-step cases), each in the given order."""
    return ([r for r in results if r.case.mode != TRAIN_STEP],
            [r for r in results if r.case.mode == TRAIN_STEP])


STEP_TITLE = "Training step (forward + backward): ModelNew vs PyTorch (median ms per step)"
HOST_TITLE = "Host time per forward (median us of CPU time per Python call)"


def build_tables(env: dict, results, softmax, copy: Optional[CopyResult],
                 host: Sequence[HostResult] = ()) -> tuple[list[Table], Notes]:
    notes = Notes()
    main, sweep = split_sweep(results)
    forwards, steps = split_steps(main)
    tables = []
    if forwards:
        tables.append(Table("ModelNew vs PyTorch (median ms per forward)", MODEL_HEADERS,
                            model_rows(forwards, notes), left=5))
    if steps:
        tables.append(Table(STEP_TITLE, STEP_HEADERS, step_rows(steps, notes), left=4))
    if host:
        tables.append(Table(HOST_TITLE, HOST_HEADERS, host_rows(host, notes), left=4))
    if sweep:
        tables.append(Table(f"M sweep, problem {SWEEP_PROBLEM}", MODEL_HEADERS,
                            model_rows(sweep, notes), left=5))
    g = gemm_rows(results, notes)
    if g:
        tables.append(Table("Our GEMM alone (KernelBench shapes)", gemm_headers(env), g,
                            left=4))
    if softmax:
        title = "Row softmax: epifuse affine_softmax vs torch.softmax"
        if copy is not None:
            title += f" (copy bandwidth {copy_line(copy)})"
        tables.append(Table(title, SOFTMAX_HEADERS, softmax_rows(softmax, notes), left=1))
    return tables, notes


def host_line(r: HostResult) -> str:
    """One progress line: both host times and their ratio."""
    parts = [f"{impl} {fmt_num(r.us(impl), 1)} us" if impl in r.timings
             else f"{impl} failed" for impl in ("ours", "eager")]
    return ", ".join(parts) + f" (ours / eager {fmt_num(r.ratio(), 2)})"


def copy_line(copy: CopyResult) -> str:
    if copy.gbps is None:
        return f"n/a: {copy.failure}"
    return (f"{copy.gbps:.0f} GB/s: {copy.nbytes / 2 / 2**20:.0f} MiB tensor.copy_, "
            "bytes read + written")


# --------------------------------------------------------------------------- outputs


def text_report(env: dict, results, softmax, copy, host: Sequence[HostResult] = ()) -> str:
    tables, notes = build_tables(env, results, softmax, copy, host)
    head = (f"epifuse benchmark -- {env.get('gpu')} | torch {env.get('torch')} | "
            f"CUDA {env.get('cuda')} | {env.get('date')}")
    parts = [head, ""]
    for t in tables:
        parts += [t.text(), ""]
    if notes.items:
        parts += ["Notes:", *notes.lines(), ""]
    parts.append(legend(env, results, host))
    return "\n".join(parts)


STEP_LEGEND = (
    "Training step = one training-mode forward + backward per timed call: x requires grad "
    "(dX is computed, as for a head inside a network), all parameters require grad, and their "
    "gradients (and x's) are set to None before each step; the upstream gradient is a fixed "
    "random g per input, applied as y.backward(g) (the gradients of (y * g).sum(), without "
    "timing that stand-in loss). Its TFLOP/s count 3 GEMMs (forward, dX, dW); 'vs KB ref' "
    "divides eager fp32-ieee's step. err dX / err dW = the input's and gemm.weight's gradients "
    "against a float64 step with the same (rounded) parameters, x and g.")


def host_legend(env: dict) -> str:
    if on_cuda(env):
        how = ("time.perf_counter around each Python call of a forward (under torch.no_grad()) "
               "while a spin kernel queued ahead keeps the GPU busy, so calls only queue their "
               "kernels: host time (Python, dispatch, allocation, launches), no GPU time; "
               "median over rounds of back-to-back calls after warm-up")
    else:
        how = "time.perf_counter around whole CPU calls (dry run: no GPU)"
    return f"Host time: {how}."


def legend(env: dict, results: Sequence[CaseResult], host: Sequence[HostResult] = ()) -> str:
    """The footer; names only what this run measured (a CPU dry run has no CUDA events)."""
    compiled = any(r.case.compile for r in results)
    impls = "ours = ModelNew (epifuse); eager = reference Model"
    impls += ("; compile = torch.compile(Model), default mode" if compiled
              else "; torch.compile not timed (--no-compile)")
    text = (f"{impls}. Times: median of {timer_name(env)} timings after warm-up, inputs "
            "rotated; the implementations of a row are timed in 3 interleaved rounds. TFLOP/s = 2*M*N*K / time. 'vs KB ref' = eager fp32 with TF32 off (the "
            "KernelBench reference) / ours. err = ||out - ref64|| / ||ref64|| and max "
            "|out - ref64| against a float64 forward of the same (rounded) parameters and input.")
    if any(r.case.mode == TRAIN_STEP for r in results):
        text += " " + STEP_LEGEND
    if host:
        text += " " + host_legend(env)
    return text


def markdown_report(env: dict, settings: dict, results, softmax, copy,
                    charts: Sequence[str] = (), md_path: Optional[str] = None,
                    host: Sequence[HostResult] = ()) -> str:
    tables, notes = build_tables(env, results, softmax, copy, host)
    lines = ["# epifuse benchmark", ""]
    lines += [
        f"- GPU: **{env.get('gpu')}**"
        + (f" ({env['capability']}, {env.get('sm_count')} SMs, {env.get('gpu_memory_gib')} GiB, "
           f"driver {env.get('driver') or 'unknown'})" if env.get("capability") else ""),
        f"- PyTorch {env.get('torch')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
        f"- Date: {env.get('date')}"
        + (f" (with results reused from a run on {env['resumed_from']})"
           if env.get("resumed_from") else "")
        + (f", epifuse commit `{env['git_commit']}`" if env.get("git_commit") else ""),
        "- Command" + ("s (in this order; later ones reused the earlier results):"
                       if len(env.get("commands") or []) > 1 else ":"),
        "", "  ```", *(f"  {c}" for c in (env.get("commands") or [env.get("command")])),
        "  ```", "",
    ]
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
        "falls on all of them. fp32 rows: `fp32-ieee` = TF32 "
        "off "
        "(`torch.set_float32_matmul_precision('highest')`, `ModelNew(precision='ieee')`), "
        "`fp32-3xtf32` = ours in 3xTF32 (`precision='3xtf32'`) against PyTorch in IEEE fp32, "
        "`fp32-tf32` = TF32 on for both (`'high'` / `precision='tf32'`). All implementations "
        "hold identical parameters; eval uses running statistics primed from one batch. "
        "In train mode every call updates the running statistics; the error check runs on fresh "
        "copies with identical state.",
        "",
    ]
    for t in tables:
        lines += [f"## {t.title}", "", t.markdown(), ""]
    if notes.items:
        lines += ["Notes:", ""] + [f"{n}  " for n in notes.lines()] + [""]
    lines += [legend(env, results, host), ""]
    for chart in charts:
        target = chart
        if md_path:
            target = os.path.relpath(os.path.abspath(chart),
                                     os.path.dirname(os.path.abspath(md_path)))
        lines += [f"![{os.path.basename(chart)}]({target})", ""]
    return "\n".join(lines)


def _clean(obj):
    """JSON-safe: NaN/inf become strings (strict JSON has neither)."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def json_report(env: dict, settings: dict, results, softmax, copy, complete: bool = True,
                host: Sequence[HostResult] = ()) -> str:
    doc = {
        "complete": complete,
        "env": env,
        "settings": settings,
        "cases": [r.to_dict() for r in results],
        "host_time": [r.to_dict() for r in host],
        "softmax": [r.to_dict() for r in softmax],
        "copy_bandwidth": copy.to_dict() if copy is not None else None,
    }
    return json.dumps(_clean(doc), indent=2)
