"""examples/train_gpt.py picks one GPU per local rank only where that many exist (issue 16)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from train_gpt import pick_device  # noqa: E402


def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_no_gpu_trains_on_cpu_ranks(monkeypatch):
    _gpus(monkeypatch, 0)
    assert pick_device("auto", 0) == torch.device("cpu")
    assert pick_device("auto", 3) == torch.device("cpu")


def test_one_gpu_per_local_rank(monkeypatch):
    _gpus(monkeypatch, 2)
    assert pick_device("auto", 0) == torch.device("cuda", 0)
    assert pick_device("cuda", 1) == torch.device("cuda", 1)
    assert pick_device("cpu", 1) == torch.device("cpu")


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    # torchrun --nproc_per_node=2 on a one-GPU machine used to pick cuda:1 and crash
    _gpus(monkeypatch, 1)
    with pytest.raises(SystemExit, match=r"local rank 1 needs cuda:1, but this machine has 1 GPU.*--device cpu"):
        pick_device("auto", 1)
    _gpus(monkeypatch, 0)
    with pytest.raises(SystemExit, match=r"has 0 GPU"):
        pick_device("cuda", 0)
