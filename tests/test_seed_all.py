"""probe.seed_all: two trainings seeded alike are bit-identical (dropout included); the seed and the
deterministic settings are recorded in run.json."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from hf_models import tiny_llama

import probe
from probe import ProbeError, seeding

pytest.importorskip("transformers", reason="transformers is an optional test dependency")


@pytest.fixture(autouse=True)
def _restore_global_state(monkeypatch):
    """seed_all changes process-wide switches: give the other tests theirs back."""
    for name in ("PYTHONHASHSEED", *seeding.DETERMINISTIC_ENVIRONMENT):
        monkeypatch.setenv(name, "")  # records the value to restore (or that there was none) ...
        monkeypatch.delenv(name)  # ... and starts the test without it
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    monkeypatch.setattr(seeding, "_last", None)
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.set_flags(_deterministic=cudnn[0], _benchmark=cudnn[1])


def _losses(seed: int, steps: int = 3) -> list[torch.Tensor]:
    probe.seed_all(seed)
    model = tiny_llama(seed=None, attention_dropout=0.3)  # initialised from the seeded generator
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 12))  # the data too
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def test_two_trainings_seeded_alike_are_bit_identical():
    first, second, other = _losses(0), _losses(0), _losses(1)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], other[0])


def test_it_seeds_python_numpy_and_torch_and_turns_determinism_on():
    done = probe.seed_all(7)
    drawn = (random.random(), np.random.rand(), torch.rand(1))
    probe.seed_all(7)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1))
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["HCCL_DETERMINISTIC"] == "true"
    assert os.environ["PYTHONHASHSEED"] == "7"
    assert done == seeding.seeded() == {"seed": 7, "deterministic": True, "warn_only": False, "environment": {
        "PYTHONHASHSEED": "7", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "HCCL_DETERMINISTIC": "true"}}


def test_deterministic_false_seeds_only(monkeypatch):
    torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    probe.seed_all(3, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "HCCL_DETERMINISTIC" not in os.environ
    probe.seed_all(3)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # another deterministic setting is kept


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.5, "0", None])
def test_a_bad_seed_is_a_probe_error_naming_it(seed):
    with pytest.raises(ProbeError, match="seed_all: seed must be an int"):
        probe.seed_all(seed)


def test_the_seed_is_recorded_in_run_json(tmp_path):
    probe.seed_all(5, warn_only=True)
    with probe.mode("structure", out=tmp_path / "r") as session:
        torch.ones(2).sum()
        session.step()
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["seed"]["seed"] == 5 and info["seed"]["warn_only"] is True
    env = json.loads((tmp_path / "r" / "rank0" / "rank.json").read_text())["environment"]
    assert env["settings"]["deterministic_algorithms"] is True
    assert env["variables"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_seed_all_works_after_torch_froze_the_backend_flags():
    """torch.testing's common utilities call torch.backends.disable_global_flags() on import;
    a user's process may have done so too."""
    frozen = torch.backends.flags_frozen()
    torch.backends.disable_global_flags()
    try:
        probe.seed_all(0, deterministic=True)
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.backends.__allow_nonbracketed_mutation_flag = not frozen

