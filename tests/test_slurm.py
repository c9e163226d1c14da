"""launch/slurm/train.sbatch on a real one-node SLURM cluster started on localhost (CPU mode).

The job is asked to stop mid-run the way SLURM does it before the time limit (SIGUSR1 to the
batch shell, `--signal=B:USR1@120`), or by SIGTERM to every process of its training step
(`scancel --signal=TERM`): it checkpoints, requeues itself, resumes from the checkpoint and
completes with a best model and one finished MLflow run.

Needs root and Debian's `slurmctld slurmd slurm-client munge` (no systemd or cgroups:
proctrack/linuxproc, task/none). Without them the test is skipped, unless DEFRAG_REQUIRE_SLURM=1
(set by .ci/run) turns the skip into a failure. The cluster is tests/cluster.py's `one_node`,
started once for the session by tests/conftest.py's `slurm` fixture.
"""

from __future__ import annotations

import subprocess

import pytest
from mlflow import MlflowClient

# ENDED, ROOT, jobs, job_field and wait_for are imported from here by test_index_build and
# test_featurize_at_scale.
from tests.cluster import ENDED, ROOT, job_field, jobs, tool, wait_for  # noqa: F401
from tests.test_train_e2e import tiny_config
from trainer.store.model_folder import ModelFolder
from trainer.training.checkpoint import latest_checkpoint, load_state

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signal", ["USR1", "TERM"])
def test_job_stopped_by_signal_requeues_resumes_and_completes(slurm, tmp_path, shards, signal):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri).create_experiment(
        "defrag", artifact_location=(tmp_path / "artifacts").as_uri())
    env = {**slurm, "CONFIG": str(tiny_config(tmp_path, shards)), "SHARDS": str(shards),
           "RUN_DIR": str(run_dir), "GPUS_PER_NODE": "0", "CPU_PROCS_PER_NODE": "2",
           "MLFLOW_TRACKING_URI": tracking_uri}
    job = subprocess.run([tool("sbatch"), "--parsable", f"--output={log}",
                          str(ROOT / "launch/slurm/train.sbatch"), "run.log_every_steps=1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job_id = job.stdout.strip().split(";")[0]
    try:
        # The first attempt has set its trap once it prints its start line; the request is
        # then seen at its first training step.
        wait_for(lambda: log.is_file() and "(restart 0)" in log.read_text(), 120,
                 "the job to start", log)
        if signal == "USR1":  # to the batch shell, which asks the trainer to stop
            subprocess.run([tool("scancel"), "--batch", "--signal=USR1", job_id], env=env,
                           check=True)
        else:  # to torchrun and its workers, once these catch it (the training has started)
            wait_for(lambda: "epoch 0: phase" in log.read_text(), 300, "the training", log)
            subprocess.run([tool("scancel"), "--signal=TERM", job_id], env=env, check=True)
        wait_for(lambda: job_field(slurm, job_id, "JobState") in ENDED, 300, "the job to end",
                 log)
    finally:
        subprocess.run([tool("scancel"), job_id], env=env, capture_output=True)
    output = log.read_text()
    assert job_field(slurm, job_id, "JobState") == "COMPLETED", output[-4000:]
    assert job_field(slurm, job_id, "Restarts") == "1", output[-4000:]
    assert "requeueing the job" in output and "(restart 1)" in output, output[-4000:]
    assert "resumed from" in output, output[-4000:]

    state = load_state(latest_checkpoint(run_dir))
    assert state.epoch == 2
    ModelFolder.open(run_dir / "best")
    client = MlflowClient(tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("defrag").experiment_id])
    assert run.info.status == "FINISHED"  # the requeued job resumed the same run
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps == list(range(1, state.global_step + 1))  # none lost or repeated at the stop
    assert len(client.get_metric_history(run.info.run_id, "val/rsum")) == 2
    assert client.get_model_version_by_alias("defrag", "champion").run_id == run.info.run_id
