"""``probe summary RUN --plot FILE``: a step's largest output magnitude per module, as PNG or SVG."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from hf_models import tiny_llama

import probe
from probe.analysis.summary import module_magnitudes
from probe.cli import main
from tests.conftest import train_steps
from tests.test_graph_export import Net

pytest.importorskip("transformers", reason="transformers is an optional test dependency")
pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) draws the charts")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A stats run of one training step, and what lm_head saw (its weight, input and output)."""
    out = tmp_path_factory.mktemp("plot") / "run"
    model = tiny_llama()
    seen = {"weight": model.lm_head.weight.detach().clone()}
    model.lm_head.register_forward_hook(
        lambda m, i, o: seen.update(input=i[0].detach().clone(), output=o.detach().clone()))
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=out, model=model) as session:
        model(input_ids=ids, labels=ids).loss.backward()
        session.step()
    return out, seen


def test_module_magnitudes_are_the_largest_outputs_of_each_module(llama_run):
    out, seen = llama_run
    run = probe.load(out)
    magnitudes = module_magnitudes(run, 0, 0)
    modules = [m.module for m in magnitudes]
    assert modules == list(dict.fromkeys(op.module for op in run.ops(0)))  # order of first op
    head = next(m for m in magnitudes if m.module == "lm_head")
    # lm_head's forward ops: the weight's transpose, a view of its input, the matmul, a view of it.
    expected = max(seen[key].abs().max().item() for key in ("weight", "input", "output"))
    assert head.largest["forward"] == pytest.approx(expected, rel=1e-6)
    assert set(head.largest) == {"forward", "backward"} and not head.nonfinite


def test_summary_plot_writes_png_and_svg(llama_run, tmp_path, capsys):
    out, _ = llama_run
    png, svg = tmp_path / "modules.png", tmp_path / "modules.svg"
    assert main(["summary", str(out), "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out.replace("\n", "")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    from PIL import Image

    with Image.open(png) as image:
        width, height = image.size
    assert width > 500 and height > 500  # a row per module: 30-odd modules make it tall
    assert main(["summary", str(out), "--plot", str(svg), "--step", "0", "--rank", "0"]) == 0
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = "".join(root.itertext())  # labels stay text
    assert "model.layers.1.mlp.down_proj" in text and "lm_head" in text and "backward" in text


def test_nonfinite_modules_are_marked(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with probe.mode("stats", out=tmp_path / "run", model=model) as session:
        train_steps(model, 1, session=session)
    magnitudes = module_magnitudes(probe.load(tmp_path / "run"), 0, 0)
    bad = {m.module: m.nonfinite for m in magnitudes if m.nonfinite}
    assert bad.get("head", {}).get("forward", 0) >= 1  # log of a negative value
    assert main(["summary", str(tmp_path / "run"), "--plot", str(tmp_path / "m.svg")]) == 0
    assert "NaN/Inf (forward)" in "".join(ET.parse(tmp_path / "m.svg").getroot().itertext())


@pytest.mark.parametrize("argv, message", [
    (["--plot", "{tmp}/m.jpg"], "unknown extension '.jpg'; give a file ending in .png or .svg"),
    (["--plot", "{tmp}/m"], "unknown extension '(none)'"),
    (["--step", "0"], "--step and --rank choose the step to plot"),
    (["--plot", "{tmp}/m.png", "--step", "7"], "step 7 of rank 0 is not in"),
    (["--plot", "{tmp}/missing/m.png"], "is not a directory"),
])
def test_bad_plot_options_exit_2_with_one_line(llama_run, tmp_path, capsys, argv, message):
    out, _ = llama_run
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["summary", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.glob("m*"))


def test_without_matplotlib_plot_says_how_to_get_it(llama_run, tmp_path, monkeypatch, capsys):
    out, _ = llama_run
    for name in [n for n in sys.modules if n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["summary", str(out), "--plot", str(tmp_path / "m.png")]) == 2
    assert "pip install 'probe[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "m.png").exists()


def test_a_step_without_statistics_is_refused(tmp_path, capsys):
    with probe.mode("dump", out=tmp_path / "run"):
        torch.ones(3) * 2
    run = probe.load(tmp_path / "run")
    if any(t.stats is not None for op in run.ops(0) for t in op.outputs):
        pytest.skip("dump mode records statistics too")
    assert main(["summary", str(tmp_path / "run"), "--plot", str(tmp_path / "m.png")]) == 2
    assert "holds no output statistics: record it with mode 'stats'" in capsys.readouterr().err
