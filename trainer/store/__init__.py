"""Store: what outlives a run. The model folder (weights, config, vocabulary, checksums), the MLflow
registry that versions it, and the run's tracking (with its offline spool). Imports the paper's
modules and `defrag` only."""
