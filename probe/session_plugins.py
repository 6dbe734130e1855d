"""The session's plug-ins: the registered modes a session runs, made from its options, driven
together through each step and closed together.

The session (``probe/session.py``) owns the lifecycle and calls these at its points: start, each
step's begin and end, pause and resume, close. What one plug-in raises while a step ends does not
keep the others from ending theirs (:meth:`SessionPlugins.end_step`), and closing closes every
one before the first failure is raised (:meth:`SessionPlugins.close`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.lifecycle import build_modes, start_modes
from probe.modes.base import OpObserver, SessionPlugin, StepResult
from probe.modes.registry import MODES
from probe.vocabulary.session_options import Options


class SessionPlugins:
    """The modes a session runs (:attr:`modes`) and the op observers among them (:attr:`observers`)."""

    def __init__(self, options: Options) -> None:
        modes = build_modes(options.mode_configs)
        # Plug-ins the session adds itself (with model=, the checksums: what each step started from).
        for cls in list(MODES.values()):
            added = cls.added_by_session(options, modes)
            if added is not None:
                modes.append(added)
        replacing = [m.name for m in modes if (o := m.observer()) is not None and o.replaces_execution]
        if len(replacing) > 1:
            raise ProbeError(f"modes {replacing} each replace op execution; combine at most one of them")
        self.modes: list[SessionPlugin] = modes
        self.observers: list[OpObserver] = [o for m in modes if (o := m.observer()) is not None]

    def check_collectives_on_every_rank(self, world: int, options: Options) -> None:
        """A mode that reduces across ranks each step would hang the job if only some ranks ran it."""
        ranks = options.ranks
        if world <= 1 or all(rank in ranks for rank in range(world)):
            return
        for mode in self.modes:
            if mode.collective_each_step:
                raise ProbeError(
                    f"mode {mode.name!r} reduces across ranks every step, but option 'ranks' selects "
                    f"{ranks.to_json()} of {world}: the other ranks would never join it; select every rank "
                    "or turn the reduction off"
                )

    def start(self, model: Any, out: Path, rank: int) -> None:
        start_modes(self.modes, model, out, rank)

    def begin_step(self, step: int) -> None:
        for mode in self.modes:
            mode.begin_step(step)

    def after_step(self) -> None:
        for mode in self.modes:
            mode.after_step()

    def pause(self) -> None:
        for mode in self.modes:
            mode.pause()

    def resume(self) -> None:
        for mode in self.modes:
            mode.resume()

    def has_pending(self) -> bool:
        return any(mode.has_pending() for mode in self.modes)

    def end_step(self, step: int, alone: bool, escalated: list[SessionPlugin],
                 ) -> tuple[list[tuple[SessionPlugin, StepResult | None]], BaseException | None]:
        """Each plug-in's result of ``step`` (the escalation's trace modes of the step after the
        session's own), and the first exception one raised (Ctrl-C, a failing ``end_step``): the
        others end theirs all the same. ``alone``: the step is a tail or broken off, so no step
        follows it (``SessionPlugin.ending_alone``)."""
        ended: list[tuple[SessionPlugin, StepResult | None]] = []
        interrupted: BaseException | None = None
        for mode in [*self.modes, *escalated]:
            try:
                if alone or interrupted is not None:
                    mode.ending_alone()
                ended.append((mode, mode.end_step(step)))
            except BaseException as e:
                interrupted = interrupted or e
                # What the broken-off end_step left (half handed over) must not open the
                # next step: a second end_step hands it over, and it is dropped.
                with contextlib.suppress(BaseException):
                    mode.ending_alone()
                    mode.end_step(step)
        return ended, interrupted

    def close(self) -> BaseException | None:
        """Close every plug-in, whichever of them fails; return the first failure."""
        failure: BaseException | None = None
        for mode in self.modes:
            try:
                mode.close()
            except BaseException as e:
                failure = failure or e
        return failure
