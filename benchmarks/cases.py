"""What the benchmark runs on the KernelBench problems, and running one configuration.

A configuration (``Case``) is a shape, a dtype column and a mode. Its implementations:
  ours     ModelNew(precision=spec.precision)      (epifuse)
  eager    Model                                     (PyTorch eager, same dtype / matmul policy)
  compile  torch.compile(Model), default mode        (compile errors are reported, not raised)
On the KernelBench shapes' forwards also ``gemm`` (our GEMM op alone: gemm_colstats in train,
gemm_affine in eval) and ``torch_mm`` (torch.mm(x, W.T), cuBLAS on CUDA). All are built from one
seeded state_dict with running statistics primed from one batch, so parameters match exactly.
"train"/"eval" time forwards under torch.no_grad(); "train-step" times a training-mode forward
plus its backward: x requires grad, gradients are set to None and the parameters' versions bumped
before each step (as an optimizer's update would), and the upstream gradient is a fixed random g
per input, applied as y.backward(g) (the gradients of (y * g).sum() without timing that stand-in
loss). Errors are measured against a float64 twin (same rounded parameters) on fresh copies: of
the output, or of a step's dX and dW.

The autocast columns (amp-bf16, amp-fp16) keep parameters and inputs in fp32 and enter
torch.autocast around every call's forward (a step's backward runs after the region, as PyTorch
recommends; torch.compile(Model) is called inside the region), at torch's default fp32 matmul
precision. After the timed calls, one more un-timed call of each implementation measures its peak
memory: the most it allocated above what was allocated before it (``timing.peak_memory``).

Results are plain dicts, the rows of bench.json. A new per-implementation column goes into
``run_case``'s row and ``report.MODEL_COLUMNS`` (as the peak memory did). The dtype columns are
``epifuse.cli``'s (one spelling table for every command line): ``DTYPES`` wraps each with what
a measurement enters, ``context`` (torch's matmul policy, around all of it) and ``amp_calls``
(an autocast region around each call). Only the public package is used: ``epifuse``,
``epifuse.cli``, ``epifuse.problems``, ``epifuse.precision`` and the ops as ``torch.ops.epifuse``.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

import epifuse
from epifuse import cli, problems
from epifuse.precision import resolve_precision

from . import step_gemms
from .timing import (Settings, l2_flush, measure, measure_host_checked, measure_queued_rounds,
                     measure_rounds, peak_memory, queued_counts, rotation_count, to_dict)

SEED = 0
IMPLS = ("ours", "eager", "compile")


@dataclass(frozen=True)
class DTypeSpec:
    """One dtype column (an ``epifuse.cli.Column``): tensor dtype, ModelNew's ``precision``,
    torch's fp32 matmul precision for the PyTorch baselines (eager and compile), and for an
    autocast column torch.autocast's dtype (``dtype`` is then float32: the parameters' and
    inputs')."""

    name: str
    dtype: torch.dtype
    precision: Optional[str]
    torch_precision: str
    autocast: Optional[torch.dtype] = None

    @staticmethod
    def of(column: cli.Column) -> "DTypeSpec":
        return DTypeSpec(column.name, column.torch_dtype, column.precision,
                         column.torch_matmul_precision, column.autocast_dtype)

    @property
    def kb_reference(self) -> bool:
        """Whether eager PyTorch in this column is the KernelBench reference: fp32 models and
        inputs at PyTorch's default 'highest' (IEEE fp32), no autocast."""
        return (self.dtype == torch.float32 and self.autocast is None
                and self.torch_precision == "highest")

    def amp(self, device_type: str) -> contextlib.AbstractContextManager:
        """torch.autocast(device_type, dtype) for an autocast column; else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast)

    def amp_calls(self, fn: Callable, device_type: str) -> Callable:
        """``fn`` with an autocast region of its own around each call (an autocast column), as
        a training loop enters one per step: torch caches its casts of the weights only within
        a region, so one region around all timed calls would time eager with a cast weight."""
        if self.autocast is None:
            return fn

        def call(x):
            with self.amp(device_type):
                return fn(x)

        return call

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """torch's fp32 matmul policy of this column, restored afterwards."""
        old = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
        torch.set_float32_matmul_precision(self.torch_precision)
        torch.backends.cuda.matmul.allow_tf32 = self.torch_precision != "highest"
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(old[0])
            torch.backends.cuda.matmul.allow_tf32 = old[1]


