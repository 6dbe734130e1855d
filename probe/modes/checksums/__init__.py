"""Checksums of the parameters, the model's inputs and the RNG states at each step (no per-op
work): what tells two runs apart before any op is compared.

``mode`` is the plug-in and writer, ``files`` the reader; ``bit_checksum`` the checksum itself.
"""

from __future__ import annotations

from probe.modes.checksums.files import ChecksumsFiles
from probe.modes.checksums.mode import ChecksumsMode

__all__ = ["ChecksumsFiles", "ChecksumsMode"]
