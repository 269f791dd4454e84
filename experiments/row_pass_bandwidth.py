"""Bandwidth of the row passes through the ops: the widening passes (16-bit z -> fp32 output, a head
under autocast) against the same-dtype ones and torch's widening copy, at the KernelBench shapes and
two more; best of 20 CUDA-event timings, z reused (warm in L2 where it fits). Results:
experiments/README.md, "row_pass_bandwidth.py". Needs the built library (scripts/build.sh) and a
CUDA GPU; from the repository root:

    PYTHONPATH=python python experiments/row_pass_bandwidth.py
"""
import torch

import epifuse  # noqa: F401  (loads the op library: torch.ops.epifuse)

ops = torch.ops.epifuse


def best_us(f, reps=20):
    f()
    f()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1))
    return best * 1000


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    for (m, n) in ((16384, 4096), (1024, 8192), (4096, 8192), (4096, 1000)):
        for dt in (torch.bfloat16, torch.float16):
            z = (torch.randn(m, n, device="cuda") * 3).to(dt)
            a = torch.rand(n, device="cuda") + 0.5
            c = torch.randn(n, device="cuda")
            rows = [  # (name, call, bytes per element read + written)
                ("affine widening", lambda: ops.affine(z, a, c, out_dtype=torch.float32), 6),
                ("affine same dtype", lambda: ops.affine(z, a, c), 4),
                ("affine_softmax widening",
                 lambda: ops.affine_softmax(z, a, c, out_dtype=torch.float32), 6),
                ("affine_softmax same dtype", lambda: ops.affine_softmax(z, a, c), 4),
                ("torch copy z.float()", lambda: z.float(), 6)]
            for name, f, bpe in rows:
                us = best_us(f)
                print(f"{m}x{n} {str(dt)[6:]:9s} {name:27s} {us:8.1f} us "
                      f"{m * n * bpe / us * 1e-6:6.2f} TB/s")


if __name__ == "__main__":
    main()
