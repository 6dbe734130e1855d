"""The docs by question (docs/questions/) run as written.

Each page's Python block is run as a script in an empty directory, its ``probe ...`` shell
lines after it, and every ``<!-- output: REGEX -->`` marker on the page must match the
script's output: a page whose example stops giving the answer it describes fails here. The
links of every page under docs/ and of the README must lead to a file that exists.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = sorted((ROOT / "docs" / "questions").glob("*.md"))
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]

# A question page is read in one sitting: the issue asked for under 800 words each.
WORD_LIMIT = 800


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("page", [p for p in QUESTIONS if p.name != "README.md"], ids=lambda p: p.stem)
def test_the_page_runs_and_gives_the_answer_it_describes(page: Path, tmp_path: Path) -> None:
    text = page.read_text()
    assert len(text.split()) < WORD_LIMIT, f"{page.name}: {len(text.split())} words"
    code = _blocks(text, "python")
    assert len(code) == 1, f"{page.name}: one runnable example, found {len(code)}"
    script = tmp_path / "example.py"
    script.write_text(code[0])
    result = _run([sys.executable, str(script)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in re.findall(r"<!-- output: (.*?) -->", text):
        assert re.search(expected, result.stdout), \
            f"{page.name}: no line matches {expected!r} in\n{result.stdout}"
    for block in _blocks(text, "sh"):
        for line in block.splitlines():
            command = line.split("#")[0].strip()
            if not command.startswith("probe "):
                continue
            shell = _run([sys.executable, "-m", "probe.cli", *shlex.split(command)[1:]], tmp_path)
            assert shell.returncode == 0, f"{command}: {shell.stderr[-2000:]}"


def test_every_question_page_is_listed_in_the_index() -> None:
    index = (ROOT / "docs" / "questions" / "README.md").read_text()
    for page in QUESTIONS:
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"{page.name} is not in docs/questions/README.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_that_exist(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
