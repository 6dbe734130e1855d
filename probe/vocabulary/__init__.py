"""What every layer may read: the shared vocabularies, importing no other layer of the probe.

- :mod:`probe.vocabulary.op_class`: what an aten op is (schema facts per overload: view,
  in-place, random, collective, ...);
- :mod:`probe.vocabulary.op_tensors`: which tensors an op reads and writes;
- :mod:`probe.vocabulary.option_values`: the validators of ``probe.mode``'s options and the
  validated :class:`~probe.vocabulary.option_values.Options` record;
- :mod:`probe.vocabulary.rounding`: what rounding a dtype makes (its eps, the error bound of a
  reduction), read by the free benchmark and by compare alike;
- :mod:`probe.vocabulary.csv_cells`: a cell as a spreadsheet shows it, never as a formula.

The layer contract (``tests/test_layers.py``, ``docs/architecture.md``) lets every layer import
this package; this package imports only :mod:`probe.errors`.
"""
