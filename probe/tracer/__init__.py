"""The dispatch mode and everything it needs to know per op.

``dispatch_mode`` (the mode and the per-op routing), ``observer`` (the per-op interface
the modes implement), ``module_tracker`` and ``frames`` (which module call an op belongs
to, in every phase), ``value_ids`` (which op produced each input: the graph's edges),
``call_sites``, ``compat`` (torch internals, probed once), ``rank``. What an aten op is
(``op_class``, ``op_tensors``) lives in :mod:`probe.vocabulary`, which every layer reads.
"""
