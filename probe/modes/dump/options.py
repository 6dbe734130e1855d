"""The config of the dump mode: ``probe.mode(probe.Dump(...), ...)``."""

from __future__ import annotations

from dataclasses import dataclass

from probe.errors import ProbeError
from probe.modes.config import ModeConfig
from probe.vocabulary.option_fields import boolean, choice, integer, option
from probe.vocabulary.option_values import host_memory_bytes

TENSOR_CHOICES = ("all", "inputs", "outputs")
BUDGET_POLICIES = ("wait", "skip")
ERROR_POLICIES = ("warn", "raise")


@dataclass(frozen=True, kw_only=True, eq=False)
class Dump(ModeConfig):
    """The tensors themselves, to safetensors shards, with the calls that made them."""

    mode = "dump"

    tensors: str = option("all", check=choice(*TENSOR_CHOICES), doc="which tensors of each op are written")
    shard_size: int = option(1 << 30, check=integer(1), doc="bytes per safetensors shard")
    memory_budget: int = option(2 << 30, check=integer(1),
                                doc="host bytes of tensors in flight to the writer (at most this machine's)")
    on_budget: str = option("wait", check=choice(*BUDGET_POLICIES),
                            doc="when the budget is spent: training waits, or the tensor is skipped (named)")
    on_error: str = option("warn", check=choice(*ERROR_POLICIES),
                           doc="a shard that cannot be written: one warning, or training stops at `step()`")
    checksum: bool = option(False, check=boolean(), doc="a bitwise checksum of each tensor in the index")

    def validate(self) -> None:
        host = host_memory_bytes()
        if host is not None and self.memory_budget > host:  # its buffers would fail to allocate mid-run
            raise ProbeError(f"option 'memory_budget': {self.memory_budget} bytes is more than this "
                             f"machine's memory ({host} bytes)")
