"""rank.json records the environment (versions, devices, settings, allow-listed variables, packages)
and run.json the hyperparameters; no secret is ever written."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import probe
from probe import ProbeError
from probe.rundir.environment import environment_variables, recorded_variable


def _record(out, **options):
    model = torch.nn.Linear(3, 2)
    with probe.mode("structure", out=out, model=model, **options) as session:
        model(torch.ones(1, 3)).sum().backward()
        session.step()
    return probe.load(out)


def test_rank_json_records_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = _record(tmp_path / "r").process(0)["environment"]
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["python"]
    assert env["packages"]["numpy"] == np.__version__
    assert env["settings"]["num_threads"] == torch.get_num_threads()
    assert env["settings"]["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert env["devices"]["cpu"]
    assert {"NCCL_DEBUG": "INFO", "CUDA_LAUNCH_BLOCKING": "1", "OMP_NUM_THREADS": "2"}.items() \
        <= env["variables"].items()


def test_only_allow_listed_variables_and_never_a_secret(tmp_path, monkeypatch):
    secrets = {"HF_TOKEN": "hf_sekret1", "AWS_SECRET_ACCESS_KEY": "sekret2", "TORCH_HUB_TOKEN": "sekret3",
               "NCCL_IB_AUTH": "sekret4", "HCCL_PASSWORD": "sekret5", "MY_APP_CONFIG": "sekret6",
               "HOME_DIR_NOTE": "sekret7"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HCCL_DETERMINISTIC", "true")
    _record(tmp_path / "r")
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "r").rglob("*") if p.is_file())
    assert not any(value in written for value in secrets.values())
    assert '"HCCL_DETERMINISTIC": "true"' in written
    assert not any(recorded_variable(name) for name in secrets)
    environ = {"PATH": "/bin", "TORCH_LOGS": "+dynamo", "USER": "me"}
    assert environment_variables(environ) == {"TORCH_LOGS": "+dynamo"}
    assert len(environment_variables({"PYTORCH_X": "y" * 10_000})["PYTORCH_X"]) == 500


@dataclasses.dataclass
class _Args:
    lr: float = 1e-3
    layers: int = 2


class _Config:
    def to_dict(self) -> dict:
        return {"hidden": 64, "act": "silu"}


@pytest.mark.parametrize(("given", "recorded"), [
    ({"lr": 1e-3, "optim": {"name": "adamw", "betas": (0.9, 0.95)}},
     {"lr": 1e-3, "optim": {"name": "adamw", "betas": [0.9, 0.95]}}),
    (argparse.Namespace(lr=0.1, seed=3), {"lr": 0.1, "seed": 3}),
    (_Args(), {"lr": 1e-3, "layers": 2}),
    (_Config(), {"hidden": 64, "act": "silu"}),
    ({"eps": math.inf, "bad": math.nan, "dtype": torch.bfloat16}, {"eps": "inf", "bad": "nan",
                                                                 "dtype": "torch.bfloat16"}),
])
def test_hparams_are_recorded_as_json(tmp_path, given, recorded):
    run = _record(tmp_path / "r", hparams=given)
    assert run.info["hparams"] == recorded
    json.loads((tmp_path / "r" / "run.json").read_text())  # strict JSON (no NaN)


@pytest.mark.parametrize("value", ["lr=1", 5, [1, 2], object()])
def test_bad_hparams_are_a_probe_error_naming_the_option(tmp_path, value):
    with pytest.raises(ProbeError, match="option 'hparams'"):
        probe.mode("stats", out=tmp_path / "r", hparams=value)


def test_huge_or_recursive_hparams_are_cut_not_walked(tmp_path):
    loop: list = []
    loop.append(loop)
    run = _record(tmp_path / "r", hparams={"loop": loop, "many": list(range(100_000)), "text": "x" * 5000})
    assert len(run.info["hparams"]["many"]) <= 10_000 and len(run.info["hparams"]["text"]) < 1100


def test_a_run_without_environment_still_loads(tmp_path):
    run = _record(tmp_path / "r")
    rank_json = tmp_path / "r" / "rank0" / "rank.json"
    old = json.loads(rank_json.read_text())
    del old["environment"]
    rank_json.write_text(json.dumps(old))
    assert "environment" not in probe.load(tmp_path / "r").process(0)
    assert run.ops(0)


def test_compare_notes_a_run_without_environment(tmp_path):
    _record(tmp_path / "a")
    _record(tmp_path / "b")
    rank_json = tmp_path / "b" / "rank0" / "rank.json"
    old = json.loads(rank_json.read_text())
    del old["environment"]
    rank_json.write_text(json.dumps(old))
    identity = probe.compare(tmp_path / "a", tmp_path / "b").identity
    assert identity.differences == []
    assert identity.notes == ["rank 0: run B recorded no environment (written by an older probe): its "
                              "versions and settings are not compared"]
