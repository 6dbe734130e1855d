"""The probe command explains itself: every --help without torch, every option with its default,
every command with an example; a run that lacks what a command reads is one line saying what to
record (issue 36)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import probe
from probe.cli import BUILTIN_MODES, build_parser, main
from probe.modes.registry import MODES


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every (command words, parser) of the command line, the top level included."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*prefix, name))


COMMANDS = [words for words, _ in _commands(build_parser())]


def _stats_run(path):
    model = nn.Linear(4, 3)
    with probe.mode("stats", out=path, model=model) as session:
        model(torch.randn(2, 4)).sum().backward()
        session.step()
    return path


def test_every_help_imports_no_torch(tmp_path):
    # One process answers every --help, then says whether torch was imported by any of them:
    # a structural check (sys.modules), not a timing. Then, as a spawned compare worker does,
    # it reads a run through the run reader alone: the lazily bound package still finds the
    # built-in modes' readers.
    run = _stats_run(tmp_path / "run")
    script = (
        "import json, sys\n"
        "from probe.cli import main\n"
        f"for words in {COMMANDS!r}:\n"
        "    try:\n"
        "        main([*words, '--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (words, e.code)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))\n"
        "from probe.rundir.run import Run\n"
        f"print(len(Run({str(run)!r}).output_stats(0)[0]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    imported_by_help, stats_rows = result.stdout.splitlines()[-2:]
    assert json.loads(imported_by_help) == []
    assert int(stats_rows) > 0
    assert len(COMMANDS) >= 11  # probe and every subcommand, export msprobe included


def test_every_option_says_its_default_and_every_command_an_example():
    for words, parser in _commands(build_parser()):
        assert "example:\n  probe " in (parser.epilog or ""), words
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) \
                    or not action.option_strings:
                continue
            text = action.help or ""
            assert "default" in text or action.required, (words, action.option_strings, text)
            if action.choices:  # the choices are named in the help argparse prints
                shown = parser.format_help()
                assert all(str(choice) in shown for choice in action.choices), (words, action.dest)


def test_demo_help_lists_every_registered_mode(capsys):
    # The package's own modes: other test files register plug-ins of their own when collected.
    own = {name for name, cls in MODES.items() if cls.__module__.startswith("probe.")}
    assert set(BUILTIN_MODES) == own
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert all(f"  {name} " in text for name in own)


def test_replay_of_a_run_without_dumps_says_what_to_record(tmp_path, capsys):
    _stats_run(tmp_path / "run")
    assert main(["replay", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    assert "replay needs dumps" in captured.err and "probe.mode('dump'" in captured.err
    assert captured.out == ""  # no empty table before it
