"""Forward + backward time of each sentence encoder on one batch of real Flickr8k captions.

Every encoder of trainer/encoders encodes the same B captions (read from format-2 shards: tokens,
triplets and dependency trees) at the sizes a user runs: `fragments` (DeFrag eq. 1) as in
launch/configs/flickr8k.yaml (d = 1000, word_dim 200, W_e trained), the whole-sentence encoders
(lstm, linear, dtrnn, sdtrnn) as in launch/configs/flickr8k-whole.yaml (K = 300, word_dim 300,
W_e fixed). The loss is Kiros et al.'s cosine ranking loss (margin 0.2, summed hinges, both
directions) against fixed random image vectors, so every encoder gets the same cheap head.

The encoders take turns within each repeat (round robin), so a shared machine's slow stretches
weigh on all of them; the ratio to `fragments` is the median of the per-repeat ratios.
`--threads 1` (the default) keeps the figures comparable on a machine other jobs share.

    python benchmarks/bench_encoders.py [--shards data/flickr8k-whole] [--batch 100]
        [--repeats 20] [--threads 1]

Without the Flickr8k shards (launch/flickr8k.py featurizes them), it says so and times captions
of generated scenes instead (`featurizer synthetic`; shorter and simpler than Flickr8k's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from trainer.batch import Batch, collate
from trainer.config import Config
from trainer.data.reader import SampleDecoder, read_images
from trainer.data.shardset import load_vocabulary, train_split
from trainer.encoders import NAMES, dtrnn, encoder_class
from trainer.objectives import image_sentence_scores
from trainer.wordvecs import embedding_matrix

CONFIGS = Path(__file__).resolve().parent.parent / "launch" / "configs"
DEFAULT_SHARDS = "data/flickr8k-whole"
MARGIN = 0.2  # Kiros et al.'s margin (launch/configs/flickr8k-whole.yaml)


def encoder_config(name: str, shards: str) -> Config:
    """The config a user runs `name` with: flickr8k.yaml for fragments, else flickr8k-whole.yaml."""
    path = CONFIGS / ("flickr8k.yaml" if name == "fragments" else "flickr8k-whole.yaml")
    return Config.load(path, [f"model.sentence_encoder={name}", f"data.shards={shards}"])


def read_batch(cfg: Config, pairs: int) -> Batch:
    """The first `pairs` (image, caption) pairs of the training split, with their trees."""
    vocab = load_vocabulary(cfg.data)
    decoder = SampleDecoder(vocab, 32, 1, "triplet", trees=True)  # pixels are not used
    split = train_split(cfg.data)
    split.require_trees("benchmarks/bench_encoders.py")  # a one-line error for format 1
    images = read_images(split.shards, decoder)
    chosen = itertools.islice((pair for image in images for pair in image.pairs()), pairs)
    return collate(list(chosen))


def ranking_loss(s: torch.Tensor, s_owner: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """Summed hinges of the cosine scores of image k and sentence k against every other pair."""
    n = len(images)
    scores = image_sentence_scores(images, torch.arange(n), s, s_owner, n, n, score="cosine")
    positive = scores.diagonal()
    off = ~torch.eye(n, dtype=torch.bool)
    hinges = (MARGIN - positive[:, None] + scores).clamp(min=0) \
        + (MARGIN - positive[None, :] + scores).clamp(min=0)
    return hinges[off].sum()


class Case:
    """One encoder built from its config, with its inputs from the batch and a timed step."""

    def __init__(self, name: str, shards: str, batch: Batch) -> None:
        cfg = encoder_config(name, shards)
        vocab = load_vocabulary(cfg.data)
        words = embedding_matrix(vocab.words, cfg.model.word_vectors, cfg.model.word_dim)
        self.name, self.model = name, cfg.model
        self.encoder = encoder_class(name).from_config(cfg.model, vocab, words)
        self.inputs = self.encoder.batch_inputs(batch)
        self.num_sentences = len(batch.captions)
        self.owner = self.encoder.owners(self.inputs, self.num_sentences)
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(self.num_sentences, self.encoder.embed_dim, generator=generator)
        self.times: list[float] = []

    def step(self) -> float:
        start = time.perf_counter()
        s = self.encoder(*self.inputs, num_sentences=self.num_sentences)
        ranking_loss(s, self.owner, self.images).backward()
        seconds = time.perf_counter() - start
        self.encoder.zero_grad(set_to_none=True)
        return seconds


def tree_batching(case: Case, batch: Batch) -> dict:
    """Levels of the batch's forest against its nodes, and the batched child products one
    forward of a tree encoder makes (counted): one per level with children, not one per node."""
    height, _ = dtrnn.tree_levels(batch.word_head)
    with mock.patch.object(dtrnn, "matmul_by_index", wraps=dtrnn.matmul_by_index) as products:
        case.encoder(*case.inputs, num_sentences=case.num_sentences)
    levels_with_children = len(torch.unique(height[batch.word_head >= 0]))
    assert products.call_count == levels_with_children, "the tree encoder is not batched"
    return {"nodes": len(batch.words), "levels": int(height.max()) + 1,
            "products": products.call_count}


def synthetic_shards(out: Path, captions: int) -> str:
    """Shards of generated scenes with at least `captions` captions (5 per image)."""
    jsonl = generate(out / "source", num_train=captions // 5 + 1, num_val=1, seed=0)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=out, parser="spacy", boxes="given", workers=1, min_word_count=1))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default=DEFAULT_SHARDS,
                        help="featurizer output with dependency trees (shard format 2)")
    parser.add_argument("--batch", type=int, default=100, help="captions per batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: comparable "
                        "on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.shards == DEFAULT_SHARDS and not Path(DEFAULT_SHARDS).is_dir():
        print(f"{DEFAULT_SHARDS} not found (launch/flickr8k.py writes it): timing captions of "
              f"generated scenes instead")
        args.shards = synthetic_shards(Path(tempfile.mkdtemp(prefix="bench-encoders-")),
                                       args.batch)
    batch = read_batch(encoder_config("sdtrnn", args.shards), args.batch)
    order = ["fragments"] + [name for name in NAMES if name != "fragments"]
    cases = [Case(name, args.shards, batch) for name in order]
    lengths = torch.bincount(batch.word_sentence)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
          f"{os.getloadavg()[0]:.1f}; {args.shards}: {len(batch.captions)} captions, "
          f"{len(batch.words)} words (longest {lengths.max()}: the lstm's steps), "
          f"{len(batch.fragments)} triplets")

    for case in cases * 2:  # warm-up
        case.step()
    for _ in range(args.repeats):  # round robin: each repeat times every encoder once
        for case in cases:
            case.times.append(case.step())

    base = cases[0].times
    results = []
    for case in cases:
        m = case.model
        results.append({
            "encoder": case.name, "embed_dim": m.embed_dim, "word_dim": m.word_dim,
            "train_word_vectors": m.train_word_vectors, "rows": len(case.owner),
            "ms": 1e3 * statistics.median(case.times),
            "ratio": statistics.median(t / b for t, b in zip(case.times, base, strict=True))})
        if "word_head" in case.encoder.inputs:
            results[-1].update(tree_batching(case, batch))
    for r in results:
        trees = (f"; {r['levels']} levels for {r['nodes']} nodes, {r['products']} batched "
                 f"child products" if "levels" in r else "")
        print(f"{r['encoder']:>9} (d {r['embed_dim']}, word_dim {r['word_dim']}, {r['rows']} "
              f"rows): fwd+bwd {r['ms']:7.2f} ms, x{r['ratio']:.2f} fragments{trees}")
    print(json.dumps({"batch": len(batch.captions), "threads": args.threads,
                      "repeats": args.repeats, "load_average": os.getloadavg()[0],
                      "results": results}))


if __name__ == "__main__":
    main()
