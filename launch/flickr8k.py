"""Flickr8k, the paper's Table 2 on the dev split: featurize -> train each row -> evaluate -> table.

    .venv/bin/python launch/flickr8k.py               # every row; finished stages are skipped
    .venv/bin/python launch/flickr8k.py full devise   # only these rows
    .venv/bin/python launch/flickr8k.py --list        # the rows and their config overrides

Two instances may run different rows at once (e.g. with OMP_NUM_THREADS=1 each on 2 cores).

Stages, each skipped when its output is already there:
1. featurize ../shared/flickr8k (train + dev; spaCy, selective search scored by
   EfficientNet-Lite0) into data/flickr8k (resumable shard by shard);
2. word2vec vectors from the training captions (rows that use them);
3. train each row: `torchrun --nproc_per_node 1 -m trainer.main` with its config + overrides,
   its own run directory under runs/table2/ (phase-1 CNN features cached once for all rows);
4. evaluate the row's best model on dev with `python -m trainer.evaluate`.
Writes runs/table2/results.json (metrics, wall times, per-epoch history) and
runs/table2/results.md (the table of docs/results.md, beside the paper's Table 2 figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = "launch/configs/flickr8k.yaml"
SHARDS = "data/flickr8k"
WORD2VEC = "data/flickr8k-wordvecs/word2vec-200.txt"
RUNS = Path("runs/table2")
FEATURIZE = [str(BIN / "python"), "-m", "featurizer", "flickr", "--root", "../shared/flickr8k",
             "--out", SHARDS, "--parser", "spacy", "--boxes", "selective_search",
             "--splits", "train", "dev", "--shard-size", "250", "--workers", "2"]
NO_MIL = ["objective.mil=false"]
# The whole-image rows train at lr 0.01 (the region rows diverge there: docs/results.md).
FULLFRAME = ["model.fullframe_only=true", "optim.lr=0.01"]
# Rows measured on 2026-11-22 (c0bfc66) at lr 0.01, before it diverged for the full model.
LR_0_01 = ["optim.lr=0.01"]
LITE2 = ["model.backbone=efficientnet_lite2", "model.image_size=260"]  # its native input size
TWELVE_EPOCHS = ["optim.epochs=12", "optim.frozen_cnn_epochs=8", "optim.anneal_last_epochs=2"]


@dataclass
class Row:
    """One line of Table 2: a config, its overrides and the paper's Flickr8K test figures."""

    title: str
    overrides: list[str] = field(default_factory=list)  # on launch/configs/flickr8k.yaml
    paper: tuple[float, ...] | None = None  # i2t R@1 R@5 R@10 med r, t2i R@1 R@5 R@10 med r


ROWS = {
    "devise": Row("DeViSE-style (mean words vs mean regions, global only)",
                  # lr 0.01 and 0.001 sent every score to 0 within 20 steps (loss stuck at
                  # 2 (B - 1) margin = 198); 1e-4 trains.
                  ["model.mean_pool=true", "model.fragment_mode=bow", "objective.smooth=0",
                   "objective.use_fragment=false", "optim.lr=0.0001", *NO_MIL],
                  paper=(4.8, 16.5, 27.3, 28, 5.9, 20.1, 29.6, 29)),
    "fragment": Row("Fragment alignment objective",
                    ["objective.use_global=false", *NO_MIL, *LR_0_01],
                    paper=(7.2, 21.9, 31.8, 25, 5.9, 20.0, 30.3, 26)),
    "global": Row("Global ranking objective", ["objective.use_fragment=false", *NO_MIL, *LR_0_01],
                  paper=(5.8, 21.8, 34.8, 20, 7.5, 23.4, 35.0, 21)),
    "both": Row("(†) Fragment + Global", NO_MIL, paper=(12.5, 29.4, 43.8, 14, 8.6, 26.7, 38.7, 17)),
    "fullframe": Row("† → images: fullframe only", [*FULLFRAME, *NO_MIL],
                     paper=(5.9, 19.2, 27.3, 34, 5.2, 17.6, 26.5, 32)),
    "bow": Row("† → sentences: BoW", ["model.fragment_mode=bow", *NO_MIL, *LR_0_01],
               paper=(9.1, 25.9, 40.7, 17, 6.9, 22.4, 34.0, 23)),
    "bigram": Row("† → sentences: bigrams", ["model.fragment_mode=bigram", *NO_MIL, *LR_0_01],
                  paper=(8.7, 28.5, 41.0, 16, 8.5, 25.2, 37.0, 20)),
    "full": Row("Our model († + MIL)", paper=(12.6, 32.9, 44.0, 14, 9.7, 29.6, 42.5, 15)),
    "fullframe_mil": Row("† + MIL, images: fullframe only (one region: MIL labels = C_0's)",
                         FULLFRAME),
    "fullframe_hardest": Row("† + MIL, fullframe only, hardest negatives of the batch (VSE++)",
                             [*FULLFRAME, "objective.hardest_negative=true"]),
    "fullframe_long": Row("† + MIL, fullframe only, 12 epochs (8 + 4 MIL, the last 2 annealed)",
                          [*FULLFRAME, *TWELVE_EPOCHS]),
    "fullframe_lite2": Row("† + MIL, fullframe only, EfficientNet-Lite2 at its 260 px input",
                           [*FULLFRAME, *LITE2]),
    "fullframe_lite2_long": Row("† + MIL, fullframe only, EfficientNet-Lite2, 12 epochs",
                                [*FULLFRAME, *LITE2, *TWELVE_EPOCHS]),
    "long": Row("† + MIL, 10 epochs (6 phase 1 + 4 MIL, the last 2 annealed)",
                ["optim.epochs=10", "optim.frozen_cnn_epochs=6", "optim.anneal_last_epochs=2",
                 *LR_0_01]),
    "word2vec": Row("† + MIL, fixed word2vec vectors from the training captions",
                    [f"model.word_vectors={WORD2VEC}", "model.train_word_vectors=false",
                     *LR_0_01]),
    # A finetuning step costs ~11 s on 2 CPU cores (benchmarks/README.md): a whole epoch (300
    # steps) does not fit the budget. Virtual epochs of 60 steps: 20 frozen (the 1,200 steps of
    # the other rows' phase 1), then 60 finetuning steps with MIL at the annealed lr.
    "finetune": Row("† + MIL + finetuned CNN (60 steps)",
                    ["data.resampled=true", "data.epoch_pairs=6000", "optim.epochs=21",
                     "optim.frozen_cnn_epochs=20", "optim.anneal_last_epochs=1",
                     "optim.finetune_cnn=true", "optim.cnn_lr_scale=0.01", *LR_0_01]),
}
METRICS = ("i2t_r1", "i2t_r5", "i2t_r10", "i2t_medr", "t2i_r1", "t2i_r5", "t2i_r10", "t2i_medr")


