"""What the benchmark runs: problems and shapes, dtype/precision settings, the plan."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

# --------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class DTypeSpec:
    """One dtype column: the tensor dtype and the fp32 matmul policy on both sides.

    ``precision`` is what ModelNew gets ("ieee" | "3xtf32" | "tf32" | None for 16-bit);
    ``torch_precision`` is torch.set_float32_matmul_precision for the PyTorch
    baselines (eager and torch.compile), with allow_tf32 set to match.
    """

    name: str
    dtype: torch.dtype
    precision: Optional[str]
    torch_precision: str

    @property
    def allow_tf32(self) -> bool:
        return self.torch_precision != "highest"

    @contextlib.contextmanager
    def torch_settings(self) -> Iterator[None]:
        """Set torch's fp32 matmul policy for this column; restore it afterwards."""
        old_precision = torch.get_float32_matmul_precision()
        old_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.set_float32_matmul_precision(self.torch_precision)
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(old_precision)
            torch.backends.cuda.matmul.allow_tf32 = old_tf32


DTYPES = {
    "fp32-ieee": DTypeSpec("fp32-ieee", torch.float32, "ieee", "highest"),
    # PyTorch's default precision: ModelNew(precision=None) under 'highest' runs exactly this
    # (fp32 accuracy on the tensor cores), against PyTorch's fp32 ('highest') baselines.
    "fp32-3xtf32": DTypeSpec("fp32-3xtf32", torch.float32, "3xtf32", "highest"),
    "fp32-tf32": DTypeSpec("fp32-tf32", torch.float32, "tf32", "high"),
    "bf16": DTypeSpec("bf16", torch.bfloat16, None, "highest"),
    "fp16": DTypeSpec("fp16", torch.float16, None, "highest"),
}
# The KernelBench reference: eager PyTorch, fp32, no TF32.
KB_REFERENCE = "fp32-ieee"

# "train"/"eval": one forward in that BatchNorm mode (under torch.no_grad()).
# "train-step": a training-mode forward plus its backward (dX and the parameter gradients).
MODES = ("train", "eval", "train-step")
TRAIN_STEP = "train-step"


def is_training(mode: str) -> bool:
    """Whether ``mode`` runs BatchNorm on batch statistics (model.train())."""
    return mode in ("train", TRAIN_STEP)

# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One problem size: batch M, in_features K, out_features N."""

    problem: int
    m: int
    k: int
    n: int
    tag: str  # "kernelbench" | "kb-small" | "sweep"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def weights_key(self) -> tuple[int, int, int]:
        """Shapes with the same key share one seeded parameter set."""
        return (self.problem, self.k, self.n)

    def __str__(self) -> str:
        return f"{self.m}x{self.k}->{self.n}"


PROBLEM_NAMES = {84: "gemm_bn_scale_softmax", 39: "gemm_scale_bn"}

# (M, K, N) at full size, and the tiny stand-ins of a --device cpu dry run.
_SHAPES = {
    (84, "kernelbench"): ((1024, 8192, 8192), (32, 256, 256)),
    (84, "kb-small"): ((128, 1024, 512), (16, 64, 32)),
    (39, "kernelbench"): ((16384, 4096, 4096), (64, 128, 128)),
}
SWEEP_PROBLEM = 84
SWEEP_M = (1, 16, 128, 512, 1024, 4096, 16384)
SWEEP_KN = 8192
DRY_SWEEP_M = (1, 16, 64)
DRY_SWEEP_KN = 256


def problem_shapes(problem: int, dry: bool) -> list[Shape]:
    out = []
    for (p, tag), (full, tiny) in _SHAPES.items():
        if p == problem:
            out.append(Shape(problem, *(tiny if dry else full), tag))
    return out


