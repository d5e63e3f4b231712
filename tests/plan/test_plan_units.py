"""Sizes in the planner: one parser for the command line and Python. A number in Python is
bytes (bytes per second for bandwidth); a string needs a unit, on the command line too. And
stage 3's gathered working set is "n/a", not 0, where the planner cannot size it."""

import json

import pytest
import torch

from zerokern.plan import from_model, plan
from zerokern.plan.cli import main
from zerokern.plan.units import parse_size


def _cli(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("text, per_second, value", [
    ("80GB", False, 80e9), ("24GiB", False, 24 * 2**30), ("1.5 TB", False, 1.5e12), ("8e10B", False, 8e10),
    (".5GB", False, 0.5e9), ("100GB/s", True, 100e9), ("400Gb/s", True, 50e9), ("400Gbps", True, 50e9),
    ("400Gbit/s", True, 50e9)])
def test_parse_size(text, per_second, value):
    assert parse_size(text, per_second=per_second) == value


@pytest.mark.parametrize("text, per_second, message", [
    ("24", False, "'24' has no unit: write 24GB or 24GiB"),
    ("8e10", False, "'8e10' has no unit: write 8e10GB or 8e10GiB"),
    ("100", True, "'100' has no unit: write 100GB/s (bytes) or 100Gb/s (bits)"),
    ("1.2.3GB", False, "cannot read '1.2.3GB' as a size"),
    ("24XB", False, "cannot read '24XB' as a size"),
    ("0GB", False, "'0GB' must be positive and finite"),
    ("1e400GB", False, "'1e400GB' must be positive and finite")])
def test_parse_size_refuses(text, per_second, message):
    with pytest.raises(ValueError) as e:
        parse_size(text, per_second=per_second)
    assert str(e.value).startswith(message), str(e.value)


def test_cli_refuses_a_bare_number(capsys):
    for argv, message in ((["--gpu-memory", "24"], "argument --gpu-memory: '24' has no unit: write 24GB or 24GiB"),
                          (["--dp-bandwidth", "100"],
                           "argument --dp-bandwidth: '100' has no unit: write 100GB/s (bytes) or 100Gb/s (bits)"),
                          (["--gpu-memory", "1.2.3GB"], "argument --gpu-memory: cannot read '1.2.3GB' as a size")):
        with pytest.raises(SystemExit) as e:
            main(["--params", "7.5e9", "--dp", "64", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_cli_units(capsys):
    d = _cli(capsys, "--params", "7.5e9", "--dp", "64", "--gpu-memory", "24GB", "--dp-bandwidth", "400Gb/s")
    assert d["gpu_memory_bytes"] == 24e9 and d["dp_bandwidth_bytes_per_s"] == 50e9
    # the ZeRO paper's 7.5B on 64 GPUs: stage 1 needs 31.6 GB, stage 2 16.8 GB
    assert d["smallest_fitting_stage"] == 2
    assert _cli(capsys, "--params", "7.5e9", "--gpu-memory", "24GiB")["gpu_memory_bytes"] == 24 * 2**30


def test_python_takes_the_cli_strings_and_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    p = from_model(model, dp=2, gpu_memory="24GB", dp_bandwidth="400Gb/s")
    assert p.gpu_memory_bytes == 24e9 and p.dp_bandwidth_bytes_per_s == 50e9
    assert p.stages[0].headroom_bytes == 24e9 - p.stages[0].total_bytes
    assert from_model(model, dp=2, gpu_memory=24e9, dp_bandwidth=50e9) == p  # a number is bytes
    assert plan(7.5e9, dp=64, gpu_memory="24GB").smallest_fitting_stage == 2
    assert plan(7.5e9, dp=64, gpu_memory=24 * 2**30) == plan(7.5e9, dp=64, gpu_memory="24GiB")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(gpu_memory="24"), ValueError, "gpu_memory: '24' has no unit: write 24GB or 24GiB"),
    (dict(dp_bandwidth="100"), ValueError, "dp_bandwidth: '100' has no unit: write 100GB/s (bytes) or 100Gb/s"),
    (dict(gpu_memory="lots"), ValueError, "gpu_memory: cannot read 'lots' as a size"),
    (dict(gpu_memory=-1), ValueError, "gpu_memory: -1 must be positive and finite"),
    (dict(gpu_memory=float("nan")), ValueError, "gpu_memory: nan must be positive and finite"),
    (dict(gpu_memory=True), TypeError, "gpu_memory must be a number of bytes or a string like '80GB', got bool"),
    (dict(dp_bandwidth=[1]), TypeError, "dp_bandwidth must be a number of bytes/s or a string like '100GB/s'")])
def test_python_refuses(kwargs, error, message):
    model = torch.nn.Linear(10, 10)
    with pytest.raises(error) as e:
        from_model(model, **kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_stage3_working_set_not_modelled_is_none_and_na(capsys):
    p = plan(7.5e9, dp=64)
    assert [s.gathered_bytes for s in p.stages] == [0, 0, 0, None]
    assert plan(7.5e9, dp=1).stages[3].gathered_bytes == 0  # one rank gathers nothing
    assert plan(7.5e9, dp=64, unit_params=10**8).stages[3].gathered_bytes > 0
    model = torch.nn.Sequential(*(torch.nn.Linear(100, 100) for _ in range(8)))
    assert from_model(model, dp=2).stages[3].gathered_bytes is None
    # root_params defaults to the largest param (a 100x100 weight); bf16: 2 bytes each
    assert from_model(model, dp=2, unit_params=10_100).stages[3].gathered_bytes == 2 * (10_000 + 2 * 10_100)

    assert main(["--params", "7.5e9", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    row3 = next(line.split() for line in out.splitlines() if line.startswith("3 "))
    assert row3[2] == "n/a", row3
    assert "gathered n/a: stage 3's working set is not modelled from a parameter count" in out
    assert "--unit-params" in out and "from_model" in out
    assert _cli(capsys, "--params", "7.5e9", "--dp", "64")["stages"][3]["gathered_bytes"] is None

    assert main(["--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "100", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "n/a" not in out
    assert next(line.split() for line in out.splitlines() if line.startswith("3 "))[2] == "0.00"  # 212,992 B