def run(command: list[str], log: Path | None = None) -> float:
    """Run a stage (its output to `log` when given); return its wall time in seconds."""
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    if log is None:
        subprocess.run(command, check=True, cwd=ROOT)
    else:
        with log.open("a") as out:
            subprocess.run(command, check=True, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return time.perf_counter() - started


def register_as(name: str) -> list[str]:
    """The full model is registered as defrag@champion; the other rows under their own name."""
    return [] if name == "full" else [f"run.register_name=defrag-flickr8k-{name}"]


def train_and_evaluate(name: str, row: Row, results: dict) -> None:
    """Train a row (unless its best model was evaluated already) and evaluate it on dev."""
    run_dir = RUNS / name
    if name in results and (ROOT / run_dir / "best").is_dir():
        print(f"{name}: done already ({run_dir}); delete it to run again")
        return
    (ROOT / run_dir).mkdir(parents=True, exist_ok=True)
    if any(WORD2VEC in item for item in row.overrides) and not (ROOT / WORD2VEC).is_file():
        run([str(BIN / "python"), "-m", "featurizer", "wordvecs", "--shards", SHARDS, "--out",
             WORD2VEC])
    train_s = run([str(BIN / "torchrun"), "--nproc_per_node", "1", "-m", "trainer.main",
                   "--config", CONFIG, "--resume", "latest", f"run.run_dir={run_dir}",
                   *row.overrides, *register_as(name)], ROOT / run_dir / "train.log")
    evaluate = [str(BIN / "python"), "-m", "trainer.evaluate", "--model", str(run_dir / "best"),
                "--shards", SHARDS, "--split", "dev"]
    out = subprocess.run(evaluate, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    history = [json.loads(line) for line in (ROOT / run_dir / "history.jsonl").open()]
    results[name] = {"title": row.title, "config": CONFIG, "overrides": row.overrides,
                     "train_wall_s": round(train_s), "dev": json.loads(out.splitlines()[-1]),
                     "epochs": history}
    print(out)


def table(results: dict) -> str:
    """Markdown: our dev figures beside the paper's Flickr8K test figures, row by row."""
    head = ("| Model | image annotation R@1 / R@5 / R@10, med r | image search R@1 / R@5 / "
            "R@10, med r | paper (test): annotation | paper (test): search | train wall |\n"
            "|---|---|---|---|---|---|\n")
    lines = []
    for name, row in ROWS.items():
        if name not in results:
            continue
        dev = results[name]["dev"]
        ours = [f"{dev[k]:.1f}" if "medr" not in k else f"{dev[k]:.0f}" for k in METRICS]
        paper = [f"{x:g}" for x in row.paper] if row.paper else ["–"] * 8
        minutes = results[name]["train_wall_s"] / 60
        lines.append(f"| {row.title} | {' / '.join(ours[:3])}, {ours[3]} | "
                     f"{' / '.join(ours[4:7])}, {ours[7]} | {' / '.join(paper[:3])}, {paper[3]} | "
                     f"{' / '.join(paper[4:7])}, {paper[7]} | {minutes:.0f} min |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", help=f"rows to run (default: all): {', '.join(ROWS)}")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    args = parser.parse_args()
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:10} {' '.join(row.overrides)}")
        return
    unknown = set(args.rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}")
    os.chdir(ROOT)
    results_file = RUNS / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    if not (Path(SHARDS) / "manifest.json").is_file() or "featurize_wall_s" not in results:
        results["featurize_wall_s"] = round(run(FEATURIZE))
    for name in args.rows or ROWS:
        train_and_evaluate(name, ROWS[name], results)
        # Re-read before writing: another instance may be running other rows at the same time.
        merged = json.loads(results_file.read_text()) if results_file.is_file() else {}
        results = {**merged, **{k: v for k, v in results.items() if k == name or k not in merged}}
        results_file.write_text(json.dumps(results, indent=1))
        (RUNS / "results.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
