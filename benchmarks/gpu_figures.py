"""The one JSON file of benchmarks/cuda_check.sh: the machine and software it ran on, each part's
status and seconds, the parts' figures in one flat table, and the GPU targets (benchmarks/README.md,
"GPU checks"), each as {value, target, met} from figures of the same run.

    python benchmarks/gpu_figures.py environment WORK   # at the start: WORK/environment.json
    python benchmarks/gpu_figures.py assemble WORK OUT.json [--dry-run]

WORK is the check's working folder: parts.jsonl (one {part, status, seconds, rc} per line, from
the shell script), tests.xml (pytest's JUnit report), cnn.json, train.json, feed.json (the
benchmarks' --json files) and e2e_eval.log (defrag evaluate's output). A part that wrote no
file adds no figures. The commit is $COMMIT, else `git rev-parse HEAD` (the .git folder may not
travel to the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# name -> (figure it reads, comparison, target): the GPU targets. The fed
# ratio is over feed_workers loader processes (4 on the GPU, 1 in the dry run).
TARGETS = {
    "finetune_step_over_bare_cnn": ("train_finetune_step_over_bare_cnn", "<=", 1.2),
    "fed_device_decoding_over_floor": ("feed_fed_device_ratio", ">=", 0.9),
    "new_batch_size_first_over_warm_step": ("cnn_padded_seen_max_first_over_second", "<=", 3.0),
}


def command_output(*command: str) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """The GPU (nvidia-smi and torch), driver, torch, CUDA, cuDNN and NCCL versions, Python, CPU
    cores and the commit."""
    import torch

    env = {"commit": os.environ.get("COMMIT") or command_output("git", "rev-parse", "HEAD"),
           "python": platform.python_version(), "cpu_cores": os.cpu_count(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "gpu": None, "driver": None}
    smi = command_output("nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                         "--format=csv,noheader")
    if smi:
        env["gpu"], env["gpu_memory"], env["driver"] = (f.strip() for f in
                                                        smi.splitlines()[0].split(","))
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        env.update(torch_gpu=properties.name, multiprocessors=properties.multi_processor_count,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return env


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def test_outcomes(path: Path) -> dict | None:
    """Each test's outcome (passed, failed, error, skipped) from pytest's JUnit XML report."""
    if not path.is_file():
        return None
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (
            {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed")
    return outcomes


def last_json_line(path: Path) -> dict | None:
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def flat_figures(raw: dict) -> dict:
    """The figures worth a glance, one level deep, named by part."""
    figures = {}
    if raw["tests"] is not None:
        for outcome in ("passed", "failed", "error", "skipped"):
            figures[f"tests_{outcome}"] = sum(o == outcome for o in raw["tests"].values())
    if raw["cnn"]:
        exact, padded = raw["cnn"]
        figures.update(
            cnn_image_size=exact["image_size"], cnn_sizes=[int(rows) for rows in exact["ms"]],
            cnn_exact_max_first_over_second=exact["max_first_over_second"],
            cnn_exact_first_total_s=exact["first_total_ms"] / 1e3,
            cnn_padded_seen_sizes=padded["padded_size_seen"]["sizes"],
            cnn_padded_seen_max_first_over_second=padded["padded_size_seen"][
                "max_first_over_second"],
            cnn_padded_new_sizes=padded["padded_size_new"]["sizes"],
            cnn_padded_new_max_first_over_second=padded["padded_size_new"][
                "max_first_over_second"],
            cnn_padded_new_first_total_s=padded["padded_size_new"]["first_total_ms"] / 1e3)
    if raw["train"]:
        row = raw["train"][0]
        figures.update({f"train_{key}": row[key] for key in (
            "device", "bf16", "backbone", "region_mode", "image_size", "pairs_per_step",
            "images_per_step", "frozen_images_per_s", "finetune_images_per_s")})
        figures.update(train_bare_cnn_images_per_s=row["images_per_step"] / row["bare_cnn_s"],
                       train_finetune_step_over_bare_cnn=row["overhead"],
                       train_channels_last_weights=row["channels_last"]["weights"],
                       train_channels_last_images=row["channels_last"]["images"])
    if raw["feed"]:
        feed = raw["feed"]
        figures.update(feed_workers=feed["workers"], feed_jpeg_size=feed["jpeg_size"],
                       feed_pixels_mean_abs_difference=feed["pixels"]["mean_abs_difference"],
                       feed_floor_images_per_s=feed["fed"]["floor_images_per_s"])
        for decode, row in feed["per_core"].items():
            figures[f"feed_{decode}_images_per_s_per_core"] = row["images_per_s_per_core"]
            figures[f"feed_{decode}_cores_per_gpu"] = row["cores_per_gpu"]
            figures[f"feed_fed_{decode}_images_per_s"] = feed["fed"][f"{decode}_images_per_s"]
            figures[f"feed_fed_{decode}_ratio"] = feed["fed"][f"{decode}_ratio"]
    if raw["e2e_eval"]:
        figures["e2e_eval_rsum"] = raw["e2e_eval"]["rsum"]
    return figures


def targets(figures: dict) -> dict:
    out = {}
    for name, (figure, comparison, target) in TARGETS.items():
        value = figures.get(figure)
        met = None if value is None else (value <= target if comparison == "<=" else
                                          value >= target)
        out[name] = {"value": value, "target": target, "comparison": comparison, "met": met,
                     "figure": figure}
    return out


def assemble(work: Path, out: Path, dry_run: bool) -> dict:
    parts = {}
    for line in (work / "parts.jsonl").read_text().splitlines():
        part = json.loads(line)
        name = part.pop("part")
        parts[name] = {**part, "dry": dry_run}
    raw = {"tests": test_outcomes(work / "tests.xml"), "cnn": read_json(work / "cnn.json"),
           "train": read_json(work / "train.json"), "feed": read_json(work / "feed.json"),
           "e2e_eval": last_json_line(work / "e2e_eval.log")}
    figures = flat_figures(raw)
    result = {"dry_run": dry_run, "environment": read_json(work / "environment.json"),
              "parts": parts, "targets": targets(figures), "figures": figures, "raw": raw}
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("environment").add_argument("work", type=Path)
    assembling = commands.add_parser("assemble")
    assembling.add_argument("work", type=Path)
    assembling.add_argument("out", type=Path)
    assembling.add_argument("--dry-run", action="store_true", help="the CPU rehearsal's figures")
    args = parser.parse_args()
    if args.command == "environment":
        env = environment()
        (args.work / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
        print(f"{env['gpu'] or 'no GPU'} (driver {env['driver']}), torch {env['torch']}, CUDA "
              f"{env['cuda']}, cuDNN {env['cudnn']}, {env['cpu_cores']} CPU cores, commit "
              f"{env['commit']}")
        return
    result = assemble(args.work, args.out, args.dry_run)
    for name, part in result["parts"].items():
        print(f"{name}: {part['status']} in {part['seconds']} s")
    for name, target in result["targets"].items():
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[target["met"]]
        value = "-" if target["value"] is None else f"{target['value']:.3g}"
        print(f"target {name}: {value} ({target['comparison']} {target['target']}): {verdict}"
              + (" (dry run: not GPU figures)" if args.dry_run else ""))
    print(f"figures in {args.out}")


if __name__ == "__main__":
    main()
