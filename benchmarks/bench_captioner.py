"""Speed of the captioner (Kiros et al. 2014, 2.5 and 5.2) on a trained captioner folder, each
figure beside a floor measured in the same run:

- training: words per second of SC-NLM steps (forward, cross-entropy, backward, Adam) on batches of
  the folder's own training captions at its sizes. Floor: the softmax output layer alone
  (f W^fv + b, cross-entropy, backward) on the same batches, a cost no SC-NLM step avoids.
- generation: seconds to describe one image (`Captioner.describe`: the candidates decoded as one
  batch, then re-ranked), split into decode and re-rank, over dev images. Floor: the same greedy
  decode one candidate at a time (timed on 50 candidates, scaled to the folder's count), which
  batching replaces.

    python benchmarks/bench_captioner.py [--model runs/captioner/flickr8k/best]
        [--shards data/flickr8k-whole] [--images 10] [--batch 1000] [--threads 1]

Without that folder (launch/flickr8k_captioner.py trains it), it says so and times an untrained
captioner of generated scenes at the default sizes instead (`featurizer synthetic`: a vocabulary
of ~60 words, so the softmax is far cheaper than Flickr8k's 2,536 words).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import generate
from trainer.caption.captioner import Captioner, CaptionerParts, save_captioner
from trainer.caption.data import (
    END_TAG,
    NUM_TAGS,
    Windows,
    read_captions,
    scnlm_vocab_size,
    sentence_vectors,
    start_id,
    unknown_id,
)
from trainer.caption.evaluate import embed_split
from trainer.caption.scnlm import SCNLM
from trainer.config import Config
from trainer.data.reader import ReadOptions
from trainer.data.shardset import load_vocabulary, train_split, training_featurizer
from trainer.model import DeFragModel
from trainer.store.model_folder import save_model_folder

SINGLE = 50  # candidates decoded one at a time for the decode floor


def training_rates(captioner: Captioner, batch: int, steps: int) -> dict[str, float]:
    """Words/s of SC-NLM training steps and of the output layer alone, on the same batches."""
    settings = captioner.settings
    windows = Windows.of(captioner.sentences, captioner.vocab, settings.context,
                         settings.forward_tags)
    vectors = captioner.sentence_vectors
    model = SCNLM(**captioner.scnlm.sizes(), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    factors = model.word_factors.shape[0]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    batches = list(windows.batches(order[:batch * steps], batch))

    def full(rows: Windows) -> None:
        loss = F.cross_entropy(model(rows.context, rows.tags, vectors[rows.caption]), rows.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def output_layer(rows: Windows) -> None:
        f = torch.randn(len(rows), factors, requires_grad=True)
        loss = F.cross_entropy(f @ model.word_factors + model.output_bias, rows.targets)
        loss.backward()
        model.zero_grad(set_to_none=True)

    rates = {}
    for name, step in (("scnlm_step", full), ("output_layer_floor", output_layer)):
        step(batches[0])  # warm-up
        started = time.perf_counter()
        for rows in batches:
            step(rows)
        rates[name] = batch * len(batches) / (time.perf_counter() - started)
    return rates


def one_at_a_time(captioner: Captioner, image: torch.Tensor) -> float:
    """Seconds to decode SINGLE candidates one by one (the unbatched floor)."""
    sequences = captioner.pos_sequences[:SINGLE]
    started = time.perf_counter()
    for sequence in sequences:
        tags = torch.tensor([sequence])
        captioner.scnlm.greedy_decode(image[None], tags, torch.tensor([len(sequence)]),
                                      start_id(captioner.vocab), END_TAG,
                                      banned=[unknown_id(captioner.vocab)])
    return time.perf_counter() - started


def generation_times(captioner: Captioner, vectors: torch.Tensor, names: list[str]
                     ) -> dict[str, float]:
    """Median seconds per image: describe, its decode and re-rank parts, and the floor."""
    describe, decode, rerank, floor = [], [], [], []
    with torch.no_grad():
        captioner.describe(vectors[0], names[0])  # warm-up (the language model's memo too)
        for vector, name in zip(vectors, names, strict=True):
            started = time.perf_counter()
            candidates, _ = captioner.candidates(vector, seed=0)
            decoded = time.perf_counter()
            captioner.rerank(vector, candidates)
            decode.append(decoded - started)
            rerank.append(time.perf_counter() - decoded)
            started = time.perf_counter()
            captioner.describe(vector, name)
            describe.append(time.perf_counter() - started)
            floor.append(one_at_a_time(captioner, vector) * captioner.settings.candidates
                         / SINGLE)
    return {"describe_s": statistics.median(describe), "decode_s": statistics.median(decode),
            "rerank_s": statistics.median(rerank),
            "one_at_a_time_decode_floor_s": statistics.median(floor)}


def synthetic_captioner(out: Path, images: int) -> tuple[Path, str]:
    """An untrained Kiros LSTM + SC-NLM captioner folder over generated scenes, and its shards."""
    jsonl = generate(out / "source", num_train=300, num_val=images, seed=0)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=out, parser="spacy", boxes="fullframe", workers=1))
    cfg = Config.from_dict({"model": {"sentence_encoder": "lstm", "embed_dim": 300,
                                      "word_dim": 300, "fullframe_only": True},
                            "objective": {"use_fragment": False, "score": "cosine"},
                            "data": {"shards": str(out)}})
    vocab = load_vocabulary(cfg.data)
    encoder = save_model_folder(out / "encoder", DeFragModel.from_config(cfg.model, vocab, seed=0),
                                cfg, vocab, featurizer=training_featurizer(cfg.data))
    model = DeFragModel.from_config(cfg.model, vocab, seed=0)
    captions = read_captions(train_split(cfg.data).shards, vocab, ReadOptions(), "train")
    vectors = sentence_vectors(model.sentence, vocab, [c.tokens for c in captions])
    scnlm = SCNLM(scnlm_vocab_size(vocab), NUM_TAGS, vectors.shape[1], seed=0)
    save_captioner(out / "captioner", encoder, scnlm, cfg, CaptionerParts.build(captions, vectors))
    return out / "captioner", str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("runs/captioner/flickr8k/best"))
    parser.add_argument("--shards", default="data/flickr8k-whole")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--images", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1000, help="training windows per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model, shards, split = args.model, args.shards, args.split
        if not model.is_dir():
            print(f"no captioner folder at {model} (launch/flickr8k_captioner.py trains it): "
                  f"timing an untrained captioner of generated scenes instead", flush=True)
            (model, shards), split = synthetic_captioner(Path(scratch), args.images), "val"
        captioner = Captioner(model)
        embedded, vectors = embed_split(captioner, shards, split, args.images)
        result = {"model": str(model), "threads": args.threads,
                  "vocab_size": captioner.scnlm.sizes()["vocab_size"],
                  "candidates": captioner.settings.candidates, "images": embedded.num_images,
                  **training_rates(captioner, args.batch, args.steps),
                  **generation_times(captioner, vectors, embedded.image_ids)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