def sweep_shapes(ms: tuple[int, ...], dry: bool) -> list[Shape]:
    kn = DRY_SWEEP_KN if dry else SWEEP_KN
    return [Shape(SWEEP_PROBLEM, m, kn, kn, "sweep") for m in ms]


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One model configuration: a shape, a dtype column and a mode."""

    shape: Shape
    spec: DTypeSpec
    mode: str
    compile: bool  # also time torch.compile(Model)
    gemm_alone: bool  # also time our GEMM op alone (and cuBLAS) on this shape
    skip: Optional[str] = None  # reason the case is not run at all
    compile_note: Optional[str] = None  # why torch.compile is not timed (when compile is False)

    @property
    def label(self) -> str:
        return f"p{self.shape.problem} {self.shape} {self.spec.name} {self.mode}"


@dataclass(frozen=True)
class HostPoint:
    """One host-time measurement: a forward of ours and of eager on ``shape``."""

    shape: Shape
    spec: DTypeSpec
    mode: str  # a forward mode: "train" | "eval"

    @property
    def label(self) -> str:
        return f"host time p{self.shape.problem} {self.shape} {self.spec.name} {self.mode}"


@dataclass
class Plan:
    cases: list[Case] = field(default_factory=list)
    host_points: list[HostPoint] = field(default_factory=list)
    softmax_points: list[SoftmaxPoint] = field(default_factory=list)
    copy_bytes: int = 0


@dataclass(frozen=True)
class SoftmaxPoint:
    """One softmax-alone measurement: an [m, n] input of ``dtype``."""

    dtype: str
    n: int
    m: int


SOFTMAX_DTYPES = ("fp32", "bf16")
SOFTMAX_NS = tuple(2 ** i for i in range(6, 17))  # 64 ... 65536
DRY_SOFTMAX_NS = (64, 256, 1024, 4096)
SOFTMAX_BYTES = 64 << 20  # each softmax input of the row-length sweep is ~64 MB
DRY_SOFTMAX_BYTES = 1 << 20
# Problem 84's own softmax ([batch, out_features] at KernelBench size), where issue #4 sets its
# bandwidth target; the sweep's 64 MB inputs have more rows at this width.
HEAD_SOFTMAX_SHAPE = (1024, 8192)
DRY_HEAD_SOFTMAX_SHAPE = (32, 256)


def softmax_points(dry: bool) -> list[SoftmaxPoint]:
    """Per dtype: the row-length sweep at a fixed input size, plus problem 84's head shape."""
    total = DRY_SOFTMAX_BYTES if dry else SOFTMAX_BYTES
    head_m, head_n = DRY_HEAD_SOFTMAX_SHAPE if dry else HEAD_SOFTMAX_SHAPE
    points = []
    for dt in SOFTMAX_DTYPES:
        esize = SOFTMAX_TORCH_DTYPES[dt].itemsize
        sweep = [SoftmaxPoint(dt, n, max(1, total // (n * esize)))
                 for n in (DRY_SOFTMAX_NS if dry else SOFTMAX_NS)]
        head = SoftmaxPoint(dt, head_n, head_m)
        points += sweep + ([head] if head not in sweep else [])
    return sorted(points, key=lambda p: (SOFTMAX_DTYPES.index(p.dtype), p.n, p.m))


COPY_BYTES = 1 << 30  # the copy-bandwidth source tensor
DRY_COPY_BYTES = 8 << 20


# Host time is measured on the small shape, where a forward is short enough for the host to
# matter (KernelBench's 84 at its original size).
HOST_TIME_SHAPE = (84, "kb-small")


def host_points(problems: list[int], dtypes: list[str], modes: list[str],
                dry: bool) -> list[HostPoint]:
    """The small shape's forwards, per dtype column and forward mode of the selection."""
    problem, tag = HOST_TIME_SHAPE
    if problem not in problems:
        return []
    shape = next(s for s in problem_shapes(problem, dry) if s.tag == tag)
    columns = sorted(dtypes, key=list(DTYPES).index)
    return [HostPoint(shape, DTYPES[d], mode) for mode in modes if mode != TRAIN_STEP
            for d in columns]


def build_plan(problems: list[int], dtypes: list[str], modes: list[str], *, compile: bool,
               sweep: bool, sweep_ms: tuple[int, ...], sweep_compile: bool, softmax: bool,
               dry: bool, host_time: bool = True) -> Plan:
    """What to run, in order.

    The default full-size GPU plan without --sweep and --softmax is 3 shapes x 3 modes x 5
    dtype columns = 45 cases, each with one accuracy check and 3 timed measurements (ours,
    eager, compile) plus 2 on the 2 KernelBench shapes' forwards (our GEMM alone, torch.mm):
    135 + 20 = 155 measurements, each at most --max-seconds (2 s) of timed calls after its
    warm-up, most far less (a 0.2 ms call stops at --iters 50). Their sum is about a minute;
    torch.compile's 45 compilations (forward, and forward + backward for a step) dominate
    the rest. Host time adds 10 points x 2 implementations of a few hundred short calls.
    """
    plan = Plan()
    # fp32-ieee first for each shape/mode so the KernelBench reference is measured
    # before the columns that are compared with it.
    ordered = sorted(dtypes, key=lambda d: d != KB_REFERENCE)
    shapes = [s for p in problems for s in problem_shapes(p, dry)]
    if sweep:  # a sweep point equal to a shape above is that shape, run once
        seen = {(s.problem, s.m, s.k, s.n) for s in shapes}
        shapes += [s for s in sweep_shapes(sweep_ms, dry) if (s.problem, s.m, s.k, s.n) not in seen]
    for shape in shapes:
        for mode in modes:
            if mode == TRAIN_STEP and shape.tag == "sweep":
                continue  # the M sweep is of forwards; steps are timed at the fixed shapes
            for d in ordered:
                skip = None
                if is_training(mode) and shape.m < 2:
                    skip = "BatchNorm training needs a batch of at least 2 rows"
                is_sweep = shape.tag == "sweep"
                with_compile = compile and (sweep_compile or not is_sweep)
                note = None
                if not compile:
                    note = "not run (--no-compile)"
                elif not with_compile:
                    note = "not run (sweep point; add --sweep-compile)"
                plan.cases.append(Case(
                    shape, DTYPES[d], mode, compile=with_compile,
                    # The GEMM op alone is a forward kernel: not comparable with a backward.
                    gemm_alone=shape.tag == "kernelbench" and mode != TRAIN_STEP,
                    skip=skip, compile_note=note))
    if host_time:
        plan.host_points = host_points(problems, ordered, modes, dry)
    if softmax:
        plan.softmax_points = softmax_points(dry)
        plan.copy_bytes = DRY_COPY_BYTES if dry else COPY_BYTES
    return plan


SOFTMAX_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
