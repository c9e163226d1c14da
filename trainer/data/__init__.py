"""Data: where a set of shards lives, the one sample reader, the training loader (exact and
resampled epochs, forked loader processes) and the eval split. Imports the paper's modules and
`defrag` only."""
