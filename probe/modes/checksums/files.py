"""``checksums.json`` of one step, read back (the reader half of the mode; ``mode.py`` is the writer),
and over a whole run (``run.mode("checksums")``)."""

from __future__ import annotations

from typing import Any, cast

from probe.modes.checksums.records import InputCall, StepChecksums, TensorChecksum
from probe.rundir.mode_files import ModeFiles, ModeReader
from probe.rundir.untrusted_reads import expect, read_json, reading

CHECKSUMS_FILE = "checksums.json"
"""Per step, with model=: checksums of the parameters, the model's inputs and the RNG states."""


def _tensor_list(data: dict[str, Any], what: str) -> list[TensorChecksum]:
    names = expect(data.get("names"), list, f"{what}.names")
    dtypes = expect(data.get("dtypes"), list, f"{what}.dtypes")
    shapes = expect(data.get("shapes"), list, f"{what}.shapes")
    values = expect(data.get("checksums"), list, f"{what}.checksums")
    if not len(names) == len(dtypes) == len(shapes) == len(values):
        raise ValueError(f"{what}: names, dtypes, shapes and checksums differ in length")
    def shape(s: Any) -> tuple[int, ...]:
        return tuple(expect(x, int, f"a size in {what}") for x in expect(s, list, f"a shape in {what}"))

    return [TensorChecksum(expect(n, str, f"a name in {what}"), expect(d, str, f"a dtype in {what}"),
                           shape(s), expect(c, (str, type(None)), f"a checksum in {what}"))
            for n, d, s, c in zip(names, dtypes, shapes, values, strict=True)]


class ChecksumsReader(ModeReader):
    """The checksums over a run: ``run.mode("checksums")``."""

    def checksums(self, step: int | None = None, rank: int | None = None) -> StepChecksums | None:
        """What one step recorded (default: the first step of ``rank``, or of rank 0), or None
        when it recorded no checksums."""
        files = self.files(step, rank)
        return None if files is None else cast(ChecksumsFiles, files).checksums()


class ChecksumsFiles(ModeFiles):
    """``checksums.json`` of one step, read back."""

    file_names = (CHECKSUMS_FILE,)
    run_reader = ChecksumsReader

    _read: StepChecksums | None = None

    def checksums(self) -> StepChecksums:
        if self._read is None:
            path = self.where.directory / CHECKSUMS_FILE
            data = read_json(path, run=self.where.run)
            with reading(path):
                parameters = inputs = rng = buffers = None
                if "parameters" in data:
                    tensors = _tensor_list(expect(data["parameters"], dict, "parameters"), "parameters")
                    parameters = {t.name: t for t in tensors}
                if "buffers" in data:
                    tensors = _tensor_list(expect(data["buffers"], dict, "buffers"), "buffers")
                    buffers = {t.name: t for t in tensors}
                if "inputs" in data:
                    inputs = [InputCall(expect(c.get("module"), str, "inputs.module"),
                                        expect(c.get("call"), int, "inputs.call"), _tensor_list(c, "inputs"))
                              for c in (expect(c, dict, "an input call")
                                        for c in expect(data["inputs"], list, "inputs"))]
                if "rng" in data:
                    rng = {kind: expect(v, str, f"rng.{kind}")
                           for kind, v in expect(data["rng"], dict, "rng").items()}
            self._read = StepChecksums(self.where.step, self.where.rank, parameters, inputs, rng, buffers)
        return self._read


def step_checksums(run: Any, step: int, rank: int) -> StepChecksums | None:
    """The checksums a run recorded for one step (``probe.load(...)``'s Run), or None without them:
    ``run.mode("checksums").checksums(step, rank)``."""
    return cast(ChecksumsReader, run.mode("checksums")).checksums(step, rank)
