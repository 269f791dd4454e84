"""Real heads: the models people train with Linear -> BatchNorm1d -> activation heads, fused by
``epifuse.fuse`` as a user would, against eager PyTorch and ``torch.compile`` of the same model.

    python -m benchmarks.real_heads [--batch 4096] [--out bench-out/real-heads]
                                    [--markdown PATH] [--dry]

Models (sizes of MoCo v3's projector on a ResNet-50 and of an ImageNet classifier head):
  projection   Linear(2048, 4096) -> BN -> ReLU -> Linear(4096, 4096) -> BN -> ReLU
               -> Linear(4096, 256) -> BatchNorm1d(256, affine=False)
  classifier   Linear(2048, 4096) -> BN -> GELU -> Linear(4096, 1000) -> BN -> Softmax(dim=1)
Settings: fp32 at PyTorch's default precision ('highest'), TF32 ('high'), and torch.autocast bf16
and fp16 (fp32 parameters and inputs, the backward outside the region). Modes: training-mode forward
(no_grad), eval forward, training step (forward + backward with dX, the parameters' versions
bumped each step as an optimizer's update would), and the same step queued: its GPU time with the
host ahead (timing.measure_queued_rounds: steps issued behind a spin kernel and timed back to back),
what the head costs inside a model whose GPU work hides the host, where "train-step" times each
step alone, host latency included. Timing as the main benchmark (benchmarks/timing.py: CUDA
events, inputs rotated, implementations interleaved in 3 rounds).
--dry runs tiny shapes on whatever device there is (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from typing import Callable, Optional

import torch
from torch import nn

import epifuse

from . import timing
from .cases import make_step

MODELS = ("projection", "classifier")
SETTINGS = ("fp32", "tf32", "amp-bf16", "amp-fp16")
AUTOCAST_DTYPES = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}
MODES = ("train", "eval", "train-step", "train-step-queued")


def build_model(name: str, dims: tuple[int, int, int]) -> nn.Module:
    """The unfused model, initialized from the current RNG state."""
    d_in, hidden, d_out = dims
    if name == "projection":
        return nn.Sequential(
            nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, d_out), nn.BatchNorm1d(d_out, affine=False))
    if name == "classifier":
        return nn.Sequential(
            nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.GELU(),
            nn.Linear(hidden, d_out), nn.BatchNorm1d(d_out), nn.Softmax(dim=1))
    raise ValueError(f"unknown model {name!r} (expected one of {MODELS})")


@contextlib.contextmanager
def _precision(setting: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if setting == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _in_region(fn: Callable, setting: str, device: torch.device) -> Callable:
    if not setting.startswith("amp-"):
        return fn

    def call(x, dtype=AUTOCAST_DTYPES[setting]):
        with torch.autocast(device.type, dtype=dtype):
            return fn(x)
    return call


def _callables(models: dict[str, nn.Module], mode: str, setting: str,
               device: torch.device) -> dict[str, Callable]:
    fns = {}
    for impl, model in models.items():
        forward = _in_region(model, setting, device)
        model.train(mode != "eval")
        if mode.startswith("train-step"):
            fns[impl] = make_step(model, forward, new_weights=True)
        else:
            def call(x, forward=forward):
                with torch.no_grad():
                    return forward(x)
            fns[impl] = call
    return fns


def _timings(results: dict) -> dict:
    """Per implementation, its timing dict, or {"error": ...} for one that raised."""
    return {k: ({"error": f"{type(v).__name__}: {v}"} if isinstance(v, Exception) else v)
            for k, v in results.items()}


def run_case(model_name: str, setting: str, mode: str, dims, batch: int, device: torch.device,
             settings: timing.Settings, compile_: bool) -> dict:
    torch.manual_seed(0)
    eager = build_model(model_name, dims).to(device)
    fused = copy.deepcopy(eager)
    _, report = epifuse.fuse(fused)
    models = {"ours": fused, "eager": eager}
    if compile_:
        # A fresh dynamo cache for every case, as the main benchmark's (cases.py): each case
        # compiles another model instance of the same code, and past dynamo's recompile limit the
        # compiled wrapper runs eager without a word (a full run's later rows timed eager twice).
        torch._dynamo.reset()
        models["compile"] = torch.compile(copy.deepcopy(eager))
    row = {"model": model_name, "setting": setting, "mode": mode, "batch": batch,
           "fused": [f.where for f in report.fused], "skipped": [s.where for s in report.skipped]}
    g = torch.Generator(device=device).manual_seed(1)
    count = timing.rotation_count(batch * dims[0] * 4, device, cap=4)
    xs = [torch.rand(batch, dims[0], device=device, generator=g) for _ in range(count)]
    if mode.startswith("train-step"):
        inputs = [(x.clone().requires_grad_(), torch.randn(batch, dims[2], device=device,
                                                           generator=g)) for x in xs]
    else:
        inputs = xs
    with _precision(setting):
        fns = _callables(models, mode, setting, device)
        row["peak_mib"] = {}  # a queued step's peak is its train-step row's
        if mode == "train-step-queued":
            # Rounds of 10 steps (fewer in a dry run's few iterations).
            row["timings_ms"] = _timings(timing.measure_queued_rounds(
                fns, inputs, device, calls=min(10, settings.iters),
                rounds=min(5, settings.iters), warmup=settings.warmup))
            return row
        results = timing.measure_rounds(fns, inputs, device, settings)
        row["timings_ms"] = _timings({k: (v if isinstance(v, Exception) else timing.to_dict(v))
                                      for k, v in results.items()})
        for impl, fn in fns.items():
            if isinstance(results[impl], Exception):
                continue
            peak = timing.peak_memory(fn, inputs[0], device, getattr(fn, "release", None))
            if peak is not None:
                row["peak_mib"][impl] = peak / 2**20
    return row


def _ms(row: dict, impl: str) -> Optional[float]:
    t = row["timings_ms"].get(impl)
    return None if t is None or "error" in t else t["median_ms"]


def markdown(rows: list[dict], env: dict) -> str:
    batch = rows[0]["batch"] if rows else "-"
    lines = ["## Real heads: models fused by epifuse.fuse against eager and torch.compile", "",
             f"- GPU: {env['gpu']}; PyTorch {env['torch']}; batch {batch}",
             "- `python -m benchmarks.real_heads` (median ms per call; peak MiB of one call)", "",
             "| model | setting | mode | fused heads | ours ms | eager ms | compile ms | vs eager "
             "| vs compile | peak MiB ours / eager |",
             "|:--|:--|:--|:--|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        ours, eager, comp = _ms(r, "ours"), _ms(r, "eager"), _ms(r, "compile")

        def f(v):
            return "n/a" if v is None else f"{v:.4g}"

        def ratio(a, b):
            return "n/a" if a is None or b is None else f"{b / a:.2f}x"
        pk = r.get("peak_mib", {})
        peak = (f"{pk['ours']:.0f} / {pk['eager']:.0f}" if "ours" in pk and "eager" in pk
                else "n/a")
        lines.append(f"| {r['model']} | {r['setting']} | {r['mode']} | {len(r['fused'])} "
                     f"| {f(ours)} | {f(eager)} | {f(comp)} | {ratio(ours, eager)} "
                     f"| {ratio(ours, comp)} | {peak} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_heads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    p.add_argument("--out", default="bench-out/real-heads")
    p.add_argument("--markdown", default=None, help="also write the Markdown table to PATH")
    p.add_argument("--dry", action="store_true", help="tiny shapes, few calls (smoke test)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = {"projection": (2048, 4096, 256), "classifier": (2048, 4096, 1000)}
    batch, settings = args.batch, timing.Settings()
    if args.dry:
        dims = {"projection": (32, 64, 16), "classifier": (32, 64, 10)}
        batch, settings = 64, timing.Settings(warmup=1, iters=3, min_iters=1)
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)",
           "torch": torch.__version__}
    rows: list[dict] = []
    os.makedirs(args.out, exist_ok=True)

    def save() -> str:  # after every case, so that an interrupted run keeps what it measured
        with open(os.path.join(args.out, "real_heads.json"), "w") as fh:
            json.dump({"env": env, "rows": rows}, fh, indent=1)
        text = markdown(rows, env)
        for path in [os.path.join(args.out, "real_heads.md")] + [args.markdown] * bool(
                args.markdown):
            with open(path, "w") as fh:
                fh.write(text)
        return text

    for model_name in args.models:
        for setting in args.settings:
            if setting.startswith("amp-") and device.type != "cuda":
                continue  # CPU autocast takes the reference path: nothing to compare
            for mode in args.modes:
                row = run_case(model_name, setting, mode, dims[model_name], batch, device,
                               settings, compile_=not args.no_compile and device.type == "cuda")
                rows.append(row)
                save()
                print(f"{model_name} {setting} {mode}: ours {_ms(row, 'ours')} eager "
                      f"{_ms(row, 'eager')} compile {_ms(row, 'compile')} ms; fused "
                      f"{row['fused']}", flush=True)
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
