"""The command-line vocabulary of epifuse's command lines: ``python -m epifuse``,
``python -m benchmarks`` (and its ``real_heads`` and ``distributed``), ``scripts/profile_driver.py``
(``scripts/profile_nsys.sh``) and ``scripts/sanitize_driver.py``.

One spelling table for all, so a selection typed for one works for the others:

* problems  ``--problem`` / ``--problems``: 84, 39, their names, or ``all``;
* dtypes    ``--dtype`` / ``--dtypes``: fp32 | float32 | float, bf16 | bfloat16,
            fp16 | float16 | half, ``fp32-<precision>`` (one fp32 column), ``amp-bf16`` /
            ``amp-fp16`` (fp32 models and inputs under ``torch.autocast`` to that dtype; the
            16-bit names above after ``amp-``), ``amp`` (both), ``all`` (every one: fp32, bf16,
            fp16, amp-bf16, amp-fp16);
* precisions ``--precision`` / ``--precisions``: the names of ``epifuse.precision.ALIASES``
            (ours: ieee, 3xtf32, tf32; torch's: highest, high, medium).

Every list option takes space- and/or comma-separated values (``--dtypes fp32,bf16``
equals ``--dtype fp32 bf16``). ``Column`` is one dtype to run; ``Column.torch_matmul_precision``
the torch policy that its PyTorch baselines run under; ``init_inputs`` a problem's
``get_init_inputs()`` resized to other shapes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from . import precision as _precision
from .problems import BY_NUMBER

DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
})
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
AMP = "amp"  # torch.autocast columns: fp32 models and inputs, 16-bit GEMMs inside the region
AMP_ORDER = ("amp-bf16", "amp-fp16")
AUTOCAST_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16})
DTYPE_ORDER = ("fp32", "bf16", "fp16") + AMP_ORDER  # what ``all`` selects
PRECISION_ORDER = (_precision.IEEE, _precision.TF32X3, _precision.TF32)
ALL = "all"


@dataclass(frozen=True)
class Column:
    """One dtype to run: 16-bit, fp32 with a precision (None: follow torch's setting), or fp32
    under torch.autocast ("amp-bf16", "amp-fp16": the matmul precision stays torch's)."""

    dtype: str  # "fp32" | "bf16" | "fp16" | "amp-bf16" | "amp-fp16"
    precision: Optional[str] = None  # canonical; only for fp32

    @property
    def name(self) -> str:
        """``fp32-tf32``, ``fp32`` (precision left to torch), ``bf16``, ``amp-bf16``: the bench's
        column names."""
        return f"{self.dtype}-{self.precision}" if self.precision else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the parameters and inputs (float32 for an autocast column)."""
        return torch.float32 if self.dtype in AUTOCAST_DTYPES else TORCH_DTYPES[self.dtype]

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """torch.autocast's dtype for an autocast column; None otherwise."""
        return AUTOCAST_DTYPES.get(self.dtype)

    @property
    def torch_matmul_precision(self) -> str:
        """``torch.set_float32_matmul_precision``'s setting that PyTorch's side of a comparison
        runs under: ``'high'`` (TF32) for the tf32 column, else ``'highest'`` (PyTorch's default;
        for 3xtf32 the IEEE fp32 that ours is held against)."""
        return torch_matmul_precision(self.precision)


def torch_matmul_precision(precision: Optional[str]) -> str:
    """torch's fp32 matmul setting for one of our precisions (any spelling; None: torch's
    default, 'highest')."""
    return "high" if precision is not None and parse_precision(precision) == _precision.TF32 \
        else "highest"


def all_columns() -> tuple[Column, ...]:
    """Every column there is: fp32 at each precision (``PRECISION_ORDER``), bf16, fp16, and the
    autocast ones."""
    return tuple([Column("fp32", p) for p in PRECISION_ORDER]
                 + [Column(d) for d in DTYPE_ORDER if d != "fp32"])


def column(name: str) -> Column:
    """One column by name, in any spelling (``fp32-tf32``, ``float32-high``, ``amp-half``)."""
    parsed = parse_dtype(name)
    if len(parsed) != 1:
        raise ValueError(f"{name!r} names {len(parsed)} columns, not one")
    return Column(*parsed[0])


def init_inputs(module, sizes: Optional[tuple[int, int, int]]) -> tuple[int, list]:
    """A problem module's (batch_size, get_init_inputs()), resized to ``sizes`` = (batch,
    in_features, out_features) when given (a per-column scale's shape follows out_features)."""
    args = list(module.get_init_inputs())
    if sizes is None:
        return module.batch_size, args
    batch, k, n = sizes
    resized = [k, n]
    for a in args[2:]:
        resized.append((n,) if a == (module.out_features,) else a)
    return batch, resized


def problem_names() -> dict[int, str]:
    return {n: m.__name__.rsplit(".", 1)[-1] for n, m in BY_NUMBER.items()}


def parse_problem(token: str) -> list[int]:
    if token == ALL:
        return list(BY_NUMBER)
    by_name = {name: n for n, name in problem_names().items()}
    if token in by_name:
        return [by_name[token]]
    if token.isdigit() and int(token) in BY_NUMBER:
        return [int(token)]
    raise ValueError(f"unknown problem {token!r}; choose from "
                     f"{', '.join(map(str, BY_NUMBER))}, {', '.join(by_name)} or {ALL}")


def parse_precision(token: str) -> str:
    canonical = _precision.ALIASES.get(token)
    if canonical is None:
        raise ValueError(f"unknown precision {token!r}; choose from "
                         f"{', '.join(_precision.ALIASES)}")
    return canonical


def parse_dtype(token: str) -> list[tuple[str, Optional[str]]]:
    """``bf16`` -> [("bf16", None)]; ``float32-high`` -> [("fp32", "tf32")]; ``amp-bfloat16``
    -> [("amp-bf16", None)]; ``amp`` -> both autocast columns; ``all`` -> all 5."""
    if token == ALL:
        return [(d, None) for d in DTYPE_ORDER]
    if token == AMP:
        return [(d, None) for d in AMP_ORDER]
    name, sep, prec = token.partition("-")
    if name == AMP and sep:  # amp-<16-bit dtype>, in any of its spellings
        dtype = f"{AMP}-{DTYPE_ALIASES.get(prec)}"
        if dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"dtype {token!r}: autocast runs in bf16 or fp16 "
                             f"({', '.join(AMP_ORDER)}, or {AMP} for both)")
        return [(dtype, None)]
    dtype = DTYPE_ALIASES.get(name)
    if dtype is None:
        raise ValueError(f"unknown dtype {token!r}; choose from {', '.join(DTYPE_ALIASES)}, "
                         f"{ALL}, fp32-<precision> (e.g. fp32-tf32), {', '.join(AMP_ORDER)} "
                         f"or {AMP}")
    if not sep:
        return [(dtype, None)]
    if dtype != "fp32":
        raise ValueError(f"dtype {token!r}: a precision applies to fp32 only")
    return [(dtype, parse_precision(prec))]


def _items(parse: Callable[[str], list]) -> Callable[[str], list]:
    """An argparse ``type``: one command-line word, comma-separated, parsed item by item."""
    def convert(word: str) -> list:
        tokens = [t.strip() for t in word.split(",") if t.strip()]
        if not tokens:
            raise argparse.ArgumentTypeError("empty value")
        out = []
        for t in tokens:
            try:
                out += parse(t)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return out
    convert.__name__ = parse.__name__.removeprefix("parse_")  # argparse names it in errors
    return convert


def _flat(groups: Optional[Iterable[list]]) -> list:
    out: list = []
    for group in groups or ():
        for item in group:
            if item not in out:
                out.append(item)
    return out


def add_selection_arguments(parser: argparse.ArgumentParser, *, default_dtypes: str,
                            default_precisions: str) -> None:
    """--problem(s), --dtype(s), --precision(s); read them back with ``selection``."""
    parser.add_argument(
        "--problem", "--problems", dest="problems", nargs="+", type=_items(parse_problem),
        metavar="P", help="KernelBench problems: 84, 39, gemm_bn_scale_softmax, gemm_scale_bn "
                          "or all (space or comma separated; default all)")
    add_dtype_arguments(parser, default_dtypes=default_dtypes,
                        default_precisions=default_precisions)


def add_dtype_arguments(parser: argparse.ArgumentParser, *, default_dtypes: str,
                        default_precisions: str, aliases: Sequence[str] = ()) -> None:
    """--dtype(s) (and ``aliases``), --precision(s); read them back with ``selection`` or
    ``columns``."""
    parser.add_argument(
        "--dtype", "--dtypes", *aliases, dest="dtypes", nargs="+", type=_items(parse_dtype),
        metavar="D",
        help="fp32|float32, bf16|bfloat16, fp16|float16|half, fp32-<precision> (e.g. "
             "fp32-tf32), amp-bf16 or amp-fp16 (fp32 models and inputs, each call under "
             "torch.autocast to that dtype), amp (both), or all (fp32, bf16, fp16, amp-bf16, "
             f"amp-fp16) (default {default_dtypes})")
    parser.add_argument(
        "--precision", "--precisions", dest="precisions", nargs="+",
        type=_items(lambda t: [parse_precision(t)]), metavar="P",
        help="fp32 GEMM precision for plain fp32: " + ", ".join(_precision.ALIASES)
             + f" (torch's names accepted; default {default_precisions})")


@dataclass(frozen=True)
class Selection:
    problems: tuple[int, ...]
    columns: tuple[Column, ...]


def selection(args: argparse.Namespace, *, default_dtypes: Sequence[str],
              default_fp32_precisions: Sequence[Optional[str]]) -> Selection:
    """What to run: the problems, and the dtype columns (plain fp32 x the precisions)."""
    problems = _flat(getattr(args, "problems", None)) or list(BY_NUMBER)
    return Selection(tuple(problems), columns(args, default_dtypes=default_dtypes,
                                              default_fp32_precisions=default_fp32_precisions))


def columns(args: argparse.Namespace, *, default_dtypes: Sequence[str],
            default_fp32_precisions: Sequence[Optional[str]]) -> tuple[Column, ...]:
    """The dtype columns of ``add_dtype_arguments``' options (plain fp32 x the precisions);
    ``default_dtypes`` may name whole columns (``fp32-tf32``)."""
    pairs = _flat(args.dtypes) or [p for d in default_dtypes for p in parse_dtype(d)]
    precisions = _flat(args.precisions) or list(default_fp32_precisions)
    out: list[Column] = []
    for dtype, prec in pairs:
        if dtype != "fp32":  # 16-bit, or autocast (torch's matmul precision)
            candidates = [Column(dtype)]
        elif prec is not None:
            candidates = [Column(dtype, prec)]
        else:
            candidates = [Column(dtype, p) for p in precisions]
        out += [c for c in candidates if c not in out]
    return tuple(out)
