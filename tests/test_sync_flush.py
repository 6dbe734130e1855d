"""Without a writer thread (async_flush=False) the step's write runs on the training thread,
between two steps: none of its own torch work may land in the next step's records."""

from __future__ import annotations

import torch

import probe
from tests.hf_models import tiny_llama


def _train(out, modes, steps=3, **options):
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with probe.mode(modes, out=out, model=model, async_flush=False, **options) as session:
        for _ in range(steps):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return probe.load(out)


def test_every_step_reads_back_with_input_statistics(tmp_path):
    run = _train(tmp_path / "run", "stats", inputs=True)
    first = run.ops(step=0)
    for step in run.steps:
        ops = run.ops(step=step)
        assert [op.id for op in ops] == [op.id for op in first]
        embedding = ops[0]
        assert embedding.name == "aten.embedding.default"
        assert all(t.stats is not None for t in embedding.inputs if t.dtype == "float32")
        assert embedding.outputs[0].stats["norm"] > 0


def test_every_step_dump_reads_back(tmp_path):
    run = _train(tmp_path / "run", ["stats", "dump"], tensors="outputs")
    for step in run.steps:
        mm = next(op for op in run.ops(step=step) if op.name == "aten.mm.default")
        tensor = run.tensor(mm.id, "output", 0, step=step)
        assert tensor.shape == torch.Size(mm.outputs[0].shape)
        assert torch.linalg.vector_norm(tensor.double()).item() > 0
