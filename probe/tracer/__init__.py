"""The dispatch mode and everything it needs to know per op.

``dispatch_mode`` (the mode and the per-op routing), ``op_class`` (schema facts
per overload), ``module_tracker`` and ``frames`` (which module call an op belongs
to, in every phase), ``value_ids`` (which op produced each input: the graph's
edges), ``call_sites``, ``compat`` (torch internals, probed once), ``rank``.
"""
