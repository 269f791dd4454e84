"""One model configuration: accuracy on fresh copies, then timings of each implementation.

Implementations of a configuration:
  ours     ModelNew(precision=spec.precision)          (epifuse fused forward)
  eager    Model                                          (PyTorch eager, same dtype / matmul policy)
  compile  torch.compile(Model), default mode             (compile errors are reported, not raised)
On the KernelBench shapes also (forward modes only):
  gemm     our GEMM op alone (gemm_colstats in train, gemm_affine in eval)
  torch_mm torch.mm(x, W.T) under the same matmul policy (cuBLAS on CUDA)
ours, eager and compile are timed in interleaved rounds (timing.measure_rounds), so that a slow
spell of the machine falls on all three alike.
The "train" and "eval" modes time forwards under torch.no_grad(); "train-step" times a
training-mode forward plus its backward (see training.py) and checks the gradients of the
input and of the Linear weight instead of the output.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from epifuse import ops
from epifuse.head import fast_path_reason
from epifuse.precision import resolve_precision

from . import models, training
from .accuracy import ErrorStats, error_stats
from .configs import DTYPES, KB_REFERENCE, TRAIN_STEP, Case, Shape
from .timing import Timing, TimingSettings, measure, measure_rounds, rotation_count

IMPLS = ("ours", "eager", "compile")


@dataclass
class CaseResult:
    case: Case
    path: Optional[str] = None  # "fused", or why ModelNew ran its reference path
    timings: dict[str, Timing] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # impl -> error (or why not run)
    accuracy: dict[str, ErrorStats] = field(default_factory=dict)
    kb_reference_ms: Optional[float] = None  # eager fp32-ieee, same shape and mode
    gemm_op: Optional[str] = None
    wall_s: float = 0.0

    def ms(self, impl: str) -> Optional[float]:
        t = self.timings.get(impl)
        return t.median_ms if t is not None else None

    def speedup(self, baseline: str) -> Optional[float]:
        ours = self.ms("ours")
        base = self.kb_reference_ms if baseline == "kb" else self.ms(baseline)
        return base / ours if ours and base else None

    @property
    def flops(self) -> float:
        """GEMM FLOPs of one timed call: a step adds the backward's dX and dW GEMMs."""
        return self.case.shape.flops * (3 if self.case.mode == TRAIN_STEP else 1)

    def tflops(self, impl: str = "ours") -> Optional[float]:
        ms = self.ms(impl)
        if ms and impl in ("gemm", "torch_mm"):  # forward GEMMs alone
            return self.case.shape.flops / (ms * 1e-3) / 1e12
        return self.flops / (ms * 1e-3) / 1e12 if ms else None

    def to_dict(self) -> dict:
        c, s = self.case, self.case.shape
        return {
            "problem": s.problem, "tag": s.tag, "M": s.m, "K": s.k, "N": s.n,
            "dtype": c.spec.name, "torch_dtype": str(c.spec.dtype).removeprefix("torch."),
            "modelnew_precision": c.spec.precision, "torch_matmul_precision": c.spec.torch_precision,
            "mode": c.mode, "skipped": c.skip, "path": self.path,
            "compile_timed": c.compile, "compile_note": c.compile_note,
            "gemm_alone": c.gemm_alone,
            "flops": self.flops,
            "timings_ms": {k: v.to_dict() for k, v in self.timings.items()},
            "failures": dict(self.failures),
            "tflops": {k: self.tflops(k) for k in self.timings},
            "speedup_vs_eager": self.speedup("eager"),
            "speedup_vs_compile": self.speedup("compile"),
            "kb_reference_ms": self.kb_reference_ms,
            "speedup_vs_kb_reference": self.speedup("kb"),
            "gemm_op": self.gemm_op,
            "e2e_over_gemm": (self.ms("ours") / self.ms("gemm")
                              if self.ms("ours") and self.ms("gemm") else None),
            "errors_vs_fp64": {k: v.to_dict() for k, v in self.accuracy.items()},
            "wall_s": round(self.wall_s, 2),
        }