# Every column of epifuse.cli: fp32-ieee, fp32-3xtf32 (PyTorch's default precision: ModelNew at
# 'highest' runs 3xTF32, eager IEEE fp32), fp32-tf32, bf16, fp16, and torch.autocast over fp32
# models and inputs at PyTorch's default matmul precision, amp-bf16 and amp-fp16.
DTYPES = {c.name: DTypeSpec.of(c) for c in cli.all_columns()}
# What BENCHMARKS.md shows (python -m benchmarks with no --dtype / --precision): PyTorch's default
# fp32 precision, TF32, and fp32 models under bf16 and fp16 autocast.
DEFAULT_DTYPES = ("fp32", cli.AMP)
DEFAULT_PRECISIONS = tuple(cli.parse_precision(p) for p in ("3xtf32", "tf32"))
KB_REFERENCE = "fp32-ieee"  # the KernelBench reference: eager PyTorch, fp32, no TF32
MODES = ("train", "eval", "train-step")
TRAIN_STEP = "train-step"
PROBLEM_NAMES = cli.problem_names()  # 84: gemm_bn_scale_softmax, 39: gemm_scale_bn


@dataclass(frozen=True)
class Shape:
    problem: int
    m: int
    k: int
    n: int
    tag: str  # "kernelbench" | "kb-small" | "sweep"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    def __str__(self) -> str:
        return f"{self.m}x{self.k}->{self.n}"


# (M, K, N) at full size, and the tiny stand-ins of a --device cpu dry run: the KernelBench sizes,
# and problem 84's original small size, where the host time per forward is measured.
_SHAPES = {(84, "kernelbench"): ((1024, 8192, 8192), (32, 256, 256)),
           (84, "kb-small"): ((128, 1024, 512), (16, 64, 32)),
           (39, "kernelbench"): ((16384, 4096, 4096), (64, 128, 128))}
CASE_TAGS = ("kernelbench",)  # the shapes of the model tables
SWEEP_PROBLEM, SWEEP_KN, DRY_SWEEP_KN = 84, 8192, 256
SWEEP_M, DRY_SWEEP_M = (1, 16, 128, 512, 1024, 4096, 16384), (1, 16, 64)
HOST_TIME_SHAPE = (84, "kb-small")  # short forwards, where the host matters
SOFTMAX_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SOFTMAX_NS, DRY_SOFTMAX_NS = tuple(2 ** i for i in range(6, 17, 2)), (64, 256, 1024, 4096)
SOFTMAX_BYTES, DRY_SOFTMAX_BYTES = 64 << 20, 1 << 20  # each input of the row-length sweep
HEAD_SOFTMAX_SHAPE, DRY_HEAD_SOFTMAX_SHAPE = (1024, 8192), (32, 256)  # problem 84's own softmax
COPY_BYTES, DRY_COPY_BYTES = 1 << 30, 8 << 20


def problem_shapes(problem: int, dry: bool, tags: tuple[str, ...] = CASE_TAGS) -> list[Shape]:
    return [Shape(p, *(tiny if dry else full), tag)
            for (p, tag), (full, tiny) in _SHAPES.items() if p == problem and tag in tags]


@dataclass(frozen=True)
class Case:
    shape: Shape
    spec: DTypeSpec
    mode: str
    compile: bool = False  # also time torch.compile(Model)
    gemm_alone: bool = False  # also time our GEMM op alone and torch.mm
    skip: Optional[str] = None  # why the case is not run at all
    compile_note: Optional[str] = None  # why torch.compile is not timed

    @property
    def label(self) -> str:
        return f"p{self.shape.problem} {self.shape} {self.spec.name} {self.mode}"

    @property
    def training(self) -> bool:
        return self.mode in ("train", TRAIN_STEP)


@dataclass
class Plan:
    cases: list[Case] = field(default_factory=list)
    host_points: list[Case] = field(default_factory=list)  # forwards of ours and eager
    softmax_points: list[tuple[str, int, int]] = field(default_factory=list)  # dtype, n, m
    copy_bytes: int = 0


