"""The 3x split of transposed operands: 64 x 64 tiles of 16-byte vectors against the general
32 x 64 tiles of single elements (split_fp16.cu), in the backward products that read them.

    PYTHONPATH=python python experiments/split_tiles.py

Each setting runs in a child process (EPIFUSE_SPLIT_WIDE_TILES is read once per process): the
products' time (CUDA events, median of 20 calls) and, from one profiled call, the time of each
split kernel. Products: problem 39's dW = dZ^T . X (16384 x 4096 both: two 256 MiB transposed
splits), problem 84's dX = dZ . W (W^T, 8192 x 8192: two chunks of 4096 rows) and dW (1024 rows).
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = {
    "p39 dW = dZ^T . X": ((16384, 4096), (16384, 4096), "dw"),
    "p84 dX = dZ . W": ((1024, 8192), (8192, 8192), "dx"),
    "p84 dW = dZ^T . X": ((1024, 8192), (1024, 8192), "dw"),
}


def child() -> None:
    import torch

    from epifuse import ops
    from epifuse.__main__ import median_ms

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (a_shape, b_shape, kind) in CASES.items():
        dz = torch.randn(*a_shape, device="cuda", generator=g)
        b = torch.randn(*b_shape, device="cuda", generator=g)
        fn = (lambda: ops.backward_matmul(dz.t(), b, "3xtf32")) if kind == "dw" else \
             (lambda: ops.backward_matmul(dz, b, "3xtf32"))
        ms = median_ms(fn, 20, torch.device("cuda"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        splits = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and "split_fp16" in ev.name:
                key = ev.name.split("(")[0].split("::")[-1].split("<")[0]
                splits[key] = splits.get(key, 0.0) + ev.device_time / 1e3
        parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(splits.items()))
        print(f"{name}: {ms:.3f} ms; split kernels (ms): {parts}", flush=True)


def main() -> None:
    if "--child" in sys.argv:
        child()
        return
    for label, value in (("64 x 64 vector tiles (default)", None), ("32 x 64 tiles", "0")):
        env = dict(os.environ)
        env.pop("EPIFUSE_SPLIT_WIDE_TILES", None)
        if value is not None:
            env["EPIFUSE_SPLIT_WIDE_TILES"] = value
        print(f"== {label}", flush=True)
        subprocess.run([sys.executable, __file__, "--child"], env=env, check=True)


if __name__ == "__main__":
    main()
