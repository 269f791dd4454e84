"""KernelBench-style check of epifuse's ``ModelNew`` against the reference ``Model``.

The harness a KernelBench submission goes through: build ``Model`` and ``ModelNew`` from the
problem's ``get_init_inputs()``, give them the same weights, run both on ``get_inputs()``,
compare the outputs and time the forwards (CUDA events on a GPU).

    python examples/kernelbench.py --problem 84           # Gemm_BatchNorm_Scaling_Softmax
    python examples/kernelbench.py --problem 39 --small   # Gemm_Scale_BatchNorm, tiny sizes

Without a GPU it runs on the CPU at the tiny sizes (ModelNew then runs the reference math).
Exit status 1 when the outputs differ beyond KernelBench's tolerance (atol = rtol = 1e-2).
"""

import argparse
import sys
import time

import torch

import epifuse
from epifuse.problems import BY_NUMBER

SMALL = (64, 256, 128)  # batch, in_features, out_features


def sized(problem, small):
    """The problem's init inputs and inputs; (batch, in, out) = SMALL when small."""
    init_inputs, inputs = list(problem.get_init_inputs()), problem.get_inputs()
    if small:
        batch, k, n = SMALL
        # in_features, out_features, then the rest; a per-column scale shape follows out_features
        init_inputs = [k, n] + [(n,) if a == (problem.out_features,) else a
                                for a in init_inputs[2:]]
        inputs = [torch.rand(batch, k)]
    return init_inputs, inputs


def time_ms(fn, iters, device):
    """Mean milliseconds per call, after 3 warm-up calls (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problem", type=int, choices=sorted(BY_NUMBER), default=84)
    p.add_argument("--small", action="store_true", help=f"(batch, in, out) = {SMALL}")
    p.add_argument("--iters", type=int, default=20, help="timed calls per model")
    args = p.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small or device.type == "cpu"
    problem = BY_NUMBER[args.problem]
    init_inputs, inputs = sized(problem, small)

    model = problem.Model(*init_inputs).to(device)
    model_new = problem.ModelNew(*init_inputs).to(device)
    model_new.load_state_dict(model.state_dict())  # same weights (and running statistics)
    inputs = [x.to(device) for x in inputs]
    x = inputs[0]
    print(f"problem {args.problem} ({problem.__name__.rsplit('.', 1)[-1]}): "
          f"x {tuple(x.shape)}, out_features {init_inputs[1]}, {device}")

    reason = epifuse.fast_path_reason(model_new, x)  # None: ModelNew runs epifuse's kernels
    print(f"ModelNew path: {'fused' if reason is None else f'reference ({reason})'}")

    with torch.no_grad():  # training mode (batch statistics), as KernelBench runs the models
        out, out_new = model(*inputs), model_new(*inputs)
        diff = (out_new.float() - out.float()).abs().max().item()
        ok = torch.allclose(out_new, out, atol=1e-2, rtol=1e-2)
        print(f"max abs diff {diff:.3e} ({'OK' if ok else 'MISMATCH'} at atol = rtol = 1e-2)")
        ms = time_ms(lambda: model(*inputs), args.iters, device)
        ms_new = time_ms(lambda: model_new(*inputs), args.iters, device)
    print(f"Model {ms:.3f} ms, ModelNew {ms_new:.3f} ms: {ms / ms_new:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