def describe(exc: BaseException) -> str:
    """One line for the table: the exception type and the first line of its message."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")
    return text if len(text) <= 160 else text[:157] + "..."


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class KBReference:
    """Eager fp32-ieee times (the KernelBench reference) by (shape, mode)."""

    def __init__(self) -> None:
        self._ms: dict[tuple, Optional[float]] = {}

    @staticmethod
    def key(shape: Shape, mode: str) -> tuple:
        return (shape.problem, shape.m, shape.k, shape.n, mode)

    def get(self, shape: Shape, mode: str) -> Optional[float]:
        return self._ms.get(self.key(shape, mode))

    def known(self, shape: Shape, mode: str) -> bool:
        return self.key(shape, mode) in self._ms

    def set(self, shape: Shape, mode: str, ms: Optional[float]) -> None:
        self._ms[self.key(shape, mode)] = ms


def _attempt(result: CaseResult, impl: str, fn: Callable[[], Timing], device: torch.device,
             log: Callable[[str], None], verbose: bool) -> None:
    try:
        result.timings[impl] = fn()
    except Exception as e:  # noqa: BLE001 -- any failure becomes a table entry
        _failed(result, impl, e, log, verbose)
    finally:
        free_memory(device)


def _accuracy(case: Case, state: dict, device: torch.device, result: CaseResult,
              log: Callable[[str], None], verbose: bool) -> None:
    """Errors against a float64 twin for ours and eager, each a fresh copy of the same state: of
    the forward's output (accuracy key "<impl>"), or of a training step's dX and dW ("<impl>:dx",
    "<impl>:dw")."""
    shape, spec = case.shape, case.spec
    try:
        errors_of = (_step_errors if case.mode == TRAIN_STEP else _forward_errors)(
            case, state, device)
    except Exception as e:  # noqa: BLE001
        for impl in ("ours", "eager"):
            result.failures[f"accuracy:{impl}"] = f"fp64 reference failed: {describe(e)}"
        log(f"  {case.label}: fp64 reference failed: {describe(e)}")
        free_memory(device)
        return
    for impl in ("ours", "eager"):
        try:
            with spec.torch_settings():
                model = models.build(shape, state, new=impl == "ours", dtype=spec.dtype,
                                     device=device, mode=case.mode,
                                     precision=spec.precision if impl == "ours" else None)
                result.accuracy.update(errors_of(model, impl))
            del model
        except Exception as e:  # noqa: BLE001
            result.failures[f"accuracy:{impl}"] = describe(e)
            log(f"  {case.label}: accuracy of {impl} failed: {describe(e)}")
            if verbose:
                log(traceback.format_exc())
        free_memory(device)
    del errors_of
    free_memory(device)


def _step_errors(case: Case, state: dict, device: torch.device):
    """A float64 training step's gradients, and how to measure a model's dX and dW against them."""
    shape, spec = case.shape, case.spec
    pair = training.make_step_inputs(shape, spec.dtype, device, 1, seed=models.SEED + 100)[0]
    ref = training.reference_gradients(shape, state, pair, dtype=spec.dtype, device=device,
                                       mode=case.mode)
    return lambda model, impl: {f"{impl}:{k}": v
                                for k, v in training.step_errors(model, pair, ref).items()}


def _forward_errors(case: Case, state: dict, device: torch.device):
    """A float64 forward's output, and how to measure a model's output against it."""
    shape, spec = case.shape, case.spec
    x = models.make_inputs(shape, spec.dtype, device, 1, seed=models.SEED + 100)[0]
    with torch.no_grad():
        y64 = models.build_reference64(shape, state, dtype=spec.dtype, device=device,
                                       mode=case.mode)(x.to(torch.float64))

    @torch.no_grad()
    def errors(model, impl):
        return {impl: error_stats(model(x), y64)}
    return errors


def _callable(case: Case, state: dict, device: torch.device, *, new: bool,
              compiled: bool = False, spec=None) -> Callable:
    """What one timed call runs: a forward of the model (or of its torch.compile wrapper), or a
    training step of it."""
    spec = spec or case.spec
    model = models.build(case.shape, state, new=new, dtype=spec.dtype, device=device,
                         mode=case.mode, precision=spec.precision if new else None)
    fn = model
    if compiled:
        torch._dynamo.reset()  # a fresh cache: no recompile limit, no stale matmul policy
        fn = torch.compile(model)
    return training.make_step(model, fn) if case.mode == TRAIN_STEP else fn


def _timing_scope(case: Case, spec=None):
    """The matmul policy of the case's dtype column; autograd off for the forward modes."""
    spec = spec or case.spec
    stack = contextlib.ExitStack()
    stack.enter_context(spec.torch_settings())
    if case.mode != TRAIN_STEP:
        stack.enter_context(torch.no_grad())
    return stack


def _time_impls(case: Case, state: dict, inputs: list, device: torch.device,
                settings: TimingSettings, result: CaseResult, log: Callable[[str], None],
                verbose: bool) -> None:
    """ours, eager and (if planned) compile, timed in interleaved rounds (timing.measure_rounds)."""
    fns: dict[str, Callable] = {}
    for impl in IMPLS:
        if impl == "compile" and not case.compile:
            result.failures["compile"] = case.compile_note or "not run"
            continue
        try:
            fns[impl] = _callable(case, state, device, new=impl == "ours",
                                  compiled=impl == "compile")
        except Exception as e:  # noqa: BLE001 -- any failure becomes a table entry
            _failed(result, impl, e, log, verbose)
    with _timing_scope(case):  # measure_rounds returns each implementation's failure
        timings = measure_rounds(fns, inputs, device, settings)
    for impl, t in timings.items():
        if isinstance(t, Exception):
            _failed(result, impl, t, log, verbose)
        else:
            result.timings[impl] = t
    del fns, timings
    if case.compile:
        torch._dynamo.reset()
    free_memory(device)


