"""Randomized differential testing: ModelNew vs Model vs a float64 twin, on seeded random configs.

Each case is one seed; everything (problem, sizes, dtype/precision, mode, scale shape,
momentum, eps, input distribution, offsets) is drawn from it, and the seed is part of the
test id and of every failure message:

    pytest tests/test_random.py -k case0042          # replay one short case
    pytest tests/test_random.py --long -k long0042   # replay one long case

Short run: 200 cases, mostly tiny (runs with the normal GPU suite). Long run: 2000 cases with
bigger sizes, only with ``--long`` or EPIFUSE_LONG_TESTS=1.

Per case, two forward steps (different batches) of ModelNew, Model and the float64 twin of
Model's initial state. For every output and, after the steps, running_mean / running_var:

    err(ModelNew, twin) <= max(ORACLE_TOL[kind] * amp, 4 * err(Model, twin))

``amp`` (>= 1, training only) is the conditioning of the batch normalization: the RMS over
columns of (|mean z| + std z) / sqrt(var z + eps / pre^2), divided by 3 (its value for the
unshifted inputs that ORACLE_TOL was set on). It grows when a column's mean dwarfs its spread
(large-offset inputs, tiny batches): there the GEMM's rounding error is amplified by the
normalization, for Model and ModelNew alike. Large offsets are drawn only with IEEE fp32
(with TF32 they amplify 2^-11 by ~10^3: nothing is left to compare). num_batches_tracked
must equal Model's exactly; in eval the running statistics must be untouched.
"""

from __future__ import annotations

import random

import pytest
import torch

from epifuse import head
from helpers import (DTYPE_OF, ORACLE_TOL, PROBLEMS, float64_twin, init_args,
                     long_tests_requested, precision_of, randomize_, rel_err)

CUDA = torch.device("cuda")
SHORT_CASES, LONG_CASES = 200, 2000
LONG_SEED_BASE = 100_000
PRIMES = [2, 3, 5, 7, 11, 13, 17, 31, 61, 67, 127, 131, 251, 257, 383, 509, 521, 1009, 1031,
          2039, 2053, 3001, 4093, 4099]


def _size(rng: random.Random, long: bool) -> int:
    r = rng.random()
    tiny, medium = (0.45, 0.85) if long else (0.75, 0.96)
    cap = 4100 if long else 1100
    if rng.random() < 0.25:  # a prime of the same size class
        limit = 48 if r < tiny else 520 if r < medium else cap
        return rng.choice([p for p in PRIMES if p <= limit])
    if r < tiny:
        return rng.randint(1, 48)
    if r < medium:
        return rng.randint(49, 520)
    return rng.randint(521, cap)


