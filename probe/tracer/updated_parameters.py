"""Which parameter each optimizer op works for.

An optimizer without ``foreach`` updates its parameters one at a time, a dozen ops each, all in
one frame (``optimizer.AdamW[0]``), where op ids count per op name. Two runs whose optimizers
update different sets of parameters (one run's backward leaves a gradient None where the
other's gives zeros: a compiled backward) then number the same op of two parameters alike, and
compare would pair one parameter's update with another's. So each optimizer op is labelled with
the parameter it works for, and compare pairs them within a parameter.

The label is found through memory: at the optimizer step's start, the data pointers of every
parameter, its gradient and its optimizer state name that parameter; an op reading one of them
works for it, and so does an op reading what an op labelled so made (a ``denom`` computed from
``exp_avg_sq`` belongs to the same parameter). An op reading several parameters' tensors (a ``foreach``
op's lists) or none is not labelled. State created inside the step (AdamW's first step makes
its moments and step counters then) is learnt when the optimizer's state grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from probe.rundir.op_record_fields import RECORD_PARAMETER, RECORD_PHASE, InputMeta, OpRecordTuple


def _pointer(t: torch.Tensor) -> int | None:
    """Where ``t``'s memory starts (None without memory); ops see plain tensors, so a DTensor
    parameter is known by its local shard, the tensor its ops run on."""
    local = getattr(t, "_local_tensor", t)
    try:
        return local.data_ptr() or None
    except (RuntimeError, NotImplementedError):  # no storage: nothing to recognise it by
        return None


class UpdatedParameters:
    """Labels the ops of one optimizer step with the parameter each updates."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        """Data pointer -> the name of the parameter whose value, gradient or state lives there."""
        self._optimizers: list[torch.optim.Optimizer] = []
        self._name_of: dict[int, str] = {}
        """``id(parameter)`` -> its name, from the modules (``ModuleNames.param_names``)."""
        self._learnt: dict[int, int] = {}
        """``id(parameter)`` -> how many state entries it had when learnt this step."""

    def start(self, optimizer: torch.optim.Optimizer, name_of: dict[int, str]) -> None:
        """An optimizer step (or a nested one) begins; ``name_of`` maps ``id(parameter)`` to its name."""
        if not self._optimizers:
            self.stop()
        self._optimizers.append(optimizer)
        self._name_of = name_of
        self._learn(optimizer)

    def stop(self) -> None:
        """The outermost optimizer step ended."""
        self._optimizers.clear()
        self._names.clear()
        self._learnt.clear()

    def _learn(self, optimizer: torch.optim.Optimizer) -> bool:
        """Learns the memory of the parameters whose state grew since they were learnt (all of
        them at the step's start); returns whether there were any."""
        grew = False
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                state = optimizer.state.get(param, {})
                if self._learnt.get(id(param)) == len(state):
                    continue
                grew = True
                self._learnt[id(param)] = len(state)
                # A parameter no module names (an optimizer over loose tensors) is named by its
                # place, which is the same in two runs of one program.
                name = self._name_of.get(id(param)) or f"param_groups[{g}][{i}]"
                for t in (param, param.grad, *state.values()):
                    if isinstance(t, torch.Tensor) and (pointer := _pointer(t)) is not None:
                        self._names[pointer] = name
        return grew

    def label(self, inputs: Sequence[InputMeta], tensors: Sequence[torch.Tensor],
              records: Sequence[OpRecordTuple]) -> str | None:
        """The parameter an op works for, or None (none, or several): ``inputs`` are its inputs'
        metadata (their sources), ``tensors`` the inputs themselves, ``records`` the step's."""
        # Per optimizer op, so no helper calls: an input an earlier optimizer op made carries its
        # label (a ``denom`` from ``exp_avg_sq``); only the others (the parameter, its gradient
        # and state as the step finds them) are looked up by memory, one data_ptr call each.
        found: str | None = None
        missed = False
        for meta, t in zip(inputs, tensors):  # noqa: B905 - one meta per tensor, by construction
            name = None
            source = meta[2]
            if source is not None:
                producer = records[source[0]]
                if producer[RECORD_PHASE] == "optimizer":
                    name = producer[RECORD_PARAMETER]
            if name is None:
                try:
                    pointer = t.data_ptr()
                except (RuntimeError, NotImplementedError):
                    continue
                name = self._names.get(pointer)
                if name is None:
                    missed = missed or pointer != 0
                    continue
            if found is None:
                found = name
            elif name != found:
                return None
        # A tensor not seen before, where the optimizer's state grew since it was learnt: AdamW's
        # first step makes each parameter's step counter before its first update.
        if found is None and missed and any([self._learn(o) for o in self._optimizers]):
            return self.label(inputs, tensors, records)
        return found
