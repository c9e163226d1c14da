"""Bad input to any command line: one line naming the key, file or server at fault, a non-zero
exit status, and nothing started (trainer/config.py's schema, defrag/cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import DEFRAG
from tests.test_train_e2e import tiny_config
from trainer.config import Config, ConfigError


@pytest.mark.parametrize("override, expected", [
    ("optim.lr=abc", "config key optim.lr = 'abc': expected a number > 0"),
    ("optim.lr=0", "config key optim.lr = 0: expected a number > 0"),
    ("optim.epochs=two", "config key optim.epochs = 'two': expected an integer >= 1"),
    ("optim.epochs=2.5", "config key optim.epochs = 2.5: expected an integer >= 1"),
    ("run.nonfinite_loss=foo", "run.nonfinite_loss = 'foo': expected one of 'skip', 'stop'"),
    ("run.nonfinite_loss=STOP", "run.nonfinite_loss = 'STOP': expected one of 'skip', 'stop'"),
    ("optim.grad_clip=-1", "optim.grad_clip = -1: expected a number > 0 or null"),
    ("data.workers=-1", "data.workers = -1: expected an integer >= 0"),
    ("data.verify_shards=some", "expected one of 'local', 'all', 'none'"),
    ("model.pretrained=1", "model.pretrained = 1: expected true or false"),
    ("model.backbone=7", "model.backbone = 7: expected a string"),
    ("data.seed=1.5", "data.seed = 1.5: expected an integer or null"),
    ("optim.nope=1", "unknown config key 'optim.nope'"),
    ("optim=3", "config key 'optim' is a section; expected a mapping"),
])
def test_every_value_is_checked_when_loaded(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Config.load(None, [override])
    assert expected in str(caught.value)


def test_values_that_fit_are_kept_and_ints_widen_to_floats() -> None:
    cfg = Config.load(None, ["optim.lr=1", "optim.grad_clip=null", "data.epoch_pairs=500",
                             "run.nonfinite_loss=stop", "model.word_vectors=vectors.txt"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.grad_clip is None and cfg.data.epoch_pairs == 500
    assert cfg.run.nonfinite_loss == "stop" and cfg.model.word_vectors == "vectors.txt"


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 0.01\n  epochs: [3\n")
    with pytest.raises(ConfigError, match=rf"config file {path}: invalid YAML at line 4"):
        Config.load(path)
    with pytest.raises(ConfigError, match=rf"config file {tmp_path / 'missing.yaml'}: No such"):
        Config.load(tmp_path / "missing.yaml")


TRAIN = [sys.executable, "-m", "trainer.main"]  # what torchrun starts in each worker
EVALUATE = [DEFRAG, "evaluate"]


def run_cli(command: list[str], *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def error_lines(process: subprocess.CompletedProcess) -> list[str]:
    """stderr's lines, without the INFO log lines of a training process."""
    return [line for line in process.stderr.splitlines() if line.strip() and " INFO " not in line]


def test_a_bad_value_stops_training_before_anything_starts(tmp_path: Path, shards: Path) -> None:
    config = tiny_config(tmp_path, shards)
    with ThreadPoolExecutor(2) as pool:  # side by side: each imports the trainer for seconds
        failed, debug = pool.map(lambda extra: run_cli(TRAIN, "--config", str(config),
                                                       "optim.lr=abc", *extra), [[], ["--debug"]])
    assert failed.returncode == 1
    assert error_lines(failed) == ["trainer.main: error: config key optim.lr = 'abc': expected "
                                   "a number > 0 (--debug shows the traceback)"]
    assert not (tmp_path / "run").exists()  # no run folder, no MLflow run
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def test_a_refused_model_folder_is_one_line(tmp_path: Path, shards: Path) -> None:
    (tmp_path / "model").mkdir()
    failed = run_cli(EVALUATE, "--model", str(tmp_path / "model"), "--shards",
                     str(shards))
    assert failed.returncode == 1
    assert error_lines(failed) == [f"defrag evaluate: error: {tmp_path / 'model'}: "
                                   f"checksums.json is missing; not a model folder, or an "
                                   f"incomplete copy (--debug shows the traceback)"]


def test_overrides_may_follow_the_options(tmp_path: Path, shards: Path) -> None:
    """`--resume DIR key=value` after other overrides: every override is read (the bad one
    named), none refused as an unrecognized argument."""
    config = tiny_config(tmp_path, shards)
    failed = run_cli(TRAIN, "--config", str(config), "optim.epochs=3", "--resume",
                     str(tmp_path / "run" / "checkpoints" / "step-00000010"), "optim.lr=abc")
    assert failed.returncode == 1
    assert error_lines(failed) == ["trainer.main: error: config key optim.lr = 'abc': expected "
                                   "a number > 0 (--debug shows the traceback)"]


@pytest.mark.slow
def test_an_unreachable_tracking_server_is_one_line(tmp_path: Path, shards: Path) -> None:
    config = tiny_config(tmp_path, shards)
    failed = run_cli(TRAIN, "--config", str(config),
                     env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert failed.returncode == 1
    lines = error_lines(failed)
    assert len(lines) == 1 and lines[0].startswith("trainer.main: error: ")
    assert "http://127.0.0.1:9" in lines[0], lines
    assert not (tmp_path / "run" / "LOCK").exists()  # released on the way out


def test_every_key_accepts_its_default_value() -> None:
    """Every leaf key has a type the checker knows (a new key with an unknown annotation would
    otherwise fail only when someone sets it)."""
    defaults = Config().to_dict()
    for section, keys in defaults.items():
        for key, value in keys.items() if isinstance(keys, dict) else [(None, keys)]:
            name = f"{section}.{key}" if key else section
            assert Config.load(None, [f"{name}={json.dumps(value)}"]).to_dict() == defaults
