"""benchmarks.loop: the training-loop section (plan, steps, path check, rows, report), CPU only."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import epifuse
from benchmarks import __main__ as bench_main, loop, report, timing
from benchmarks.cases import DTYPES
from benchmarks.real_heads import build_model

TINY = timing.Settings(warmup=1, iters=2, max_seconds=0.5, min_iters=1)
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- the plan


def test_full_plan_rows_are_model_batch_setting_optimizer():
    groups = loop.plan(loop.MODELS, loop.SETTINGS, loop.BATCHES, loop.OPTIMIZERS, dry=False)
    assert len(groups) == 2 * 3 * 3
    rows = [(g.model, g.batch, g.spec.name, o) for g in groups for o in g.optimizers]
    assert len(rows) == 36 and rows[:4] == [("projection", 256, "fp32-tf32", "sgd"),
                                             ("projection", 256, "fp32-tf32", "adamw"),
                                             ("projection", 256, "amp-bf16", "sgd"),
                                             ("projection", 256, "amp-bf16", "adamw")]
    assert {g.batch for g in groups} == {256, 1024, 4096}
    assert all(g.impls == loop.IMPLS for g in groups)
    proj = groups[0]
    assert proj.dims == (2048, 4096, 256) and proj.layers == [(2048, 4096), (4096, 4096),
                                                              (4096, 256)]
    assert proj.flops == 3 * 2.0 * 256 * (2048 * 4096 + 4096 * 4096 + 4096 * 256)
    assert loop.plan(["classifier"], ["amp-fp16"], [8], ["sgd"], dry=False,
                     compile=False)[0].impls == ("eager", "fused")


def test_dry_plan_is_tiny():
    groups = loop.plan(loop.MODELS, loop.SETTINGS, loop.DRY_BATCHES, loop.OPTIMIZERS, dry=True)
    assert all(g.batch <= 64 and max(g.dims) <= 64 for g in groups)


@pytest.mark.parametrize("kwargs, message", [
    (dict(settings=["fp32-3xtf32"]), "setting"), (dict(optimizers=["lamb"]), "optimizer"),
    (dict(batches=[1]), "at least 2 rows")])
def test_plan_refuses_what_the_loop_does_not_run(kwargs, message):
    args = dict(models=loop.MODELS, settings=loop.SETTINGS, batches=loop.BATCHES,
                optimizers=loop.OPTIMIZERS)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        loop.plan(args["models"], args["settings"], args["batches"], args["optimizers"],
                  dry=False)


def test_settings_are_the_pages_columns_the_loop_runs():
    assert loop.settings_for(["fp32-3xtf32", "fp32-tf32", "amp-bf16", "amp-fp16"]) == [
        "fp32-tf32", "amp-bf16", "amp-fp16"]
    assert loop.settings_for(["bf16", "fp32-3xtf32"]) == []


def test_the_section_fits_about_five_minutes_on_one_gpu():
    """The page's plan (36 rows, 72 compiled models, the host-time table) is estimated at about
    five minutes with the page's and --quick's settings (measured on an H200: ~300 s, the
    compiles most of it)."""
    groups = loop.plan(loop.MODELS, loop.SETTINGS, loop.BATCHES, loop.OPTIMIZERS, dry=False)
    for settings in (timing.Settings(), timing.Settings(warmup=3, iters=10, max_seconds=0.5)):
        total = loop.estimate_s(groups, settings, False, loop.SETTINGS)
        assert 240 < total < 360, total
        s = loop.timing_settings(settings)
        assert s.iters <= 50 and s.warmup <= 3 and s.max_seconds <= 0.5
    assert loop.estimate_s(loop.plan(loop.MODELS, loop.SETTINGS, loop.BATCHES, loop.OPTIMIZERS,
                                     dry=False, compile=False), timing.Settings(), False) < 60


# --------------------------------------------------------------------------- the models, a step


def test_projection_is_moco_v3s_and_both_models_fuse_every_head():
    model = build_model("projection", (8, 16, 4), bias=loop.BIAS["projection"])
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert len(linears) == 3 and all(m.bias is None for m in linears)
    assert not model[-1].affine and model[1].affine
    assert build_model("projection", (8, 16, 4))[0].bias is not None  # real heads' default
    for name, heads in (("projection", 3), ("classifier", 2)):
        _, rep = epifuse.fuse(build_model(name, (8, 16, 4), bias=loop.BIAS[name]))
        assert len(rep.fused) == heads and rep.skipped == []


@pytest.mark.parametrize("setting", loop.SETTINGS)
@pytest.mark.parametrize("opt", loop.OPTIMIZERS)
def test_a_step_zeroes_updates_and_scales_as_a_user_would(setting, opt):
    torch.manual_seed(0)
    spec = DTYPES[setting]
    model = build_model("classifier", (8, 16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer, how = loop.make_optimizer(opt, model.parameters(), CPU)
    assert how == "fused" and optimizer.defaults.get("fused")
    step = loop.make_loop_step(model, model, optimizer, spec, CPU)
    assert (step.scaler is not None) == (setting == "amp-fp16")
    x = torch.rand(16, 8).requires_grad_()
    g = torch.randn(16, 4) / 16
    for _ in range(3):
        step((x, g))
    assert x.grad is not None and x.grad.shape == x.shape
    # Every weight was updated (a Linear's bias before a BatchNorm gets no gradient), so the
    # scaler skipped no step at the last.
    moved = {n: not torch.equal(a, p.detach())
             for (n, p), a in zip(model.named_parameters(), before) if n.endswith("weight")}
    assert all(moved.values()), moved
    assert all(p.grad is not None for p in model.parameters())


def test_a_step_starts_from_fresh_gradients():
    model = build_model("classifier", (8, 16, 4))
    optimizer, _ = loop.make_optimizer("sgd", model.parameters(), CPU)
    step = loop.make_loop_step(model, model, optimizer, DTYPES["fp32-tf32"], CPU)
    x, g = torch.rand(16, 8).requires_grad_(), torch.randn(16, 4)
    step((x, g))
    first = x.grad.clone()
    step((x, g))  # not accumulated into the first step's gradient
    assert not torch.allclose(x.grad, 2 * first)


def test_reduce_overhead_steps_mark_a_new_cuda_graph_step(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = build_model("classifier", (8, 16, 4))
    optimizer, _ = loop.make_optimizer("adamw", model.parameters(), CPU)
    pair = (torch.rand(16, 8).requires_grad_(), torch.randn(16, 4))
    loop.make_loop_step(model, model, optimizer, DTYPES["amp-bf16"], CPU)(pair)
    assert marks == []
    loop.make_loop_step(model, model, optimizer, DTYPES["amp-bf16"], CPU, cuda_graphs=True)(pair)
    assert marks == [1]


def test_unsupported_fused_optimizer_falls_back_and_says_so(monkeypatch):
    real = torch.optim.SGD

    def sgd(params, *args, fused=None, **kwargs):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be CUDA tensors")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", sgd)
    opt, how = loop.make_optimizer("sgd", nn.Linear(2, 2).parameters(), CPU)
    assert isinstance(opt, real) and not opt.defaults.get("fused")
    assert how.startswith("default (RuntimeError: `fused=True` requires")


# --------------------------------------------------------------------------- the path


def test_count_head_ops_counts_dispatches(monkeypatch):
    """torch.profiler's CPU events of the named ops, forward and backward (stand-ins: the fused
    ops run on CUDA only)."""
    monkeypatch.setattr(loop, "HEAD_OPS", ("aten::mm", "aten::t"))
    a = torch.randn(4, 4)
    counts = loop.count_head_ops(lambda: (torch.mm(a, a), torch.mm(a, a), a.t()))
    assert counts == {"forward": 2, "backward": 1, "linear": 0}


def test_on_the_cpu_the_fused_heads_fall_back_with_the_reason():
    model = build_model("projection", (8, 16, 4), bias=False)
    epifuse.fuse(model)
    x = torch.rand(4, 8)
    calls = []
    path = loop.check_path(lambda: calls.append(model(x)), model, x, 3, DTYPES["amp-bf16"], CPU)
    assert path == {"forward": 0, "backward": 0, "linear": 0, "heads": 3, "linears": 0,
                    "reason": "input is on cpu, not CUDA"}
    assert len(calls) == 1  # the step still ran


def test_a_fused_step_that_ran_every_head_is_not_marked(monkeypatch):
    monkeypatch.setattr(loop, "head_reason", lambda *a: None)
    monkeypatch.setattr(loop, "count_head_ops", lambda fn: {"forward": 3, "backward": 3,
                                                                "linear": 0})
    path = loop.check_path(lambda: None, nn.Linear(2, 2), torch.rand(2, 2), 3,
                           DTYPES["fp32-tf32"], CPU)
    assert path["reason"] is None
    monkeypatch.setattr(loop, "count_head_ops", lambda fn: {"forward": 3, "backward": 0,
                                                                "linear": 0})
    path = loop.check_path(lambda: None, nn.Linear(2, 2), torch.rand(2, 2), 3,
                           DTYPES["fp32-tf32"], CPU, compiled=True)
    assert path["reason"] == "the compiled model did not call the fused ops"


# --------------------------------------------------------------------------- rows


def test_a_group_gives_a_row_per_optimizer_with_every_implementation(monkeypatch):
    resets = []
    real_reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1) or real_reset())
    (group,) = loop.plan(["classifier"], ["amp-fp16"], [16], loop.OPTIMIZERS, dry=True)
    rows = loop.run_group(group, CPU, TINY)
    assert [r["optimizer"] for r in rows] == ["sgd", "adamw"] and len(resets) == 2
    for r in rows:
        assert set(r["timings_ms"]) == set(loop.IMPLS) == set(r["queued_ms"]) == set(r["host_ms"])
        assert all(t["median_ms"] > 0 for t in r["host_ms"].values())
        assert all(t["median_ms"] > 0 and t["alone"] for t in r["timings_ms"].values())
        assert r["optimizer_impl"] == "fused" and r["fused_heads"] == 2
        assert set(r["path"]) == set(loop.FUSED_IMPLS)
        assert report.loop_path(r) == [(i, "input is on cpu, not CUDA") for i in loop.FUSED_IMPLS]
        assert loop.row_key(r) == ("classifier", 16, "amp-fp16", r["optimizer"])
    assert set(rows[0]["first_call_s"]) == set(loop.IMPLS)  # the compiling calls, recorded
    assert "fell back: fused: input is on cpu, not CUDA" in loop.summary(rows[0])
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_failing_implementation_is_a_cell_not_a_lost_row(monkeypatch):
    (group,) = loop.plan(["classifier"], ["fp32-tf32"], [16], ["sgd"], dry=True)
    real = loop.make_loop_step

    def broken(model, forward, *args, **kwargs):
        step = real(model, forward, *args, **kwargs)
        if forward is not model and not hasattr(model, "_epifuse_heads"):
            def fail(pair):
                raise RuntimeError("compile exploded")
            return fail
        return step

    monkeypatch.setattr(loop, "make_loop_step", broken)
    (row,) = loop.run_group(group, CPU, TINY)
    assert row["timings_ms"]["compile"] == {"error": "RuntimeError: compile exploded"}
    assert row["timings_ms"]["eager"]["median_ms"] > 0
    text = report.text_report({"env": {"device": "cpu"}, "loop": [row]})
    assert "classifier batch 16 fp32-tf32 SGD, compile: RuntimeError: compile exploded" in text


def test_host_time_per_head_forward_and_backward():
    row = loop.host_head(DTYPES["amp-bf16"], CPU, dry=True)
    t = row["timings_us"]
    assert set(t) == {"eager", "fused"} and row["failures"] == {}
    for impl in t:
        assert t[impl]["forward"]["median_us"] > 0
        assert t[impl]["backward_us"] == pytest.approx(
            t[impl]["forward_backward"]["median_us"] - t[impl]["forward"]["median_us"])
    assert row["path"]["reason"] == "input is on cpu, not CUDA"
    assert "loop host time per head amp-bf16: eager fwd" in loop.host_summary(row)


# --------------------------------------------------------------------------- report


def _t(ms, busy=None):
    return {"median_ms": ms, "iqr_ms": 0.0, "min_ms": ms, "max_ms": ms, "mean_ms": ms,
            "iters": 20, "gpu_kept_busy": busy}


def loop_row(model="projection", batch=256, setting="amp-bf16", optimizer="adamw",
             fused_ok=True, opt_impl="fused") -> dict:
    """A training-loop row as run_group writes it (a GPU run's)."""
    heads = 3 if model == "projection" else 2
    times = {"eager": 2.0, "fused": 1.0, "compile": 1.8, "compile_ro": 1.5,
             "compile_fused": 0.9, "compile_fused_ro": 0.75}
    ran = heads if fused_ok else 0
    return {"model": model, "batch": batch, "setting": setting, "optimizer": optimizer,
            "dims": [2048, 4096, 256 if model == "projection" else 1000],
            "bias": model != "projection", "compile_timed": True, "fused_heads": heads,
            "device": "cuda", "optimizer_impl": opt_impl,
            "timings_ms": {k: _t(v) for k, v in times.items()},
            "queued_ms": {k: _t(v * 0.8, True) for k, v in times.items()},
            "host_ms": {k: _t(v * 0.5, True) for k, v in times.items()},
            "path": {i: {"forward": ran, "backward": ran, "heads": heads,
                         "reason": None if fused_ok else "CUDA device sm_80 not supported"}
                     for i in loop.FUSED_IMPLS},
            "first_call_s": {}, "cudagraph_skips": {"compile_ro": 0, "compile_fused_ro": 0}}


def loop_host_row(setting="amp-bf16") -> dict:
    t = lambda us: {"median_us": us, "min_us": us, "mean_us": us, "calls": 120,  # noqa: E731
                    "gpu_kept_busy": True}
    return {"setting": setting, "model": "projection", "batch": 256, "dims": [2048, 4096],
            "failures": {}, "path": {"forward": 1, "backward": 1, "heads": 1, "reason": None},
            "timings_us": {"eager": {"forward": t(60.0), "forward_backward": t(160.0),
                                     "backward_us": 100.0},
                           "fused": {"forward": t(30.0), "forward_backward": t(80.0),
                                     "backward_us": 50.0}}}


GPU_ENV = {"device": "cuda:0", "gpu": "H100", "torch": "x", "cuda": "13.0"}


def test_row_format_in_the_markdown_table():
    doc = {"env": GPU_ENV, "loop": [loop_row()], "loop_host": [loop_host_row()]}
    md = report.markdown_report(doc)
    assert f"## {report.LOOP_TITLE}" in md and f"### {report.LOOP_HOST_TITLE}" in md
    assert ("| projection | 256 | amp-bf16 | AdamW fused | yes (3 heads) | 2.000 | 1.000 | 1.500 "
            "| 0.7500 | 2.00x | 2.00x | 1.800 / 0.9000 | 1.600 / 0.8000 / 1.200 / 0.6000 "
            "| 1.000 / 0.5000 / 0.7500 / 0.3750 |") in md
    assert ("| amp-bf16 | 256x2048->4096 | 60.0 | 30.0 | 0.50 | 100.0 | 50.0 | 0.50 | yes | yes |"
            in md)
    assert "reduce-overhead" in md and "cudagraph_mark_step_begin" in md
    assert "Linear(2048, 4096, bias=False)" in md and "CUDA-event" in md


def test_a_row_whose_fused_model_fell_back_is_marked():
    doc = {"env": GPU_ENV, "loop": [loop_row(fused_ok=False), loop_row(optimizer="sgd")]}
    text = report.text_report(doc)
    (bad,) = [ln for ln in text.splitlines() if "AdamW fused" in ln and "projection" in ln]
    assert " no [1] " in bad
    assert ("[1] fused, compile_fused, compile_fused_ro: the fused heads ran their modules, not "
            "epifuse::fused_head (CUDA device sm_80 not supported)") in text
    partly = loop_row()
    partly["path"]["compile_fused_ro"].update(forward=0, reason="x")
    assert report._loop_path_cell(partly, report.Notes()).startswith("partly [")


def test_default_optimizers_and_idle_queues_get_notes():
    row = loop_row(opt_impl="default (RuntimeError: no fused kernel)")
    row["queued_ms"]["eager"]["gpu_kept_busy"] = False
    row["host_ms"]["fused"]["gpu_kept_busy"] = False
    row["cudagraph_skips"]["compile_fused_ro"] = 2
    text = report.text_report({"env": GPU_ENV, "loop": [row]})
    assert "AdamW default [1]" in text
    assert "AdamW(fused=True) not supported here: default (RuntimeError: no fused kernel)" in text
    assert "the GPU went idle while the host queued the steps" in text
    assert "host: a step synchronized (GradScaler's check for infs)" in text
    assert "compile_fused_ro: inductor ran 2 graph(s) without CUDA graphs" in text


def test_standalone_page_and_missing_compile():
    row = loop_row()
    row["compile_timed"] = False
    for impl in ("compile", "compile_ro", "compile_fused", "compile_fused_ro"):
        del row["timings_ms"][impl], row["queued_ms"][impl], row["host_ms"][impl]
    md = report.loop_markdown({"env": GPU_ENV, "loop": [row], "loop_host": []})
    assert "| 2.000 | 1.000 | - | - | 2.00x | n/a | - / - |" in md
    assert "| 1.000 / 0.5000 / - / - |" in md
    assert md.startswith("- GPU: H100")


# --------------------------------------------------------------------------- command lines


@pytest.mark.parametrize("argv", [["--settings", "fp32-3xtf32"], ["--dtype", "bf16"],
                                  ["--batches", "1"], ["--optimizers", "lamb"],
                                  ["--models", "resnet"]])
def test_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        loop.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_arguments():
    args = loop.parse_args([])
    assert args.settings == list(loop.SETTINGS) and args.batches is None
    assert loop.parse_args(["--settings", "amp-half", "float32-high"]).settings == [
        "amp-fp16", "fp32-tf32"]
    assert loop.parse_args(["--dtype", "amp"]).settings == ["amp-bf16", "amp-fp16"]


def test_standalone_dry_run_writes_its_tables(tmp_path, capsys):
    md = tmp_path / "loop.md"
    assert loop.main(["--dry", "--out", str(tmp_path), "--models", "classifier", "--settings",
                      "fp32-tf32", "--batches", "8", "--optimizers", "sgd", "--no-compile",
                      "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"training loop: 1 rows, ~\d+ s \(estimate\)", out)
    doc = json.loads((tmp_path / "loop.json").read_text())
    (row,) = doc["loop"]
    assert set(row["timings_ms"]) == {"eager", "fused"} and len(doc["loop_host"]) == 1
    text = md.read_text()
    assert "| classifier | 8 | fp32-tf32 | SGD fused | no [1] |" in text
    assert "input is on cpu, not CUDA" in text


def _bench(tmp_path, *extra):
    return ["--device", "cpu", "--no-compile", "--no-softmax", "--no-real-heads", "--problem",
            "39", "--mode", "eval", "--iters", "2", "--warmup", "0", "--out",
            str(tmp_path), *extra]


def test_the_page_runs_the_loop_in_quick_dry_runs_only_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "MODELS", ("classifier",))
    monkeypatch.setattr(loop, "DRY_BATCHES", (8,))
    monkeypatch.setattr(loop, "OPTIMIZERS", ("sgd",))
    assert bench_main.main(_bench(tmp_path, "--dtype", "amp-bf16", "--no-host-time")) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["loop"] == [] and doc["settings"]["loop"] is False
    capsys.readouterr()
    assert bench_main.main(_bench(tmp_path, "--dtype", "amp-bf16", "fp32-3xtf32", "--quick")) == 0
    err = capsys.readouterr().err
    assert re.search(r"== training loop: 2 configurations, estimate ~\d+ s", err)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [loop.row_key(r) for r in doc["loop"]] == [("classifier", 8, "amp-bf16", "sgd")]
    assert [r["setting"] for r in doc["loop_host"]] == ["amp-bf16"]
    assert "loop" in doc["env"]["sections_s"]
    md = (tmp_path / "bench.md").read_text()
    assert f"## {report.LOOP_TITLE}" in md and "| classifier | 8 | amp-bf16 | SGD fused |" in md
    capsys.readouterr()
    assert bench_main.main(_bench(tmp_path, "--dtype", "amp-bf16", "--quick", "--resume")) == 0
    err = capsys.readouterr().err
    assert "loop classifier batch 8 amp-bf16 SGD" in err and "(reused)" in err
    assert bench_main.main(_bench(tmp_path, "--dtype", "amp-bf16", "--quick", "--no-loop")) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["loop"] == []
