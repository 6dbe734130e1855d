"""The issue-16 benchmark entries run: the HF workloads in the overhead harness, with DebugMode."""

from __future__ import annotations

import pytest

from benchmarks import overhead
from benchmarks.models import MODELS, WorkloadSpec


def test_hf_llama_small_spec_trains_and_describes_itself():
    spec = MODELS["hf-llama-small"]
    assert isinstance(spec, WorkloadSpec)
    trainer = spec.trainer()
    loss = trainer.step()
    assert loss.isfinite()
    assert spec.num_params() == sum(p.numel() for p in trainer.model.parameters())
    assert "hidden 256" in spec.describe() and "seq 128" in spec.with_seq(128).describe()


@pytest.mark.slow
def test_overhead_harness_times_stats_beside_debugmode(capsys):
    assert overhead.main(["--model", "hf-llama-small", "--steps", "1", "--warmup", "0", "--peers",
                          "--configs", "probe-stats,debugmode", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| probe-stats |" in out and "| debugmode |" in out
