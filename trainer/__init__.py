"""The DeFrag trainer (README.md). MLflow's usage telemetry is off unless the user turns it on:
training nodes often have no route out, and its thread races with `requests` over the process
environment (a KeyError '_MLFLOW_TELEMETRY_SESSION_ID' seen at start-up)."""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
