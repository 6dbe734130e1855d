"""Questions asked of loaded runs: op graphs, first non-finite op, step summaries."""
