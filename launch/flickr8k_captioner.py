"""Flickr8k captions (Kiros et al. 2014, 2.5 and 5.2): the tuned Kiros LSTM -> the SC-NLM trained on
its sentence vectors -> captions of the dev images, measured beside two baselines.

    .venv/bin/python launch/flickr8k_captioner.py [--images N] [--candidates N]

Stages, each skipped when its output is already there:
1. the kiros_lstm_tuned row of launch/flickr8k.py (featurizing, word vectors, training);
2. `torchrun --nproc_per_node 1 -m trainer.caption.train --config CONFIG`: runs/captioner/flickr8k,
   its best captioner registered as models:/defrag-captioner@champion;
3. `defrag caption-eval` on the dev split: every caption and figure in dev-captions.json,
   the example picture docs/flickr8k-captions.jpg.
Writes runs/captioner/flickr8k/results.md (the table of docs/results.md) with each stage's time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flickr8k import BIN, ROOT, run  # launch/flickr8k.py, beside this script

CONFIG = "launch/configs/flickr8k-captioner.yaml"
ENCODER_ROW = "kiros_lstm_tuned"
RUN = Path("runs/captioner/flickr8k")
SHARDS = "data/flickr8k-whole"
PICTURE = "docs/flickr8k-captions.jpg"
TIMES = RUN / "times.json"
SYSTEMS = {"generated": "SC-NLM, re-ranked (5.2)",
           "nearest_sentence": "nearest training sentence",
           "language_model": "language model alone (no image)"}


def table(results: dict, times: dict) -> str:
    """Markdown: each system's caption figures (x 100 but retrieval) on dev."""
    lines = ["| system | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | METEOR | CIDEr | caption retrieval "
             "R@1 / R@5 / R@10, med r |", "|---|---|---|---|---|---|---|---|"]
    for system, title in SYSTEMS.items():
        figures = results["systems"][system]
        scores = [f"{100 * figures[k]:.1f}" if k in figures else "–"
                  for k in ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "CIDEr")]
        ranks = figures["retrieval"]
        lines.append(f"| {title} | {' | '.join(scores)} | {ranks['r1']:.1f} / {ranks['r5']:.1f}"
                     f" / {ranks['r10']:.1f}, {ranks['medr']:.0f} |")
    stages = ", ".join(f"{k} {v / 60:.0f} min" for k, v in times.items())
    return (f"{results['images']} {results['split']} images, {results['settings']['candidates']} "
            f"candidates per image, seed {results['seed']}; stages: {stages}\n\n"
            + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, help="only the first N dev images")
    parser.add_argument("--candidates", type=int, help="candidates per image (default 1000)")
    args = parser.parse_args()
    times = json.loads((ROOT / TIMES).read_text()) if (ROOT / TIMES).is_file() else {}
    encoder = ROOT / "runs" / "table2" / ENCODER_ROW / "best"
    if not encoder.is_dir():
        times["encoder_s"] = run([str(BIN / "python"), "launch/flickr8k.py", ENCODER_ROW])
    (ROOT / RUN).mkdir(parents=True, exist_ok=True)
    if not (ROOT / RUN / "best").is_dir():
        times["captioner_train_s"] = run(
            [str(BIN / "torchrun"), "--nproc_per_node", "1", "-m", "trainer.caption.train",
             "--config", CONFIG, "--resume", "latest"], ROOT / RUN / "train.log")
    out = RUN / "dev-captions.json"
    extra = [*(["--images", str(args.images)] if args.images else []),
             *(["--candidates", str(args.candidates)] if args.candidates else [])]
    times["caption_dev_s"] = run([str(BIN / "defrag"), "caption-eval", "--model",
                                  str(RUN / "best"), "--shards", SHARDS, "--split", "dev",
                                  "--out", str(out), "--picture", PICTURE, *extra],
                                 ROOT / RUN / "eval.log")
    (ROOT / TIMES).write_text(json.dumps(times, indent=1))
    results = json.loads((ROOT / out).read_text())
    (ROOT / RUN / "results.md").write_text(table(results, times))
    print(table(results, times))


if __name__ == "__main__":
    main()
