"""benchmarks/bench_eval.py's verdict on trainer.evaluate's memory, on the figures it measured
(benchmarks/README.md, "Evaluation memory") and on a split that keeps 100 KiB per image."""

from __future__ import annotations

from benchmarks.bench_eval import MIB, evaluate_failure


def row(images: int, peak_mib: float, inherent_mib: float) -> dict:
    return {"images": images, "peak_rss_bytes": peak_mib * MIB,
            "inherent_bytes": inherent_mib * MIB, "working_bytes": (peak_mib - inherent_mib) * MIB}


def test_the_measured_splits_pass_and_100_kib_kept_per_image_fails_within_the_ratio() -> None:
    floor = row(100, 1690, 19.1)
    assert evaluate_failure([floor, row(1600, 1984, 352.5)], 1.2, 64) is None
    leaking = row(1600, 1690 + 333.4 + 1500 * 100 / 1024, 352.5)  # 146 MiB more
    assert leaking["working_bytes"] < 1.2 * floor["working_bytes"]  # the ratio alone passes it
    assert evaluate_failure([floor, leaking], 1.2, 64) == (
        "trainer.evaluate's peak grows 100 KiB per image beyond the score matrix and embeddings "
        "from 100 to 1600 images, over --eval-per-image-kib 64: something is kept per image "
        "(see the trainer.evaluate lines)")
    assert evaluate_failure([floor, row(1600, 2400, 352.5)], 1.2, 1024).startswith(
        "trainer.evaluate's working memory grows with the split: over 1.2 x the 100-image")
