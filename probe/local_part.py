"""This rank's part of a distributed tensor: what the probe reduces outside its dispatch mode.

The probe's own reductions (the monitor's series, the parameter checks, checksums) run on
plain tensors. A ``DTensor`` (FSDP2's parameters, their gradients and optimizer states;
tensor-parallel activations) would turn them into DTensor ops: collectives the program
did not issue (a sync; a hang when ranks differ) or a failure on partial placements
("Redistribution from one partial type to another"). Each rank reduces its own shard;
the monitor's ``reduce_ranks=True`` combines the shards into the whole tensor's metrics.
"""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch without distributed
    _DTensor = None


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local shard where it is a ``DTensor``, else ``tensor`` itself."""
    if _DTensor is not None and isinstance(tensor, _DTensor):
        return tensor._local_tensor  # to_local() without the autograd node: read, never trained
    return tensor


def replicas(tensor: torch.Tensor) -> int | None:
    """For a ``DTensor``, how many ranks hold each of its elements: the product of the sizes of
    the mesh dimensions it is replicated over (1: sharded everywhere, as FSDP2's; HSDP's
    replicate dimension). None for a plain tensor, which cannot say by itself."""
    if _DTensor is not None and isinstance(tensor, _DTensor):
        count = 1
        for dim, placement in enumerate(tensor.placements):
            if placement.is_replicate():
                count *= tensor.device_mesh.size(dim)
        return count
    return None