def _failed(result: CaseResult, impl: str, e: BaseException, log: Callable[[str], None],
            verbose: bool) -> None:
    result.failures[impl] = describe(e)
    log(f"  {result.case.label}: {impl} failed: {describe(e)}")
    if verbose:
        log("".join(traceback.format_exception(e)))


def _time_kb_reference(case: Case, state: dict, device: torch.device,
                       settings: TimingSettings) -> Timing:
    """Eager fp32-ieee on the case's shape and mode (when fp32-ieee is not in the plan)."""
    spec = DTYPES[KB_REFERENCE]
    inputs = _timing_inputs(case, spec.dtype, device, seed=models.SEED + 200)
    try:
        fn = _callable(case, state, device, new=False, spec=spec)
        with _timing_scope(case, spec):
            return measure(fn, inputs, device, settings)
    finally:
        del inputs


def _timing_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    """Enough distinct inputs (with their upstream gradients for a step) to rotate out of L2."""
    esize = torch.empty((), dtype=dtype).element_size()
    if case.mode == TRAIN_STEP:
        count = rotation_count(training.step_bytes(case.shape, esize), device)
        return training.make_step_inputs(case.shape, dtype, device, count, seed=seed)
    count = rotation_count(case.shape.m * case.shape.k * esize, device)
    return models.make_inputs(case.shape, dtype, device, count, seed=seed)


def _time_gemm(case: Case, state: dict, inputs: list, device: torch.device,
               settings: TimingSettings, result: CaseResult, log, verbose) -> None:
    spec = case.spec
    n = case.shape.n
    weight = state["gemm.weight"].to(spec.dtype).contiguous()
    gen = torch.Generator(device=device).manual_seed(models.SEED + 300)
    a = torch.rand(n, generator=gen, device=device) + 0.5
    c = torch.randn(n, generator=gen, device=device) * 0.1
    prec = resolve_precision(spec.precision, spec.dtype)
    if case.mode == "train":
        result.gemm_op = "gemm_colstats"
        op = lambda x: ops.gemm_colstats(x, weight, prec)  # noqa: E731
    else:
        result.gemm_op = "gemm_affine"
        op = lambda x: ops.gemm_affine(x, weight, a, c, prec)  # noqa: E731

    def run(fn):
        def timed():
            with _timing_scope(case):  # a forward mode: gemm_alone is never set for a step
                return measure(fn, inputs, device, settings)
        return timed

    _attempt(result, "gemm", run(op), device, log, verbose)
    _attempt(result, "torch_mm", run(lambda x: torch.mm(x, weight.t())), device, log, verbose)


def run_case(case: Case, state: dict, device: torch.device, settings: TimingSettings,
             kb: KBReference, log: Callable[[str], None], verbose: bool = False) -> CaseResult:
    result = CaseResult(case)
    if case.skip:
        return result
    t0 = time.perf_counter()
    shape, spec = case.shape, case.spec

    _accuracy(case, state, device, result, log, verbose)

    inputs = []
    try:
        inputs = _timing_inputs(case, spec.dtype, device, seed=models.SEED + 1000)
        model_new = models.build(shape, state, new=True, dtype=spec.dtype, device=device,
                                 mode=case.mode, precision=spec.precision)
        x0 = inputs[0][0] if case.mode == TRAIN_STEP else inputs[0]
        reason = fast_path_reason(model_new, x0)
        result.path = "fused" if reason is None else reason
        del model_new
    except Exception as e:  # noqa: BLE001 -- e.g. out of memory for the inputs
        for impl in IMPLS:
            result.failures[impl] = describe(e)
        log(f"  {case.label}: set-up failed: {describe(e)}")
        free_memory(device)
        result.wall_s = time.perf_counter() - t0
        return result

    _time_impls(case, state, inputs, device, settings, result, log, verbose)
    if case.gemm_alone:
        _time_gemm(case, state, inputs, device, settings, result, log, verbose)
    inputs.clear()  # the closures above hold the list; empty it to free the tensors
    free_memory(device)

    if spec.name == KB_REFERENCE:
        kb.set(shape, case.mode, result.ms("eager"))
    elif not kb.known(shape, case.mode):
        try:
            kb.set(shape, case.mode, _time_kb_reference(case, state, device, settings).median_ms)
        except Exception as e:  # noqa: BLE001
            kb.set(shape, case.mode, None)
            log(f"  {case.label}: KernelBench reference (eager fp32-ieee) failed: {describe(e)}")
        free_memory(device)
    result.kb_reference_ms = kb.get(shape, case.mode)
    result.wall_s = time.perf_counter() - t0
    return result
