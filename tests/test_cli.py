"""One vocabulary for every command line (epifuse.cli), CPU only.

The same words select the same problems, dtypes and precisions in `python -m epifuse`,
`python -m benchmarks` (and its real heads), scripts/profile_driver.py and the benchmark's
dtype columns; every precision name of epifuse.precision.ALIASES (ours and torch's) is accepted
by all.
"""

from __future__ import annotations

import pytest
import torch

from epifuse import __main__ as main_cli
from epifuse import cli
from benchmarks import __main__ as bench_cli
from benchmarks.cases import DTYPES
from epifuse.precision import ALIASES


def _main(*argv):
    return main_cli.parse_args(list(argv)).selection


def _bench(*argv):
    args = bench_cli.parse_args(list(argv))
    return args.problems, args.dtypes


@pytest.mark.parametrize("spellings", [
    [("--dtype", "bf16"), ("--dtypes", "bfloat16"), ("--dtype", "bf16,bfloat16")],
    [("--dtype", "fp16"), ("--dtype", "float16"), ("--dtypes", "half")],
    [("--dtype", "fp32", "--precision", "tf32"), ("--dtype", "float32", "--precision", "high"),
     ("--dtype", "fp32-tf32"), ("--dtypes", "float-medium")],
    [("--dtype", "fp32", "--precision", "ieee"), ("--dtype", "float32-ieee")],
    [("--dtype", "fp32", "--precision", "3xtf32"), ("--dtype", "fp32", "--precisions", "highest"),
     ("--dtype", "float32-highest")],
    [("--dtype", "amp"), ("--dtypes", "amp-bf16", "amp-fp16"), ("--dtype", "amp-bfloat16,amp-half"),
     ("--dtype", "amp", "amp-bf16")],
    [("--dtype", "amp-bf16"), ("--dtype", "amp-bfloat16")],
    [("--dtype", "all"), ("--dtypes", "fp32", "bf16", "fp16", "amp"),
     ("--dtypes", "fp32,bf16,fp16,amp-bf16,amp-fp16")],
    [("--problem", "84"), ("--problems", "84"), ("--problem", "gemm_bn_scale_softmax")],
    [(), ("--problem", "all"), ("--problems", "84,39"), ("--problem", "84", "39")],
], ids=["bf16", "fp16", "tf32", "ieee", "3xtf32", "amp", "amp-bf16", "all-dtypes", "problem-84",
        "all-problems"])
def test_spellings_select_the_same_runs_in_both_clis(spellings):
    mains = [_main(*s) for s in spellings]
    benches = [_bench(*s) for s in spellings]
    assert all(m == mains[0] for m in mains), mains
    assert all(b == benches[0] for b in benches), benches
    # ... and the two command lines agree with each other (their defaults differ: see below).
    main, (problems, dtypes) = mains[0], benches[0]
    assert list(main.problems) == problems
    if any(word.startswith("--dtype") for word in spellings[0]):
        assert {c.torch_dtype for c in main.columns} == {DTYPES[d].dtype for d in dtypes}
        assert ({c.autocast_dtype for c in main.columns}
                == {DTYPES[d].autocast for d in dtypes})
        if all(c.precision for c in main.columns if c.dtype == "fp32"):
            assert {c.name for c in main.columns} == set(dtypes)  # bench columns are Column names


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_precision_alias_is_accepted_by_both(alias):
    (column,) = _main("--dtype", "fp32", "--precision", alias).columns
    assert column == cli.Column("fp32", ALIASES[alias])
    assert _bench("--dtype", "fp32", "--precision", alias)[1] == [f"fp32-{ALIASES[alias]}"]
    assert _bench("--dtype", f"float32-{alias}")[1] == [f"fp32-{ALIASES[alias]}"]


def test_defaults():
    # The main job follows torch's fp32 setting, as ModelNew(precision=None) does ...
    assert _main() == cli.Selection((84, 39), (cli.Column("fp32", None),))
    # ... the benchmark measures BENCHMARKS.md's columns: PyTorch's default precision, TF32,
    # and bf16 / fp16 autocast; --dtype fp32 alone the first two.
    assert _bench() == ([84, 39], ["fp32-3xtf32", "fp32-tf32", "amp-bf16", "amp-fp16"])
    assert _bench("--dtype", "fp32")[1] == ["fp32-3xtf32", "fp32-tf32"]


