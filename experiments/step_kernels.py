"""Where a default-precision (fp32, 3x) training step's GPU time goes, kernel by kernel.

    PYTHONPATH=python python experiments/step_kernels.py [--cases p84 p39 projection]

For each case (problems 84 and 39 at KernelBench's shapes, the projection MLP at 4096 rows), the
fused model's training step with every parameter's version bumped (as an optimizer's update
would): the step's time (CUDA events, median) alone and queued (benchmarks.timing: the host ahead,
so the difference is the host's latency before the first kernel and any gaps), then one
torch.profiler recording of a few steps,
printed as GPU ms per step by (epifuse op, kernel), and where steps started from an idle GPU wait
on the host (``idle_gaps``). Then the forward GEMM op alone
(``gemm_colstats`` with a new weight version each call, and ``gemm_affine`` with a kept weight
split) and the SM clock and power over a second of steps and a second of forward GEMMs alone
(nvidia-smi), to tell kernel time from clock throttling.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import epifuse  # noqa: E402
from epifuse import problems  # noqa: E402
from epifuse.__main__ import median_ms  # noqa: E402
from benchmarks import step_gemms, timing  # noqa: E402
from benchmarks.real_heads import BATCH, DIMS, build_model  # noqa: E402

DEV = torch.device("cuda")


def short(name: str) -> str:
    """A kernel's name without template arguments and namespaces, CUTLASS's kept recognizable."""
    if "cutlass" in name or "GemmUniversal" in name or "device_kernel" in name:
        m = re.search(r"Sm90(\w+)", name)
        return "cutlass GEMM" + (f" ({m.group(0)[:40]})" if m else "")
    base = re.sub(r"\(anonymous namespace\)::", "", name)
    base = re.sub(r"^void ", "", base).split("(")[0]
    base = re.sub(r"<.*", "", base)
    return (base.split("::")[-1] or name)[:60]


def top_op(e) -> str:
    while e.cpu_parent is not None and not e.name.startswith("epifuse::"):
        e = e.cpu_parent
    return e.name if e.name.startswith("epifuse::") else "other"


def kernel_table(fn, steps: int = 3) -> None:
    """GPU ms per call by (op, kernel), from a profile whose schedule discards a warm-up call."""
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                schedule=schedule) as prof:
        for _ in range(steps + 2):
            fn()
            torch.cuda.synchronize()
            prof.step()
    times: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    calls: dict = defaultdict(int)
    for e in prof.events():
        if e.name.startswith("epifuse::"):
            calls[e.name] += 1
        for k in e.kernels:
            key = (top_op(e) if not e.name.startswith("epifuse::") else e.name, short(k.name))
            times[key] += k.duration / 1e3 / steps
            counts[key] += 1
    total = sum(times.values())
    print("  op calls per step: " + ", ".join(f"{k[9:]} {v / steps:g}" for k, v in calls.items()))
    print(f"  kernels per step, GPU ms (sum {total:.3f}):")
    for (op, kern), ms in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"    {ms:8.3f}  x{counts[(op, kern)] / steps:4.1f}  {op:32s} {kern}")


def idle_gaps(fn, steps: int = 3, shown: int = 4) -> None:
    """Where a step started from an idle GPU waits on the host: per step, the time from the step's
    start on the host to its first kernel, the GPU's idle time between its first kernel and its
    last, and the largest gaps with the kernels on either side and the host's CUDA calls that ran
    during each (a slow cudaMalloc, a synchronization). From a torch.profiler trace."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            with torch.profiler.record_function("idle_gaps.step"):
                fn()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace  # the host's, not the
                   if e.get("name") == "idle_gaps.step" and e.get("ph") == "X"  # GPU's copy
                   and e.get("cat") == "user_annotation")
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), short(e["name"])) for e in trace
                 if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    host = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("dur", 0) > 10]
    ops = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace
           if e.get("cat") in ("cpu_op", "python_function") and e.get("dur", 0) > 20]
    for i, (t0, _) in enumerate(spans):
        t1 = spans[i + 1][0] if i + 1 < len(spans) else float("inf")
        ks = [k for k in gpu if t0 <= k[0] < t1]
        if not ks:
            continue
        gaps, busy_end = [], ks[0][1]
        for prev, k in zip(ks, ks[1:]):
            if k[0] > busy_end:
                gaps.append((k[0] - busy_end, busy_end, prev[2], k[2]))
            busy_end = max(busy_end, k[1])
        idle = sum(g[0] for g in gaps)
        print(f"  idle step {i}: first kernel {(ks[0][0] - t0) / 1e3:.3f} ms after the step's "
              f"start; GPU span {(busy_end - ks[0][0]) / 1e3:.3f} ms, idle in it {idle / 1e3:.3f} "
              f"ms over {len(gaps)} gaps", flush=True)
        early = [f"{n} {(b - a) / 1e3:.3f}" for a, b, n in host if t0 <= a < ks[0][0]]
        print(f"    host calls before the first kernel: {', '.join(early[:6]) or '-'}", flush=True)
        # The host's ops that ran before the first kernel, longest first (nested ones included:
        # an op's time holds its children's).
        before = sorted(((b - a, n) for a, b, n in ops if t0 <= a < ks[0][0]), reverse=True)
        print("    ops before the first kernel (ms): " +
              (", ".join(f"{n} {d / 1e3:.3f}" for d, n in before[:8]) or "-"), flush=True)
        for gap, at, before, after in sorted(gaps, reverse=True)[:shown]:
            calls = [f"{n} {(b - a) / 1e3:.3f}" for a, b, n in host if a < at + gap and b > at]
            print(f"    {gap / 1e3:.3f} ms after {before} before {after}; host calls then: "
                  f"{', '.join(calls[:4]) or '-'}", flush=True)


