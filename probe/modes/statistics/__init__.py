"""The statistics engine shared by the stats mode, the monitor and the distribution counts.

- ``columns``: the table (each raw column: how it is computed, how partial rows combine;
  each statistic: how it follows from raw columns, what it depends on) and the names;
- ``reduce``: the kernels, every one computing the table's raw columns;
- ``capture``: the one queue (staging, batches, budget, in-place writes, freed storages);
- ``finalize``: raw rows on the host -> statistics.
"""