def make_config(seed: int, long: bool = False) -> dict:
    """The whole case, drawn from its seed (pure Python: ids are stable across machines)."""
    rng = random.Random(seed)
    kind = rng.choices(["ieee", "3xtf32", "tf32", "bf16", "fp16"], weights=[3, 2, 3, 3, 2])[0]
    mode = rng.choices(["train", "eval"], weights=[3, 2])[0]
    m, n, k = _size(rng, long), _size(rng, long), _size(rng, long)
    if mode == "train" and m == 1:
        m = rng.choice([2, 3])
    while m * n * k > (6e9 if long else 4e8):  # keep the float64 twin cheap
        m = max(m // 2, 2)
        k = max(k // 2, 1)
    offset = None
    if kind in ("ieee", "3xtf32") and mode == "train" and rng.random() < 0.3:
        offset = rng.choice(["x+100", "bias1e4"])
    return {
        "seed": seed, "problem": rng.choice([84, 39]), "kind": kind, "mode": mode,
        "M": m, "N": n, "K": k,
        "scale": rng.choice(["1", "N"]),
        "momentum": rng.choice([0.1, 0.1, 0.5, 1.0, 0.0, 0.01, None]),
        "eps": rng.choices([1e-5, 1e-3, 0.1], weights=[6, 2, 1])[0],
        "input": rng.choice(["rand", "randn", "rand-0.5"]),
        "negative_scale": rng.random() < 0.3,
        "offset": offset,
    }


def _case_id(prefix: str, index: int, cfg: dict) -> str:
    return (f"{prefix}{index:04d}-p{cfg['problem']}-{cfg['mode']}-{cfg['kind']}"
            f"-M{cfg['M']}N{cfg['N']}K{cfg['K']}")


def pytest_generate_tests(metafunc):
    if "short_case" in metafunc.fixturenames:
        cfgs = [make_config(i) for i in range(SHORT_CASES)]
        metafunc.parametrize("short_case", cfgs,
                             ids=[_case_id("case", i, c) for i, c in enumerate(cfgs)])
    if "long_case" in metafunc.fixturenames:
        if long_tests_requested(metafunc.config):
            cfgs = [make_config(LONG_SEED_BASE + i, long=True) for i in range(LONG_CASES)]
            metafunc.parametrize("long_case", cfgs,
                                 ids=[_case_id("long", i, c) for i, c in enumerate(cfgs)])
        else:
            metafunc.parametrize("long_case", [pytest.param(None, marks=pytest.mark.skip(
                reason="long randomized run: pass --long or set EPIFUSE_LONG_TESTS=1"))],
                ids=["long-disabled"])


# --------------------------------------------------------------------------- one case

def _build(cfg):
    number, kind, n, k = cfg["problem"], cfg["kind"], cfg["N"], cfg["K"]
    module = PROBLEMS[number]
    scale_shape = (1,) if cfg["scale"] == "1" else (n,)
    args = init_args(number, k, n, scale_shape, eps=cfg["eps"], momentum=cfg["momentum"])
    torch.manual_seed(cfg["seed"])
    with torch.device(CUDA):  # initialized on the GPU: big Linear layers cost nothing
        ref = module.Model(*args)
        new = module.ModelNew(*args, precision=precision_of(kind))
    randomize_(ref, seed=cfg["seed"])
    with torch.no_grad():
        if cfg["negative_scale"]:
            g = torch.Generator(device=CUDA).manual_seed(cfg["seed"])
            signs = torch.randint(0, 2, ref.scale.shape, device=CUDA, generator=g) * 2 - 1
            ref.scale.mul_(signs)
        if cfg["offset"] == "bias1e4":
            ref.gemm.bias.add_(1e4)
    new.load_state_dict(ref.state_dict())
    dtype = DTYPE_OF[kind]
    return ref.to(dtype), new.to(dtype), dtype


def _input(cfg, dtype, step):
    g = torch.Generator(device=CUDA).manual_seed(cfg["seed"] * 7 + step)
    shape = (cfg["M"], cfg["K"])
    x = {"rand": lambda: torch.rand(shape, device=CUDA, generator=g),
         "randn": lambda: torch.randn(shape, device=CUDA, generator=g),
         "rand-0.5": lambda: torch.rand(shape, device=CUDA, generator=g) - 0.5}[cfg["input"]]()
    if cfg["offset"] == "x+100":
        x = x + 100
    return x.to(dtype)


def _amplification(twin, x64, training: bool, pre_scale) -> float:
    """RMS over columns of the normalization's conditioning, relative to unshifted inputs."""
    if not training:
        return 1.0
    z = x64 @ twin.gemm.weight.T
    mean, var = z.mean(0), z.var(0, unbiased=False)
    pre2 = 1.0 if pre_scale is None else pre_scale.double().square().clamp_min(1e-300)
    ratio = (mean.abs() + var.sqrt()) / (var + twin.bn.eps / pre2).sqrt()
    return max(1.0, ratio.square().mean().sqrt().item() / 3.0)


def run_case(cfg: dict, label: str) -> None:
    kind, training = cfg["kind"], cfg["mode"] == "train"
    ref, new, dtype = _build(cfg)
    twin = float64_twin(ref)
    for model in (ref, new, twin):
        model.train(training)
    init_stats = [new.bn.running_mean.clone(), new.bn.running_var.clone()]
    tol = ORACLE_TOL[kind]
    flag = "--long " if label.startswith("long") else ""
    replay = f"replay: pytest tests/test_random.py {flag}-k {label}"
    amps = []

    def check(name, got, want, oracle, factor=1.0):
        e_new, e_ref = rel_err(got, oracle), rel_err(want, oracle)
        amp = max(amps) if amps else 1.0
        bound = max(tol * amp * factor, 4 * e_ref)
        assert e_new <= bound, (
            f"{label} (seed {cfg['seed']}): {name}: ModelNew err {e_new:.3e} > bound {bound:.3e} "
            f"(Model err {e_ref:.3e}, tol {tol:.0e}, amp {amp:.1f})\n  config {cfg}\n  {replay}")

    with torch.no_grad():
        for step in range(2):
            x = _input(cfg, dtype, step)
            assert head.fast_path_reason(new, x) is None, f"{label}: fused path not taken"
            amps.append(_amplification(twin, x.double(), training,
                                       twin.scale if cfg["problem"] == 39 else None))
            y_new, y_ref, y64 = new(x), ref(x), twin(x.double())
            assert y_new.dtype == dtype and y_new.shape == (cfg["M"], cfg["N"]), label
            assert torch.isfinite(y_new).all(), f"{label}: non-finite output\n  {replay}"
            check(f"output step {step}", y_new, y_ref, y64)
        if training:
            check("running_mean", new.bn.running_mean, ref.bn.running_mean,
                  twin.bn.running_mean, factor=2.0)
            check("running_var", new.bn.running_var, ref.bn.running_var,
                  twin.bn.running_var, factor=2.0)
        else:
            assert torch.equal(new.bn.running_mean, init_stats[0]), f"{label}: eval moved stats"
            assert torch.equal(new.bn.running_var, init_stats[1]), f"{label}: eval moved stats"
    nbt_new, nbt_ref = new.bn.num_batches_tracked.item(), ref.bn.num_batches_tracked.item()
    assert nbt_new == nbt_ref == (2 if training else 0), (
        f"{label}: num_batches_tracked {nbt_new} vs Model {nbt_ref}\n  {replay}")


@pytest.mark.hopper
def test_random_short(short_case, request):
    run_case(short_case, request.node.callspec.id.split("-")[0])


@pytest.mark.hopper
def test_random_long(long_case, request):
    run_case(long_case, request.node.callspec.id.split("-")[0])


# --------------------------------------------------------------------------- the generator itself

def test_config_generator_covers_the_space():
    """CPU-side: the short run's draws cover what the test claims to cover."""
    cfgs = [make_config(i) for i in range(SHORT_CASES)]
    assert len({_case_id("case", i, c) for i, c in enumerate(cfgs)}) == SHORT_CASES
    seen = {key: {str(c[key]) for c in cfgs} for key in
            ("problem", "kind", "mode", "scale", "momentum", "offset", "input")}
    assert seen["problem"] == {"84", "39"} and seen["mode"] == {"train", "eval"}
    assert seen["kind"] == {"ieee", "3xtf32", "tf32", "bf16", "fp16"}
    assert seen["scale"] == {"1", "N"} and "None" in seen["momentum"]
    assert {"x+100", "bias1e4"} <= seen["offset"]
    sizes = [c[d] for c in cfgs for d in ("M", "N", "K")]
    assert min(sizes) == 1 and max(sizes) > 520
    assert sum(s in PRIMES and s > 100 for s in sizes) >= 5
    assert sum(s <= 48 for s in sizes) > len(sizes) // 2  # mostly tiny: the short run is quick
    assert all(c["M"] >= 2 for c in cfgs if c["mode"] == "train")
    assert all(c["offset"] is None or (c["kind"] in ("ieee", "3xtf32") and c["mode"] == "train")
               for c in cfgs)
    assert make_config(7) == make_config(7) and make_config(7) != make_config(8)
    long_cfgs = [make_config(LONG_SEED_BASE + i, long=True) for i in range(200)]
    assert max(c[d] for c in long_cfgs for d in ("M", "N", "K")) > 2000
