"""bench.json: written after every configuration, and read back by --resume.

A run that is cut short (a time limit, an out-of-memory kill) leaves every
configuration measured so far in bench.json ("complete": false); running the
same command again with --resume measures only the missing ones.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .accuracy import ErrorStats
from .configs import DTYPES, Case, HostPoint, Shape
from .hosttime import HostResult, host_from_dict
from .kernels import CopyResult, SoftmaxResult
from .report import json_report
from .runner import CaseResult
from .timing import Timing


def save(path: str, env: dict, settings: dict, results, softmax, copy, complete: bool,
         host=()) -> None:
    """Write atomically (a kill mid-write leaves the previous file)."""
    doc = json_report(env, settings, results, softmax, copy, complete=complete, host=host)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(doc)
    os.replace(tmp, path)


def _num(v):
    return float(v) if isinstance(v, str) else v  # "inf"/"nan" were written as strings


# Implementations renamed since a bench.json was written: old name -> new name.
_RENAMED = {"cublas": "torch_mm"}


def _timings(d: dict) -> dict[str, Timing]:
    return {_RENAMED.get(k, k): Timing(**{f: _num(x) for f, x in v.items()})
            for k, v in (d or {}).items()}


def _errors(d: dict) -> dict[str, ErrorStats]:
    return {k: ErrorStats(_num(v["rel_fro"]), _num(v["max_abs"]), v["finite"])
            for k, v in (d or {}).items()}


def case_key(case: Case) -> tuple:
    s = case.shape
    return (s.problem, s.tag, s.m, s.k, s.n, case.spec.name, case.mode, case.compile)


def case_from_dict(d: dict) -> CaseResult:
    shape = Shape(d["problem"], d["M"], d["K"], d["N"], d["tag"])
    case = Case(shape, DTYPES[d["dtype"]], d["mode"], compile=d["compile_timed"],
                gemm_alone=d["gemm_alone"], skip=d.get("skipped"),
                compile_note=d.get("compile_note"))
    failures = {_RENAMED.get(k, k): v for k, v in (d.get("failures") or {}).items()}
    return CaseResult(case, path=d.get("path"), timings=_timings(d.get("timings_ms")),
                      failures=failures,
                      accuracy=_errors(d.get("errors_vs_fp64")),
                      kb_reference_ms=d.get("kb_reference_ms"), gemm_op=d.get("gemm_op"),
                      wall_s=d.get("wall_s") or 0.0)


def host_key(point: HostPoint) -> tuple:
    s = point.shape
    return (s.problem, s.m, s.k, s.n, point.spec.name, point.mode)


def host_point_from_dict(d: dict) -> HostPoint:
    return HostPoint(Shape(d["problem"], d["M"], d["K"], d["N"], d["tag"]), DTYPES[d["dtype"]],
                     d["mode"])


def softmax_key(dtype: str, n: int, m: int) -> tuple:
    return (dtype, n, m)


def softmax_from_dict(d: dict, copy_gbps: Optional[float]) -> SoftmaxResult:
    return SoftmaxResult(d["dtype"], d["M"], d["N"], d["bytes_read_plus_written"],
                         timings=_timings(d.get("timings_ms")),
                         failures=dict(d.get("failures") or {}),
                         accuracy=_errors(d.get("errors_vs_fp64")), copy_gbps=copy_gbps)


def copy_from_dict(d: Optional[dict]) -> Optional[CopyResult]:
    if not d or d.get("timing_ms") is None:
        return None  # a failed copy measurement is measured again
    return CopyResult(d["bytes_read_plus_written"], Timing(**d["timing_ms"]), d.get("failure"))


class Previous:
    """The results of an earlier run in the same --out, usable when the GPU is the same."""

    def __init__(self, path: str, env: dict, log) -> None:
        self.cases: dict[tuple, CaseResult] = {}
        self.host: dict[tuple, HostResult] = {}  # bench.json files before host time have none
        self.softmax: dict[tuple, dict] = {}
        self.copy: Optional[CopyResult] = None
        self.date: Optional[str] = None
        self.commands: list[str] = []
        if not os.path.exists(path):
            log(f"--resume: no {path} yet; measuring everything")
            return
        try:
            with open(path) as f:
                doc = json.load(f)
            old_env = doc.get("env", {})
            same = all(old_env.get(k) == env.get(k) for k in ("gpu", "torch", "cuda", "device"))
            if not same:
                log(f"--resume: {path} was measured on {old_env.get('gpu')} / torch "
                    f"{old_env.get('torch')}; not reusing it")
                return
            for d in doc.get("cases", []):
                r = case_from_dict(d)
                self.cases[case_key(r.case)] = r
            for d in doc.get("host_time", []):
                r = host_from_dict(d, host_point_from_dict(d))
                self.host[host_key(r.point)] = r
            for d in doc.get("softmax", []):
                self.softmax[softmax_key(d["dtype"], d["N"], d["M"])] = d
            self.copy = copy_from_dict(doc.get("copy_bandwidth"))
            self.date = old_env.get("date")
            self.commands = list(old_env.get("commands") or [old_env.get("command")])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log(f"--resume: cannot read {path} ({type(e).__name__}: {e}); measuring everything")
            self.cases, self.host, self.softmax, self.copy = {}, {}, {}, None
            return
        log(f"--resume: reusing {len(self.cases)} configurations, {len(self.host)} host-time "
            f"points and {len(self.softmax)} softmax points from {path} ({self.date})")
