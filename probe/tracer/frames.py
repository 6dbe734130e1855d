"""Module calls as frames: who is running, and which call of it this is.

A frame is one call of one module in one step (``layers.0[1]`` is the second
call of ``layers.0``). Forward ops belong to the innermost open frame; backward
ops are attributed, through the autograd sequence number of the node that runs
them, to the frame whose forward created that node; checkpoint recompute frames
are mapped back onto the forward frames they repeat, so a recomputed op and the
backward ops that use it carry the same module call as the original forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Frame:
    """One call of a module (or of an optimizer, or the region outside both) in a step."""

    fqn: str
    """State-dict style module name reported as ``op.module``; ``""`` outside modules."""
    call: int
    """Index of this call among the step's calls of the same name; -1 for the outside region."""
    parent: Frame | None
    label: str | None = None
    """Name used in op ids instead of ``fqn`` (optimizer frames: ``optimizer.AdamW``)."""
    recompute: bool = False
    """True for a frame opened by checkpoint recompute inside backward."""
    recompute_of: Frame | None = None
    """For a recompute frame: the forward frame it repeats, when it could be found."""
    children: dict[str, list[Frame]] = field(default_factory=dict)
    """Child forward frames by module name, in call order (to map recompute frames)."""
    recompute_children: dict[str, int] = field(default_factory=dict)
    op_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """How many ops of each (phase, op name) were recorded against this frame."""
    key: str = ""
    """``fqn[call]``: the frame's part of an op id; ``""`` outside modules."""
    origin: Frame = None  # type: ignore[assignment]
    """The frame whose ops this one repeats: itself, or for a mapped recompute frame
    the forward frame (a plain attribute: it is read for every op)."""
    stack: tuple[str, ...] = ()
    """Frame keys from the outermost module call down to this one (of ``origin``'s calls): an op
    record's ``stack``, made once per frame here rather than asked of it per op."""
    _keys: tuple[str, ...] = ()
    """This frame's own chain of keys (a recompute frame's own call, where ``stack`` is its
    origin's): its children's stacks extend it."""

    def __post_init__(self) -> None:
        if self.call >= 0:
            self.key = f"{self.label if self.label is not None else self.fqn}[{self.call}]"
            # The parents' keys while they are module calls (the outside region has call -1).
            self._keys = (self.parent._keys if self.parent is not None else ()) + (self.key,)
        self.origin = self.recompute_of or self
        self.stack = self.origin.stack if self.origin is not self else self._keys

    def find_enclosing(self, fqn: str) -> Frame | None:
        """This frame or the nearest enclosing one that is a call of ``fqn``."""
        frame: Frame | None = self
        while frame is not None:
            if frame.call >= 0 and frame.fqn == fqn and frame.label is None:
                return frame
            frame = frame.parent
        return None
