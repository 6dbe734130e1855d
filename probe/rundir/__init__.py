"""The run directory: ``layout`` (names and format version), ``writer`` and
``background`` (atomic step commits, on a writer thread), ``op_records`` (the JSON
form of a record) and ``reader`` (``probe.load``)."""