def build_plan(problems_: list[int], dtypes: list[str], modes: list[str], *, compile: bool,
               sweep: bool, sweep_ms: tuple[int, ...], sweep_compile: bool, softmax: bool,
               dry: bool, host_time: bool = True) -> Plan:
    """What to run, in order: for each shape and mode a column whose eager run is the KernelBench
    reference first (fp32 at 'highest': fp32-ieee or fp32-3xtf32), so that the reference is
    measured before the columns compared with it. The default GPU plan is 2 KernelBench shapes
    x 3 modes x 4 columns = 24 cases (3 timings each, and the GEMM alone and torch.mm on the
    forwards of the fp32 columns: the autocast columns' GEMM is the bf16 / fp16 one)."""
    plan = Plan()
    ordered = sorted(dtypes, key=lambda d: not DTYPES[d].kb_reference)
    shapes = [s for p in problems_ for s in problem_shapes(p, dry)]
    if sweep:  # a sweep point equal to a shape above is that shape, run once
        kn = DRY_SWEEP_KN if dry else SWEEP_KN
        seen = {(s.problem, s.m, s.k, s.n) for s in shapes}
        shapes += [Shape(SWEEP_PROBLEM, m, kn, kn, "sweep") for m in sweep_ms
                   if (SWEEP_PROBLEM, m, kn, kn) not in seen]
    for shape in shapes:
        for mode in modes:
            if mode == TRAIN_STEP and shape.tag == "sweep":
                continue  # the M sweep is of forwards
            timed = compile and (sweep_compile or shape.tag != "sweep")
            note = (None if timed else "not run (--no-compile)" if not compile
                    else "not run (sweep point; add --sweep-compile)")
            for d in ordered:
                case = Case(shape, DTYPES[d], mode, compile=timed, compile_note=note,
                            gemm_alone=shape.tag == "kernelbench" and mode != TRAIN_STEP
                            and DTYPES[d].autocast is None)
                if case.training and shape.m < 2:
                    case = Case(shape, DTYPES[d], mode, compile=timed, compile_note=note,
                                skip="BatchNorm training needs a batch of at least 2 rows")
                plan.cases.append(case)
    if host_time and HOST_TIME_SHAPE[0] in problems_:
        (shape,) = problem_shapes(HOST_TIME_SHAPE[0], dry, (HOST_TIME_SHAPE[1],))
        plan.host_points = [Case(shape, DTYPES[d], m) for m in modes if m != TRAIN_STEP
                            for d in sorted(dtypes, key=list(DTYPES).index)]
    if softmax:
        total = DRY_SOFTMAX_BYTES if dry else SOFTMAX_BYTES
        head_m, head_n = DRY_HEAD_SOFTMAX_SHAPE if dry else HEAD_SOFTMAX_SHAPE
        for dt, torch_dtype in SOFTMAX_DTYPES.items():
            points = {(dt, n, max(1, total // (n * torch_dtype.itemsize)))
                      for n in (DRY_SOFTMAX_NS if dry else SOFTMAX_NS)} | {(dt, head_n, head_m)}
            plan.softmax_points += sorted(points, key=lambda p: (p[1], p[2]))
        plan.copy_bytes = DRY_COPY_BYTES if dry else COPY_BYTES
    return plan


# --------------------------------------------------------------------------- time estimates

# Rough rates of eager PyTorch on an H100 / H200 (TFLOP/s, by torch's matmul policy or 16-bit
# GEMMs), torch.compile's warm-up per configuration (seconds; ~5 s more for the first of a
# process), and the fixed cost of a configuration (building models, the float64 error check, the
# peak-memory calls): the estimates printed before each section, not a measurement.
EST_TFLOPS = {"highest": 45.0, "high": 250.0, "16-bit": 300.0}
EST_COMPILE_S = {False: 2.0, True: 2.5}  # forward, training step
EST_FIRST_COMPILE_S = 5.0
EST_CASE_S = 1.0


def estimate_call_s(flops: float, spec: "DTypeSpec") -> float:
    """A guess at one eager call's GPU time (at least 0.1 ms: the host's)."""
    rate = EST_TFLOPS["16-bit" if spec.autocast is not None or spec.dtype != torch.float32
                      else spec.torch_precision]
    return max(1e-4, flops / (rate * 1e12))


def estimate_timing_s(call_s: float, settings: Settings, impls: int) -> float:
    """What ``measure_rounds`` spends on ``impls`` implementations of ``call_s`` per call."""
    timed = min(settings.iters * call_s, max(settings.min_iters * call_s, settings.max_seconds))
    return impls * (timed + (settings.warmup + 2) * call_s)


def estimate_case_s(case: "Case", settings: Settings, dry: bool) -> float:
    """Seconds one configuration takes, roughly (the CPU dry run: a fixed guess)."""
    if case.skip:
        return 0.0
    if dry:
        return 0.3 + 0.3 * case.compile
    step = case.mode == TRAIN_STEP
    call = estimate_call_s(case.shape.flops * (3 if step else 1), case.spec)
    gemm = estimate_timing_s(call / 2, settings, 2) if case.gemm_alone else 0.0
    impls = 3 if case.compile else 2
    q = queued_counts(settings)  # a step's queued rounds (_measure)
    queued = impls * call * (q["warmup"] + q["rounds"] * q["calls"]) if step else 0.0
    return (EST_CASE_S + estimate_timing_s(call, settings, impls) + gemm + queued
            + (EST_COMPILE_S[step] if case.compile else 0.0))


def compile_model(model: torch.nn.Module, device: torch.device,
                  mode: Optional[str] = None) -> Callable:
    """torch.compile(model), default mode (or ``mode``, e.g. "reduce-overhead"); in a CPU dry run
    with backend='eager' whatever the mode (dynamo's trace without inductor's code generation or
    CUDA graphs: the plumbing, in seconds)."""
    if device.type == "cpu":
        return torch.compile(model, backend="eager")
    return torch.compile(model) if mode is None else torch.compile(model, mode=mode)


# --------------------------------------------------------------------------- models and inputs

def _init_args(shape: Shape) -> list:
    """The problem's get_init_inputs() with in/out features set to K, N (as python -m epifuse
    resizes them)."""
    return cli.init_inputs(problems.BY_NUMBER[shape.problem], (shape.m, shape.k, shape.n))[1]


@torch.no_grad()
def base_state(shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    """KernelBench's seeded fp32 Model state (torch.manual_seed(SEED) on CPU), with the running
    statistics set to the BatchNorm input's statistics over one random batch (a fresh BatchNorm's
    mean 0 / var 1 would make eval mode unrepresentative)."""
    torch.manual_seed(SEED)
    model = problems.BY_NUMBER[shape.problem].Model(*_init_args(shape)).to(device).eval()
    x = torch.rand(256, shape.k, generator=torch.Generator(device).manual_seed(SEED + 1),
                   device=device)
    captured = []
    hook = model.bn.register_forward_pre_hook(lambda mod, inp: captured.append(inp[0]))
    with DTYPES[KB_REFERENCE].context():
        model(x)
    hook.remove()
    u = captured[0].double()
    model.bn.running_mean.copy_(u.mean(0))
    model.bn.running_var.copy_(u.var(0, unbiased=True))
    model.bn.num_batches_tracked.fill_(1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(case: Case, state: dict, device: torch.device, *, new: bool,
          dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """Model, or ModelNew(precision=...), holding ``state`` in the case's dtype (or ``dtype``);
    built on the meta device, so no throw-away initialization of a large weight happens."""
    module = problems.BY_NUMBER[case.shape.problem]
    with torch.device("meta"):
        model = (module.ModelNew(*_init_args(case.shape), precision=case.spec.precision) if new
                 else module.Model(*_init_args(case.shape)))
    model = model.to_empty(device=device)
    model.load_state_dict(state)
    return model.to(dtype or case.spec.dtype).train(case.training)


def make_inputs(case: Case, device: torch.device, count: int, seed: int) -> list:
    """``count`` KernelBench-style inputs (torch.rand); for a step, (x requiring grad, g ~ N(0,
    1) of the output's shape) pairs."""
    s, dtype = case.shape, case.spec.dtype
    gen = torch.Generator(device).manual_seed(seed)
    xs = [torch.rand(s.m, s.k, generator=gen, device=device).to(dtype) for _ in range(count)]
    if case.mode != TRAIN_STEP:
        return xs
    gen = torch.Generator(device).manual_seed(seed + 1)
    return [(x.requires_grad_(), torch.randn(s.m, s.n, generator=gen, device=device).to(dtype))
            for x in xs]


def input_bytes(case: Case) -> int:
    """One input's bytes (with a step's upstream gradient), for the L2 rotation count."""
    s = case.shape
    return (s.m * s.k + (s.m * s.n if case.mode == TRAIN_STEP else 0)) * case.spec.dtype.itemsize


def make_step(model: torch.nn.Module, forward: Callable, *,
              new_weights: bool = False) -> Callable:
    """One training step of ``forward`` (``model`` or its torch.compile wrapper, possibly in an
    autocast region of its own: the backward then runs outside it). ``new_weights``: bump every
    parameter's version counter first, as the optimizer's in-place update between two steps
    would. The benchmark runs no optimizer, so without it the weights never change and ModelNew,
    which keeps a weight's 16-bit cast (autocast) or 3xTF32 split while the weight's version is
    unchanged, would reuse them across steps, while eager's autocast casts the weight again in
    every region: a saving no training run sees. increment_version launches no kernel (an
    in-place ``p.add_(0)`` under no_grad would bump it too, but would also time a pass over the
    weight). The step's ``release(pair)`` drops the gradients it leaves (for ``peak_memory``)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def release(pair) -> None:
        pair[0].grad = None  # zero_grad(set_to_none=True) without walking the module tree
        for p in params:
            p.grad = None

    def step(pair) -> None:
        x, g = pair
        release(pair)
        if new_weights:
            for p in params:
                torch.autograd.graph.increment_version(p)
        forward(x).backward(g)

    step.release = release
    return step


@torch.no_grad()
def error_stats(out: torch.Tensor, ref64: torch.Tensor) -> dict:
    """||out - ref|| / ||ref|| (Frobenius), max |out - ref|, and whether out is finite."""
    if out.shape != ref64.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    diff = out.detach().to(torch.float64) - ref64
    if not bool(torch.isfinite(diff).all()):
        return {"rel_fro": float("inf"), "max_abs": float("inf"), "finite": False}
    rel = (torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref64).clamp_min(1e-300))
    return {"rel_fro": rel.item(), "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
            "finite": True}


def errors(model: torch.nn.Module, x, ref64,
           amp: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
           ) -> dict[str, dict]:
    """Errors of a forward's output (key ""), or of a step's dX and dW (keys "dx", "dw"); the
    forward inside ``amp()`` (an autocast region), a step's backward after it."""
    if not isinstance(x, tuple):
        with torch.no_grad(), amp():
            return {"": error_stats(model(x), ref64)}
    x, g = x
    x = x.detach().clone().requires_grad_()
    with amp():
        y = model(x)
    y.backward(g)
    got = {"dx": x.grad, "dw": model.gemm.weight.grad}
    missing = [k for k, v in got.items() if v is None]
    if missing:
        raise RuntimeError(f"no gradient for {', '.join(missing)} after backward")
    return {k: error_stats(v, ref64[k]) for k, v in got.items()}


def reference64(case: Case, state: dict, device: torch.device, x):
    """The float64 twin's output, or a step's {"dx", "dw"}: the parameters as rounded to the
    case's dtype, then widened."""
    ref = build(case, state, device, new=False).to(torch.float64)
    if not isinstance(x, tuple):
        with torch.no_grad():
            return ref(x.to(torch.float64))
    x64 = x[0].detach().to(torch.float64).requires_grad_()
    ref(x64).backward(x[1].to(torch.float64))
    return {"dx": x64.grad, "dw": ref.gemm.weight.grad}


# --------------------------------------------------------------------------- one configuration

def describe(exc: BaseException) -> str:
    """One line for the table: the exception type and the first line of its message."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")
    return text if len(text) <= 160 else text[:157] + "..."


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def new_row(case: Case) -> dict:
    s = case.shape
    return {"problem": s.problem, "tag": s.tag, "M": s.m, "K": s.k, "N": s.n,
            "dtype": case.spec.name, "mode": case.mode, "skipped": case.skip,
            "compile_timed": case.compile, "compile_note": case.compile_note,
            "gemm_alone": case.gemm_alone,
            "flops": s.flops * (3 if case.mode == TRAIN_STEP else 1),  # a step: fwd, dX, dW
            "path": None, "timings_ms": {}, "failures": {}, "errors_vs_fp64": {},
            "peak_mib": {}, "peak_ours_vs_eager": None, "queued_ms": {},
            "kb_reference_ms": None, "gemm_op": None, "wall_s": 0.0}


class Runner:
    """Runs cases on one device, keeping the eager fp32-ieee times (the KernelBench reference)."""

    def __init__(self, device: torch.device, settings: Settings, log: Callable[[str], None],
                 verbose: bool = False) -> None:
        self.device, self.settings, self.log, self.verbose = device, settings, log, verbose
        self.kb: dict[tuple, Optional[float]] = {}

    def failed(self, row: dict, key: str, e: BaseException, what: str = "") -> None:
        row["failures"][key] = what + describe(e)
        self.log(f"  {row['_label']}: {key} failed: {what}{describe(e)}")
        if self.verbose:
            self.log("".join(traceback.format_exception(e)))

    def _callables(self, case: Case, state: dict, impls) -> dict:
        """What one timed call of each implementation runs (or why it cannot): a forward of the
        model or of its torch.compile wrapper (in an autocast region per call for an autocast
        column), or a training step of it (bumping the weights' versions: see make_step)."""
        fns = {}
        for impl in impls:
            try:
                model = fn = build(case, state, self.device, new=impl == "ours")
                if impl == "compile":
                    torch._dynamo.reset()  # a fresh cache: no recompile limit, no stale policy
                    fn = compile_model(model, self.device)
                fn = case.spec.amp_calls(fn, self.device.type)
                fns[impl] = (make_step(model, fn, new_weights=True) if case.mode == TRAIN_STEP
                             else fn)
            except Exception as e:  # noqa: BLE001 -- any failure becomes a table entry
                fns[impl] = e
        return fns

    def _measure(self, case: Case, inputs: list, row: dict, fns: dict) -> None:
        """``fns`` in interleaved rounds, under the case's matmul policy (and no_grad for a
        forward), then one more un-timed call of each for its peak memory (on CUDA); each
        implementation's time, peak or failure goes into ``row``."""
        for impl, fn in list(fns.items()):
            if isinstance(fn, Exception):
                self.failed(row, impl, fns.pop(impl))
        with contextlib.ExitStack() as stack:
            stack.enter_context(case.spec.context())
            if case.mode != TRAIN_STEP:
                stack.enter_context(torch.no_grad())
            timings = measure_rounds(fns, inputs, self.device, self.settings)
            for impl, t in timings.items():
                if isinstance(t, Exception):
                    self.failed(row, impl, t)
                    continue
                row["timings_ms"][impl] = to_dict(t)
                try:  # warmed up: its caches and workspaces exist, as in a steady state
                    peak = peak_memory(fns[impl], inputs[0], self.device,
                                       getattr(fns[impl], "release", None))
                except Exception as e:  # noqa: BLE001
                    self.failed(row, f"memory:{impl}", e)
                else:
                    if peak is not None:
                        row["peak_mib"][impl] = peak / 2**20
            if case.mode == TRAIN_STEP:
                # The same steps with the host ahead (steps queued behind a spin kernel): their
                # GPU time, where each timed step above also counts the host's latency before
                # its first kernel.
                timed = {impl: fns[impl] for impl in row["timings_ms"]}
                queued = measure_queued_rounds(timed, inputs, self.device,
                                               **queued_counts(self.settings))
                for impl, q in queued.items():
                    if isinstance(q, Exception):
                        self.failed(row, f"queued:{impl}", q)
                    else:
                        row["queued_ms"][impl] = q
        fns.clear()
        free_memory(self.device)

    def run_case(self, case: Case, state: dict) -> dict:
        row, device = new_row(case), self.device
        if case.skip:
            return row
        row["_label"], t0 = case.label, time.perf_counter()
        self._errors(case, state, row)
        try:
            inputs = make_inputs(case, device, rotation_count(input_bytes(case), device),
                                 seed=SEED + 1000)
            x0 = inputs[0][0] if case.mode == TRAIN_STEP else inputs[0]
            with case.spec.amp(device.type):
                reason = epifuse.fast_path_reason(build(case, state, device, new=True), x0)
            row["path"] = "fused" if reason is None else reason
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory for the inputs
            row["failures"].update({impl: describe(e) for impl in IMPLS})
            self.log(f"  {case.label}: set-up failed: {describe(e)}")
            inputs = []
        if inputs:
            if not case.compile:
                row["failures"]["compile"] = case.compile_note or "not run"
            self._measure(case, inputs, row,
                          self._callables(case, state, IMPLS if case.compile else IMPLS[:2]))
            if case.compile:
                torch._dynamo.reset()
            if case.mode == TRAIN_STEP and row["path"] == "fused":
                row["step_gemms"] = self._step_gemms(case, state, inputs[0])
            if case.gemm_alone:  # our GEMM op alone, and torch.mm, on the same inputs
                w = state["gemm.weight"].to(case.spec.dtype).contiguous()
                gen = torch.Generator(device).manual_seed(SEED + 300)
                a = torch.rand(case.shape.n, generator=gen, device=device) + 0.5
                c = torch.randn(case.shape.n, generator=gen, device=device) * 0.1
                prec = resolve_precision(case.spec.precision, case.spec.dtype)
                train = case.mode == "train"
                row["gemm_op"] = "gemm_colstats" if train else "gemm_affine"
                ops = torch.ops.epifuse
                self._measure(case, inputs, row, {
                    "gemm": (lambda x: ops.gemm_colstats(x, w, prec)) if train
                    else (lambda x: ops.gemm_affine(x, w, a, c, prec)),
                    "torch_mm": lambda x: torch.mm(x, w.t())})
            inputs.clear()
            free_memory(device)
            key = (case.shape, case.mode)
            if case.spec.kb_reference:  # eager at 'highest' in fp32: the reference itself
                self.kb[key] = (row["timings_ms"].get("eager") or {}).get("median_ms")
            elif key not in self.kb:  # eager fp32-ieee, when that column is not in the plan
                ref_case = Case(case.shape, DTYPES[KB_REFERENCE], case.mode)
                ref = dict(new_row(ref_case), _label=f"{case.label}: KernelBench reference "
                                                     "(eager fp32-ieee)")
                try:
                    xs = make_inputs(ref_case, device, rotation_count(input_bytes(ref_case),
                                                                      device), seed=SEED + 200)
                    self._measure(ref_case, xs, ref, self._callables(ref_case, state, ["eager"]))
                except Exception as e:  # noqa: BLE001
                    self.failed(ref, "eager", e)
                self.kb[key] = (ref["timings_ms"].get("eager") or {}).get("median_ms")
                free_memory(device)
            row["kb_reference_ms"] = self.kb[key]
        peaks = row["peak_mib"]
        if peaks.get("ours") is not None and peaks.get("eager"):
            row["peak_ours_vs_eager"] = peaks["ours"] / peaks["eager"]
        row.pop("_label")
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        return row

    def _step_gemms(self, case: Case, state: dict, pair) -> Optional[dict]:
        """Our step's three GEMMs (forward, dX, dW), each from its op's kernels (step_gemms)."""
        step = self._callables(case, state, ["ours"])["ours"]
        if isinstance(step, Exception):
            return None
        try:
            with case.spec.context():
                return step_gemms.measure(step, pair, self.device)
        except Exception as e:  # noqa: BLE001 -- a diagnostic column
            self.log(f"  {case.label}: step GEMMs not measured: {describe(e)}")
            return None
        finally:
            step.release(pair)
            free_memory(self.device)

    def _errors(self, case: Case, state: dict, row: dict) -> None:
        """Errors of ours and eager against a float64 twin, on fresh copies of the same state:
        of the output (key "<impl>") or of a step's dX and dW ("<impl>:dx", "<impl>:dw")."""
        try:
            x = make_inputs(case, self.device, 1, seed=SEED + 100)[0]
            with case.spec.context():
                ref = reference64(case, state, self.device, x)
                for impl in ("ours", "eager"):
                    try:
                        got = errors(build(case, state, self.device, new=impl == "ours"), x, ref,
                                     lambda: case.spec.amp(self.device.type))
                        row["errors_vs_fp64"].update(
                            {f"{impl}:{k}" if k else impl: v for k, v in got.items()})
                    except Exception as e:  # noqa: BLE001
                        self.failed(row, f"accuracy:{impl}", e)
        except Exception as e:  # noqa: BLE001
            for impl in ("ours", "eager"):
                self.failed(row, f"accuracy:{impl}", e, "fp64 reference failed: ")
        x = ref = None
        free_memory(self.device)

    def host_point(self, case: Case, state: dict) -> dict:
        """Host time of one forward (under torch.no_grad()) of ours and eager."""
        s = case.shape
        row = {"problem": s.problem, "tag": s.tag, "M": s.m, "K": s.k, "N": s.n,
               "dtype": case.spec.name, "mode": case.mode, "timings_us": {}, "failures": {},
               "_label": f"host time {case.label}"}
        x = make_inputs(case, self.device, 1, seed=SEED + 400)[0]
        for impl in ("ours", "eager"):
            try:
                model = build(case, state, self.device, new=impl == "ours")
                call = case.spec.amp_calls(model, self.device.type)
                with case.spec.context(), torch.no_grad():
                    row["timings_us"][impl] = measure_host_checked(lambda: call(x), self.device)
                del model, call
            except Exception as e:  # noqa: BLE001
                self.failed(row, impl, e)
        del row["_label"]
        return row

    @torch.no_grad()
    def copy_bandwidth(self, nbytes: int) -> dict:
        """Device-to-device ``dst.copy_(src)`` of an ``nbytes`` float32 tensor."""
        row = {"bytes_read_plus_written": 2 * (nbytes // 4) * 4, "gbps": None, "timing_ms": None,
               "failure": None}
        try:
            src = torch.empty(nbytes // 4, device=self.device).uniform_()
            dst = torch.empty_like(src)
            t = measure(dst.copy_, [src], self.device, self.settings)
            row["timing_ms"] = to_dict(t)
            row["gbps"] = row["bytes_read_plus_written"] / t.median / 1e9
            del src, dst
        except Exception as e:  # noqa: BLE001
            row["failure"] = describe(e)
        free_memory(self.device)
        return row

    @torch.no_grad()
    def softmax_point(self, dtype: str, n: int, m: int) -> dict:
        """Our row softmax (the op itself: a device without our kernels shows as a failure) and
        torch.softmax on an [m, n] input, L2 flushed before each call; errors vs float64."""
        nbytes = 2 * m * n * SOFTMAX_DTYPES[dtype].itemsize  # read + write
        row = {"dtype": dtype, "M": m, "N": n, "bytes_read_plus_written": nbytes,
               "timings_ms": {}, "failures": {}, "errors_vs_fp64": {},
               "_label": f"softmax {dtype} N={n}"}
        try:
            gen = torch.Generator(self.device).manual_seed(7)
            x = (torch.randn(m, n, generator=gen, device=self.device) * 4).to(
                SOFTMAX_DTYPES[dtype])
            ref64 = torch.softmax(x.to(torch.float64), dim=-1)
            flush = l2_flush(self.device)
        except Exception as e:  # noqa: BLE001
            row["failures"] = {"ours": describe(e), "torch": describe(e)}
            del row["_label"]
            return row
        for impl, fn in (("ours", lambda t: torch.ops.epifuse.affine_softmax(t, None, None)),
                         ("torch", lambda t: torch.softmax(t, dim=-1))):
            try:
                row["errors_vs_fp64"][impl] = error_stats(fn(x), ref64)
                row["timings_ms"][impl] = to_dict(measure(fn, [x], self.device, self.settings,
                                                          flush=flush))
            except Exception as e:  # noqa: BLE001
                self.failed(row, impl, e)
        del row["_label"], x, ref64, flush
        free_memory(self.device)
        return row