def test_bench_columns_are_the_bench_configs():
    _, dtypes = _bench("--dtype", "all", "--precision", "ieee", "3xtf32", "tf32")
    assert set(dtypes) == set(DTYPES) == {c.name for c in cli.all_columns()}
    for column in cli.selection(main_cli.parse_args(["--dtype", "all", "--precision", "ieee",
                                                     "3xtf32", "tf32"]),
                                default_dtypes=["fp32"], default_fp32_precisions=[None]).columns:
        assert DTYPES[column.name].dtype == column.torch_dtype
        assert DTYPES[column.name].autocast == column.autocast_dtype


def test_all_includes_the_autocast_columns():
    """``all`` is every column: fp32, bf16, fp16, and fp32 under autocast to bf16 and fp16."""
    assert [c.name for c in _main("--dtype", "all").columns] == [
        "fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"]
    amp = _main("--dtype", "amp").columns
    assert [(c.torch_dtype, c.autocast_dtype, c.precision) for c in amp] == [
        (torch.float32, torch.bfloat16, None), (torch.float32, torch.float16, None)]
    assert _bench("--dtype", "amp")[1] == ["amp-bf16", "amp-fp16"]
    # --precision is for plain fp32: the autocast columns keep torch's matmul precision.
    assert _bench("--dtype", "amp-fp16", "fp32", "--precision", "tf32")[1] == [
        "amp-fp16", "fp32-tf32"]


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "double"], "unknown dtype 'double'"),
    (["--dtype", "bf16-tf32"], "a precision applies to fp32 only"),
    (["--dtype", "amp-fp32"], "autocast runs in bf16 or fp16"),
    (["--dtype", "amp-tf32"], "autocast runs in bf16 or fp16"),
    (["--precision", "fp32"], "unknown precision 'fp32'"),
    (["--problems", "84,12"], "unknown problem '12'"),
    (["--problem", ","], "empty value"),
])
@pytest.mark.parametrize("parse", [main_cli.parse_args, bench_cli.parse_args],
                         ids=["epifuse", "benchmarks"])
def test_bad_words_are_usage_errors(parse, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_falls_back_to_cpu_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli.resolve_device(bench_cli.AUTO) == torch.device("cpu")
    assert "CPU dry run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench_cli.resolve_device("cuda")  # asked for by name: an error, not a silent CPU run


def test_main_version(capsys):
    import epifuse

    with pytest.raises(SystemExit):
        main_cli.parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"epifuse {epifuse.__version__}"


def test_columns_by_name_and_torch_policy():
    assert cli.column("float32-high") == cli.Column("fp32", "tf32")
    assert cli.column("amp-half") == cli.Column("amp-fp16")
    assert cli.column("bfloat16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="names 2 columns"):
        cli.column("amp")
    assert [c.torch_matmul_precision for c in cli.all_columns()] == [
        "highest", "highest", "high", "highest", "highest", "highest", "highest"]
    assert cli.torch_matmul_precision("medium") == "high"
    assert cli.torch_matmul_precision(None) == "highest"


def test_init_inputs_resize_a_problem():
    from epifuse.problems import gemm_bn_scale_softmax as p84, gemm_scale_bn as p39

    assert cli.init_inputs(p84, None) == (p84.batch_size, list(p84.get_init_inputs()))
    assert cli.init_inputs(p39, (8, 16, 32)) == (8, [16, 32, (32,)])  # the scale follows N
    batch, args = cli.init_inputs(p84, (8, 16, 32))
    assert batch == 8 and args[:2] == [16, 32] and args[-1] == (1,)


def _profile_driver():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_driver.py"
    spec = importlib.util.spec_from_file_location("profile_driver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,expected", [
    ([], (84, "train", "fp32-tf32")),
    (["39", "eval", "--dtype", "bfloat16"], (39, "eval", "bf16")),
    (["gemm_scale_bn", "--precision", "highest"], (39, "train", "fp32-3xtf32")),
    (["--mode", "eval", "--dtype", "float32-ieee"], (84, "eval", "fp32-ieee")),
    (["84", "--dtype", "amp-half"], (84, "train", "amp-fp16")),
])
def test_profile_driver_reads_the_same_words(argv, expected):
    driver = _profile_driver()
    number, mode, column = driver.resolve(driver.parse_args(argv))
    assert (number, mode, column.name) == expected


@pytest.mark.parametrize("argv,message", [
    (["12"], "unknown problem '12'"),
    (["--dtype", "double"], "unknown dtype 'double'"),
    (["--precision", "fp32"], "unknown precision 'fp32'"),
    (["84", "39"], "two problems"),
])
def test_profile_driver_refuses_unknown_words(argv, message):
    driver = _profile_driver()
    with pytest.raises(driver.DriverError, match=message):
        driver.resolve(driver.parse_args(argv))
