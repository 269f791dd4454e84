"""Why a default-precision training step timed alone takes longer than the same step queued
behind others, fused against eager: the host's latency, or the GPU's clock.

    PYTHONPATH=python python experiments/step_latency.py [--cases 84 39 projection]

Per case (problems 84 and 39 at KernelBench's shapes, the projection MLP at 4096 rows) and model
(epifuse's, and the unfused one: the problem's Model, the MLP itself), in training mode with every
parameter's version bumped each step as an optimizer's update would, the step's CUDA-event time
(median of ``--iters`` steps, or of ~1.5 s of them) started these ways:

- queued:      benchmarks.timing.measure_queued_rounds (8 steps back to back behind a spin, the
               page's method), then the same 8 after 8 untimed ones in the queue (``sustained``);
- alone:       synchronize, then the step (the page's "alone" column, steps back to back);
- host ahead:  synchronize, a 2 ms spin kernel, then the step: the GPU starts it only once the
               host has issued everything it can, so what differs from "alone" is host latency
               and whatever the 2 ms of rest changes on the GPU;
- idle 2 ms:   synchronize, the host sleeps 2 ms, then the step: the GPU rests as long as behind
               the spin but the host is not ahead, so "idle 2 ms" minus "host ahead" is the host's
               latency before the first kernel, and "alone" minus "idle 2 ms" the rest's effect;
- busy wait:   as alone, but the host polls the end event instead of blocking in the driver.

Each with nvidia-smi's SM clock, power draw and software-power-cap flag over it
(``step_kernels.Clocks``), and the host's time to issue the forward and the whole step. Answer (H200): a fused step run back to
back draws the card's power cap and its clock falls 16-27%; eager's stays at 1980 MHz
(docs/performance.md, "What bounds 4x eager").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import epifuse  # noqa: E402
from epifuse import problems  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks.real_heads import BATCH, DIMS, build_model  # noqa: E402
from step_kernels import Clocks  # noqa: E402 -- the nvidia-smi sampler, beside this file

DEV = torch.device("cuda")


def make_step(model, x):
    x = x.clone().requires_grad_()
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.randn_like(model(x))
    marks = {}

    def step():
        t0 = time.perf_counter()
        x.grad = None
        for p in params:
            p.grad = None
            torch.autograd.graph.increment_version(p)
        out = model(x)
        marks["forward"] = time.perf_counter() - t0
        out.backward(g)
        marks["step"] = time.perf_counter() - t0
    return step, marks


def started(step, marks, mode: str, iters: int) -> tuple[float, float, float]:
    """Median (GPU ms, host forward ms, host step ms) of ``iters`` steps started as ``mode``."""
    spin = int(2e-3 * timing._cycles_per_s(DEV))
    gpu, fwd, host = [], [], []
    for _ in range(3):
        step()
    for _ in range(iters):
        torch.cuda.synchronize()
        if mode == "host ahead":
            torch.cuda._sleep(spin)
        elif mode == "idle 2 ms":
            time.sleep(2e-3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        if mode == "busy wait":
            while not end.query():
                pass
        else:
            end.synchronize()
        gpu.append(start.elapsed_time(end))
        fwd.append(marks["forward"] * 1e3)
        host.append(marks["step"] * 1e3)
    return statistics.median(gpu), statistics.median(fwd), statistics.median(host)


def models(case: str):
    """(input, [(label, model factory)]) for a KernelBench problem's number or "projection"
    (the MoCo v3 projection MLP at 4096 rows, fused by epifuse.fuse)."""
    if case == "projection":
        dims = DIMS["projection"]

        def eager():
            return build_model("projection", dims, bias=False)

        return (torch.rand(BATCH, dims[0], device=DEV),
                [("fused", lambda: epifuse.fuse(eager().to(DEV))[0]), ("eager", eager)])
    mod = problems.BY_NUMBER[int(case)]
    init = mod.get_init_inputs()
    return (torch.rand(*mod.get_inputs()[0].shape, device=DEV),
            [("fused", lambda: mod.ModelNew(*init)), ("eager", lambda: mod.Model(*init))])


def sustained(step, calls: int = 8, rounds: int = 12) -> float:
    """Median ms per step of ``calls`` steps queued back to back after ``calls`` untimed ones in
    the same queue (behind a spin while the host issues them all), so that the timed steps start at
    the clock a GPU kept busy settles to, where measure_queued_rounds' start from its spin's."""
    spin = int(0.03 * timing._cycles_per_s(DEV))
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        for _ in range(calls):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / calls)
    return statistics.median(per)


def run_case(case: str, iters: int) -> None:
    x, makers = models(case)
    name = case if case == "projection" else f"p{case}"
    for label, make in makers:
        torch.manual_seed(0)
        model = make().to(DEV).train()
        step, marks = make_step(model, x)
        q = timing.measure_queued_rounds({"s": lambda _, fn=step: fn()}, [None], DEV, calls=8,
                                         rounds=3)["s"]
        print(f"== {name} {label}: queued {q['median_ms']:.3f} ms "
              f"(GPU kept busy: {q['gpu_kept_busy']})", flush=True)
        # (no clocks here: the samples would mix the rounds' spins in)
        print(f"  queued after 8 untimed steps: {sustained(step):.3f} ms", flush=True)
        # Each mode runs for ~1.5 s, long enough for the clocks to settle where the mode puts them.
        n = max(iters, int(1500 / q["median_ms"]))
        for mode in ("alone", "host ahead", "idle 2 ms", "busy wait"):
            with Clocks() as clk:
                g, f, h = started(step, marks, mode, n)
            print(f"  {mode:10s}: step {g:.3f} ms on the GPU's clock; host issued the forward in "
                  f"{f:.3f} ms, the step in {h:.3f} ms; {clk.summary}", flush=True)
        del model, step, marks
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["84", "39", "projection"])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for number in args.cases:
        run_case(number, args.iters)


if __name__ == "__main__":
    main()