def unscheduled_gemms(fn, steps: int = 3) -> dict:
    """step_gemms' ms per kind as it measured before its profile had a schedule."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out: dict = defaultdict(float)
    for kind, e in step_gemms._kinds(step_gemms.gemm_events(prof)):
        out[kind] += e.device_time_total / 1e3 / steps
    return out


class Clocks:
    """nvidia-smi's SM clock, power draw and whether the software power cap holds the clocks
    down, sampled every 20 ms while the ``with`` body runs (the first quarter dropped: the ramp);
    ``summary`` says them after it."""
    FIELDS = "clocks.sm,power.draw,clocks_event_reasons.sw_power_cap"

    def __enter__(self):
        idx = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        self.proc = subprocess.Popen(["nvidia-smi", "-i", idx, f"--query-gpu={self.FIELDS}",
                                      "--format=csv,noheader,nounits", "-lms", "20"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        rows = [line.split(",") for line in self.proc.communicate()[0].strip().splitlines()]
        rows = [r for r in rows if len(r) == 3]
        rows = rows[len(rows) // 4:]
        if not rows:
            self.summary = "no clock samples"
            return
        mhz = [float(r[0]) for r in rows]
        watts = [float(r[1]) for r in rows]
        capped = sum("Active" in r[2] for r in rows)
        self.summary = (f"SM {statistics.mean(mhz):.0f} MHz (min {min(mhz):.0f}), "
                        f"{statistics.mean(watts):.0f} W, power cap active in {capped} of "
                        f"{len(rows)} samples")


def clocks(fn, seconds: float = 1.0) -> str:
    """Clocks' summary while ``fn`` runs back to back for ``seconds``."""
    with Clocks() as clk:
        t0 = time.time()
        while time.time() - t0 < seconds:
            fn()
            torch.cuda.synchronize()
    return clk.summary


def problem_model(number: int):
    mod = problems.BY_NUMBER[number]
    init = mod.get_init_inputs()
    torch.manual_seed(0)
    model = mod.ModelNew(*init).to(DEV).train()
    x = torch.rand(*mod.get_inputs()[0].shape, device=DEV)
    return model, x


def projection_model():
    torch.manual_seed(0)
    dims = DIMS["projection"]
    model = build_model("projection", dims, bias=False).to(DEV).train()
    fused, _ = epifuse.fuse(model)
    return fused, torch.rand(BATCH, dims[0], device=DEV)


def run_case(name: str) -> None:
    model, x = projection_model() if name == "projection" else \
        problem_model(int(name[1:]))
    x.requires_grad_()
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.randn_like(model(x))

    def step():
        x.grad = None
        for p in params:
            p.grad = None
            torch.autograd.graph.increment_version(p)
        model(x).backward(g)

    queued = timing.measure_queued_rounds({"step": lambda _: step()}, [None], DEV, calls=8,
                                          rounds=3)["step"]
    print(f"== {name}: step {median_ms(step, 10, DEV):.3f} ms alone, "
          f"{queued['median_ms']:.3f} ms queued (the host ahead; GPU kept busy: "
          f"{queued['gpu_kept_busy']})", flush=True)
    kernel_table(step)
    try:
        idle_gaps(step)
    except Exception as e:  # noqa: BLE001 -- a trace format this torch does not write
        print(f"  idle gaps: not measured ({type(e).__name__}: {e})", flush=True)
    print(f"  clocks over steps: {clocks(step)}", flush=True)
    gemms = step_gemms.measure(lambda pair: step(), None, DEV)
    print("  benchmarks.step_gemms, ms per step: " +
          ", ".join(f"{k} {v['ms']:.3f}" for k, v in gemms.items()), flush=True)
    print("  the same from a profile started after a warm-up step: " +
          ", ".join(f"{k} {v:.3f}" for k, v in unscheduled_gemms(step).items()), flush=True)
    if name == "projection":
        return
    lin = model.gemm if hasattr(model, "gemm") else None
    w = lin.weight if lin is not None else next(p for p in params if p.dim() == 2)
    xd = x.detach()
    ops = torch.ops.epifuse
    n = w.shape[0]
    a, c = torch.ones(n, device=DEV), torch.zeros(n, device=DEV)

    def colstats_new_weight():
        torch.autograd.graph.increment_version(w)
        return ops.gemm_colstats(xd, w.detach(), "3xtf32")

    def affine_kept():
        return ops.gemm_affine(xd, w.detach(), a, c, "3xtf32")

    with torch.no_grad():
        for label, fn in (("gemm_colstats, new weight version", colstats_new_weight),
                          ("gemm_affine, kept weight split", affine_kept)):
            print(f"  {label}: {median_ms(fn, 10, DEV):.3f} ms", flush=True)
            kernel_table(fn)
        print(f"  clocks over gemm_colstats: {clocks(colstats_new_weight)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["p84", "p39", "projection"])
    args = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for name in args.cases:
        run_case(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
