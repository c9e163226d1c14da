"""Flickr8k on the dev split, the paper's Table 2 and the comparison systems (Kiros et al.'s
LSTM and linear encoders, Socher et al.'s DT-RNN and SDT-RNN): featurize -> train each row ->
evaluate -> tables.

    .venv/bin/python launch/flickr8k.py               # every row; finished stages are skipped
    .venv/bin/python launch/flickr8k.py full devise   # only these rows
    .venv/bin/python launch/flickr8k.py --list        # the rows and their config overrides
    .venv/bin/python launch/flickr8k.py --score linear_random linear_random_lite0 \
        --fused fragments_whole                      # a trained subset's dev figures

Two instances may run different rows at once (e.g. with OMP_NUM_THREADS=1 each on 2 cores).

Stages, each skipped when its output is already there:
1. featurize ../shared/flickr8k (train + dev; spaCy parses) into the rows' shard folders:
   data/flickr8k (Table 2: selective search scored by EfficientNet-Lite0) or data/flickr8k-whole
   (the comparison systems: the whole image only); resumable shard by shard;
2. word2vec vectors from the training captions (rows that use them);
3. train each row: `torchrun --nproc_per_node 1 -m trainer.main` with its config + overrides,
   its own run directory under runs/table2/ (phase-1 CNN features cached once for all rows);
4. evaluate the row's best model on dev with `defrag evaluate`.
Writes runs/table2/results.json (metrics, wall times, per-epoch history) and
runs/table2/results.md (the tables of docs/results.md, beside the papers' figures).
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

import torch
from safetensors.torch import load_file

from trainer.evaluate import retrieval_metrics
from trainer.training.preemption import DONE as PREEMPTED

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CONFIG = "launch/configs/flickr8k.yaml"
SHARDS = "data/flickr8k"
WHOLE_CONFIG = "launch/configs/flickr8k-whole.yaml"  # the comparison systems
WHOLE_SHARDS = "data/flickr8k-whole"
WORD2VEC = "data/flickr8k-wordvecs/word2vec-200.txt"
WORD2VEC_300 = "data/flickr8k-wordvecs/word2vec-300.txt"  # Kiros et al.'s K = 300
WORD_VECTORS = {WORD2VEC: 200, WORD2VEC_300: 300}  # file -> size
RUNS = Path("runs/table2")
DEV_SCORES = "dev-scores.safetensors"  # a row's dev score matrix (to choose ensemble weights)


def featurize_command(out: str, boxes: str) -> list[str]:
    return [str(BIN / "defrag"), "featurize", "flickr", "--root", "../shared/flickr8k",
            "--out", out, "--parser", "spacy", "--boxes", boxes, "--splits", "train", "dev",
            "--shard-size", "250", "--workers", "2"]


# shards folder -> (its key in results.json, the command that writes it)
FEATURIZE = {SHARDS: ("featurize_wall_s", featurize_command(SHARDS, "selective_search")),
             WHOLE_SHARDS: ("featurize_whole_wall_s", featurize_command(WHOLE_SHARDS,
                                                                        "fullframe"))}
NO_MIL = ["objective.mil=false"]
# The whole-image rows train at lr 0.01 (the region rows diverge there: docs/results.md).
FULLFRAME = ["model.fullframe_only=true", "optim.lr=0.01"]
# Rows measured on 2026-11-22 (c0bfc66) at lr 0.01, before it diverged for the full model.
LR_0_01 = ["optim.lr=0.01"]
LITE2 = ["model.backbone=efficientnet_lite2", "model.image_size=260"]  # its native input size
# The comparison systems. Kiros et al.'s Table 1 on Flickr8K with the 19-layer OxfordNet (VGG).
KIROS_VGG = (18.0, 40.9, 55.0, 8, 12.5, 37.0, 51.5, 10)
# Their fixed word vectors came from a continuous bag-of-words model; here word2vec vectors
# learned from the training captions stand in (nothing is downloaded).
KIROS_VECTORS = [f"model.word_vectors={WORD2VEC_300}", "optim.lr_decay=0.9"]
# The best found on dev (docs/results.md): Adam, the word vectors trained from word2vec's,
# 128 pairs per step, the lr annealed for the last 2 of 12 epochs.
TUNED = [f"model.word_vectors={WORD2VEC_300}", "model.train_word_vectors=true",
         "optim.optimizer=adam", "optim.lr=0.0002", "optim.batch_size=128", "optim.epochs=12",
         "optim.anneal_last_epochs=2"]
# Socher et al.: inner products, margin ~1 ("found via cross validation ... usually around 1"),
# fixed pretrained word vectors, an L2 penalty; Adam here instead of their Adagrad.
SOCHER = ["objective.score=inner", "objective.margin=1.0", f"model.word_vectors={WORD2VEC_300}",
          "optim.optimizer=adam", "optim.lr=0.0002", "optim.weight_decay=0.0001",
          "optim.batch_size=100", "optim.epochs=12", "optim.anneal_last_epochs=2"]
TWELVE_EPOCHS = ["optim.epochs=12", "optim.frozen_cnn_epochs=8", "optim.anneal_last_epochs=2"]


# SCAN's settings (its paper's, for Flickr30K): 1024-d, 300-d word vectors, Adam at 2e-4, 128
# pairs, gradients clipped at norm 2, VSE++'s hardest negatives at margin 0.2; the CNN stays
# fixed (its features cached, as roi_448's). From random word vectors with hardest negatives
# from the first step (the paper's) it collapsed here: the loss at twice the margin (every
# score alike), dev rsum 31.7 after an epoch. So it starts as the project's GRU rows do: word2vec
# vectors of the training captions (trained on), and 2 epochs of summed hinges first.
SCAN = ["model.sentence_encoder=bigru", "model.embed_dim=1024", "model.word_dim=300",
        f"model.word_vectors={WORD2VEC_300}", "model.train_word_vectors=true",
        "model.image_size=448", "objective.use_fragment=false", "objective.mil=false",
        "objective.margin=0.2", "objective.hardest_negative=true",
        "objective.hardest_negative_from_epoch=2", "optim.optimizer=adam",
        "optim.lr=0.0002", "optim.weight_decay=0", "optim.batch_size=128", "optim.grad_clip=2.0",
        "optim.epochs=12", "optim.frozen_cnn_epochs=12", "optim.anneal_last_epochs=6"]


def finetune_top(k: int, lr_scale: float = 1.0) -> list[str]:
    """Phase 2 finetunes the CNN's top `k` blocks (at lr x `lr_scale`) on cached trunk maps."""
    return ["optim.finetune_cnn=true", f"model.finetune_blocks={k}",
            f"optim.cnn_lr_scale={lr_scale:g}"]


# The Flickr8k quality rows (docs/results.md): a VSE++-style GRU (1024-d, Faghri et al.) with
# the tuned rows' training. VSE++'s hardest negatives (after 2 epochs of summed hinges) held both
# the GRU (rsum 170.4 after 5 epochs, runs/q15/gru_w2v) and the linear encoder (192.0 after 15,
# runs/q15/lin_rand_hard) far below the summed hinges (241.2 for the linear encoder).
GRU = ["model.sentence_encoder=gru", "model.embed_dim=1024", *TUNED]
# DeFrag's fragment model on the whole image (one image fragment, triplet sentence fragments,
# eq. 6 scores, C_F + C_G with MIL after 8 epochs): the fragments fused with the global models.
FRAGMENTS = ["model.sentence_encoder=fragments", "model.embed_dim=1000", "model.word_dim=200",
             "model.train_word_vectors=true", "objective.score=eq6", "objective.margin=1.0",
             "objective.use_fragment=true", "objective.mil=true", "optim.momentum=0.9",
             "optim.weight_decay=0.0001", "optim.lr=0.01", "optim.batch_size=100",
             "optim.epochs=12", "optim.frozen_cnn_epochs=8", "optim.anneal_last_epochs=2"]
# The quality rows above all read one Lite2 vector, so an ensemble of them shares its errors:
# the same models on another CNN's vector (EfficientNet-Lite0 at 224 px, cached features).
LITE0_WHOLE = ["model.backbone=efficientnet_lite0", "model.image_size=224"]
# A third CNN: EfficientNet-Lite1 at its 240 px input (1280-d).
LITE1_WHOLE = ["model.backbone=efficientnet_lite1", "model.image_size=240"]
HFLIP = ["data.hflip=true"]  # each training image or its mirror, with its own cached features
# The linear encoders trained faster and on mirrored views (found on dev, docs/results.md): lr
# 5e-4 and weight decay 1e-4 with data.hflip lift the Lite0 model from rsum 239.7 to 255.5.
FLIP = [*HFLIP, "optim.lr=0.0005", "optim.weight_decay=0.0001"]
CNNS = {"lite0": LITE0_WHOLE, "lite1": LITE1_WHOLE, "lite2": LITE2}


@dataclass
class Row:
    """One line of a table: a config, its overrides and the paper's Flickr8K test figures."""

    title: str
    overrides: list[str] = field(default_factory=list)  # on `config`
    paper: tuple[float, ...] | None = None  # i2t R@1 R@5 R@10 med r, t2i R@1 R@5 R@10 med r
    config: str = CONFIG
    shards: str = SHARDS


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
    # Regions as R-CNN sees them: each box warped and run through the CNN once (the cached
    # feature pass), where `roi` pools a 40 px box from about one cell of the 7 x 7 feature map
    # (docs/results.md). This row is the cheaper setting: 9 boxes + the image at 128 px, 1/6 of
    # the crop pixels of 20 boxes at 224 px (whose first step took 40 s for ~1,400 crops; most
    # boxes of the 224 px images are smaller than 128 px anyway). Checkpoints every 50 steps
    # keep the features computed so far if the first epoch is interrupted.
    "crop": Row("† + MIL, 9 regions + the image in crop mode (each warped to 128 px, as R-CNN)",
                ["model.region_mode=crop", "model.crop_size=128", "data.max_boxes=10",
                 "run.checkpoint_every_steps=50"]),
    # More pixels per box (docs/results.md): the image upsampled to 448 px, so RoIAlign pools
    # the boxes from a 14 x 14 feature map (a 40 px box spans ~2 cells instead of ~1).
    "roi_448": Row("† + MIL, 19 regions + the image pooled from Lite0's 14 x 14 map (448 px)",
                   ["model.image_size=448"]),
    # roi_448 was still climbing at its last epoch (191.7 -> 194.7): the same with 12 epochs.
    "roi_448_long": Row("† + MIL, 19 regions + the image from Lite0's 14 x 14 map, 12 epochs",
                        ["model.image_size=448", *TWELVE_EPOCHS]),
    # Fewer boxes: the 9 of highest objectness (the shards keep them in that order) + the image.
    "roi_448_b10": Row("† + MIL, 9 regions + the image from Lite0's 14 x 14 map, 12 epochs",
                       ["model.image_size=448", "data.max_boxes=10", *TWELVE_EPOCHS]),
    "crop_paper": Row("† + MIL, 19 regions + the image in crop mode at 224 px (the paper's R-CNN)",
                      ["model.region_mode=crop", "run.checkpoint_every_steps=50"]),
    "crop_paper_long": Row("† + MIL, 19 regions + the image in crop mode at 224 px, 12 epochs",
                           ["model.region_mode=crop", "run.checkpoint_every_steps=50",
                            *TWELVE_EPOCHS]),
    # The paper's phase 2 for whole epochs: roi_448_long's 8 frozen epochs, then 4 with MIL and
    # the CNN's top K blocks finetuned on the cached maps of the blocks below (a step on the
    # whole CNN at 448 px does not fit these cores: benchmarks/README.md, "Trainer step"). The
    # top 2 blocks at the lr of W_m (0.005) diverged 49 steps into phase 2 (docs/results.md).
    **{f"roi_448_top{k}": Row(f"† + MIL, 19 regions + the image at 448 px, 12 epochs, the "
                              f"CNN's top {k} block(s) finetuned in the last 4 (lr x{scale:g})",
                              ["model.image_size=448", *TWELVE_EPOCHS, *finetune_top(k, scale)])
       for k, scale in ((1, 1.0), (2, 0.1), (3, 0.1))},
    # SCAN (Lee et al. 2018), the fragment-alignment idea's successor, on the same region
    # features as roi_448 (its cache): a bi-GRU's word rows attend over the regions (t2i) or
    # the regions over the words (i2t), hardest negatives, Adam; the lr x0.1 for the second
    # half (SCAN: 15 of 30 epochs; 12 here, for these cores).
    **{f"scan_{direction}": Row(f"SCAN {direction} (Lee et al. 2018), 19 regions + the image "
                                "at 448 px, 12 epochs",
                                [*SCAN, f"objective.score=scan_{direction}"])
       for direction in ("t2i", "i2t")},
    # The comparison systems (docs/results.md): launch/configs/flickr8k-whole.yaml holds Kiros
    # et al.'s settings; every row uses the same cached whole-image EfficientNet-Lite2 features.
    "kiros_lstm": Row("Kiros et al.: LSTM, their hyper-parameters",
                      KIROS_VECTORS, paper=KIROS_VGG, config=WHOLE_CONFIG, shards=WHOLE_SHARDS),
    "kiros_linear": Row("Kiros et al.: linear encoder, their hyper-parameters",
                        ["model.sentence_encoder=linear", *KIROS_VECTORS], config=WHOLE_CONFIG,
                        shards=WHOLE_SHARDS),
    "kiros_lstm_tuned": Row("Kiros et al.: LSTM, tuned on dev", TUNED, paper=KIROS_VGG,
                            config=WHOLE_CONFIG, shards=WHOLE_SHARDS),
    "kiros_linear_tuned": Row("Kiros et al.: linear encoder, tuned on dev",
                              ["model.sentence_encoder=linear", *TUNED], config=WHOLE_CONFIG,
                              shards=WHOLE_SHARDS),
    "dtrnn": Row("Socher et al.: DT-RNN", ["model.sentence_encoder=dtrnn", *SOCHER],
                 config=WHOLE_CONFIG, shards=WHOLE_SHARDS),
    "sdtrnn": Row("Socher et al.: SDT-RNN", ["model.sentence_encoder=sdtrnn", *SOCHER],
                  paper=(6.0, 22.7, 34.0, 23, 6.6, 21.6, 31.7, 25), config=WHOLE_CONFIG,
                  shards=WHOLE_SHARDS),
    # With hardest negatives, the GRU from random word vectors trailed the one from word2vec's
    # by 7-8 rsum over their first 4 epochs (161.7 against 169.8; runs/q15/gru_rand).
    "gru": Row("VSE++-style GRU (1024-d), tuned", GRU, config=WHOLE_CONFIG,
               shards=WHOLE_SHARDS),
    "gru_random": Row("VSE++-style GRU (1024-d), tuned, random word vectors",
                      [o for o in GRU if not o.startswith("model.word_vectors=")],
                      config=WHOLE_CONFIG, shards=WHOLE_SHARDS),
    # VSE++'s hardest negatives (after 2 epochs, 15 epochs) left this encoder at rsum 192.0:
    # it keeps the summed hinges of the tuned row, from random word vectors.
    "linear_random": Row("Kiros et al.'s linear encoder, tuned, random word vectors",
                         ["model.sentence_encoder=linear",
                          *(o for o in TUNED if not o.startswith("model.word_vectors="))],
                         config=WHOLE_CONFIG, shards=WHOLE_SHARDS),
    "fragments_whole": Row("DeFrag fragments (triplets, eq. 6, C_F + C_G, MIL), whole image",
                           FRAGMENTS, config=WHOLE_CONFIG, shards=WHOLE_SHARDS),
}
ROWS.update({f"{name}_{cnn}": Row(f"{ROWS[name].title}, EfficientNet-{cnn.title()}",
                                   [*ROWS[name].overrides, *overrides], config=WHOLE_CONFIG,
                                   shards=WHOLE_SHARDS)
             for cnn, overrides in CNNS.items() if cnn != "lite2"  # the config's CNN
             for name in ("kiros_lstm_tuned", "kiros_linear_tuned", "linear_random", "gru",
                          "fragments_whole")})
ROWS.update({f"{name}_hflip": Row(f"{ROWS[name].title}, mirrored views",
                                  [*ROWS[name].overrides, *HFLIP], config=WHOLE_CONFIG,
                                  shards=WHOLE_SHARDS)
             for name in ("linear_random_lite0",)})
ROWS.update({f"{name}_flip_{cnn}": Row(f"{ROWS[base].title}, lr 5e-4, mirrored views, "
                                       f"EfficientNet-{cnn.title()}",
                                       [*ROWS[base].overrides, *FLIP, *overrides],
                                       config=WHOLE_CONFIG, shards=WHOLE_SHARDS)
             for cnn, overrides in CNNS.items()
             for name, base in (("linear", "linear_random"),
                                ("linear_tuned", "kiros_linear_tuned"))})
# The two linear encoders, trained at lr 5e-4 on mirrored views, on each of the three CNNs.
THREE_CNN_MEMBERS = [f"{name}_flip_{cnn}" for cnn in CNNS for name in ("linear", "linear_tuned")]
# Those six with phase 2: their 12 epochs end with 4 that finetune the top 2 blocks of their CNN
# on cached trunk maps (Adam: the CNN at a tenth of the lr).
ROWS.update({f"{name}_top2": Row(f"{ROWS[name].title}, the CNN's top 2 blocks finetuned in "
                                 "the last 4 epochs",
                                 [*ROWS[name].overrides, "optim.frozen_cnn_epochs=8",
                                  *finetune_top(2, lr_scale=0.1)],
                                 config=WHOLE_CONFIG, shards=WHOLE_SHARDS)
             for name in THREE_CNN_MEMBERS})
THREE_CNN_TOP2_MEMBERS = [f"{name}_top2" for name in THREE_CNN_MEMBERS]


@dataclass
class Ensemble:
    """Rows' best models scored together (defrag registry ensemble): the mean of the members'
    scores, plus each `fused` row's scores (another score, e.g. eq. 6) with a weight chosen on
    dev, one row after the other."""

    title: str
    members: list[str]
    fused: tuple[str, ...] = ()
    register_name: str | None = None  # default: defrag-flickr8k-<name>


QUALITY_ROWS = ["kiros_lstm_tuned", "kiros_linear_tuned", "gru", "gru_random", "linear_random",
                "fragments_whole",
                *(name for name in ROWS if name.endswith(("_lite0", "_lite1", "_lite2", "_hflip")))]
# Chosen on dev from the rows' saved score matrices (docs/results.md): adding the GRU to these
# three moved the ensemble by -1.7 rsum (-1.5 with the fragments fused).
GLOBAL_MEMBERS = ["kiros_lstm_tuned", "kiros_linear_tuned", "linear_random"]
# The same three on each CNN's vector: the members then disagree where one CNN errs.
TWO_CNN_MEMBERS = [*GLOBAL_MEMBERS, *(f"{name}_lite0" for name in GLOBAL_MEMBERS)]
ENSEMBLES = {
    "ensemble": Ensemble("Ensemble: Kiros LSTM + linear, tuned + linear, random word vectors "
                         "(mean score)", GLOBAL_MEMBERS),
    "ensemble_fragments": Ensemble("Ensemble + DeFrag fragments (eq. 6, weight chosen on dev)",
                                   GLOBAL_MEMBERS, fused=("fragments_whole",)),
    "ensemble_two_cnns": Ensemble("Ensemble on two CNNs: the ensemble's three models on Lite2 "
                                  "and on Lite0 (mean score)", TWO_CNN_MEMBERS),
    # the champion of 2026-11-26 (test rsum 289.2), now defrag-flickr8k-ensemble_two_cnns_fragments
    "ensemble_two_cnns_fragments": Ensemble("Ensemble on two CNNs + DeFrag fragments (Lite0, "
                                            "eq. 6, weight chosen on dev)", TWO_CNN_MEMBERS,
                                            fused=("fragments_whole_lite0",)),
    "ensemble_three_cnns": Ensemble("Ensemble on three CNNs: the two linear encoders (lr 5e-4, "
                                    "mirrored views) on Lite0, Lite1 and Lite2 (mean score)",
                                    THREE_CNN_MEMBERS),
    "ensemble_three_cnns_fragments": Ensemble("Ensemble on three CNNs + DeFrag fragments (Lite0, "
                                              "eq. 6, weight chosen on dev)", THREE_CNN_MEMBERS,
                                              fused=("fragments_whole_lite0",)),
    # whole-image members read the whole-image box of the region model's shards; the champion
    # of 2026-11-27 morning (dev 316.4), now defrag-flickr8k-ensemble_three_cnns_regions
    "ensemble_three_cnns_regions": Ensemble("Ensemble on three CNNs + DeFrag regions (19 boxes + "
                                            "the image, roi at 448 px, eq. 6, weight chosen on "
                                            "dev)", THREE_CNN_MEMBERS, fused=("roi_448",)),
    # the champion of 2026-11-27 (dev 318.1), now
    # defrag-flickr8k-ensemble_three_cnns_regions_long
    "ensemble_three_cnns_regions_long": Ensemble("Ensemble on three CNNs + DeFrag regions (roi "
                                                 "at 448 px, 12 epochs, eq. 6, weight chosen on "
                                                 "dev)", THREE_CNN_MEMBERS,
                                                 fused=("roi_448_long",)),
    "ensemble_three_cnns_top2": Ensemble("Ensemble on three CNNs, each CNN's top 2 blocks "
                                         "finetuned: the two linear encoders on Lite0, Lite1 "
                                         "and Lite2 (mean score)", THREE_CNN_TOP2_MEMBERS),
    # the strongest searchable model of docs/results.md, pushed as
    # models:/defrag-flickr8k@champion
    "ensemble_three_cnns_top2_regions": Ensemble(
        "Ensemble on three CNNs, their top 2 blocks finetuned, + DeFrag regions (the head conv "
        "finetuned; weight chosen on dev)", THREE_CNN_TOP2_MEMBERS, fused=("roi_448_top1",),
        register_name="defrag-flickr8k"),
    # + SCAN: evaluate scores it; search, retrieve and serve refuse it (no certified bound for
    # cross attention)
    "ensemble_three_cnns_top2_regions_scan": Ensemble(
        "Ensemble on three CNNs, their top 2 blocks finetuned, + DeFrag regions (the head conv "
        "finetuned) + SCAN t2i (weights chosen on dev in turn)", THREE_CNN_TOP2_MEMBERS,
        fused=("roi_448_top1", "scan_t2i")),
    "gru_fragments": Ensemble("VSE++-style GRU + DeFrag fragments (eq. 6, weight chosen on "
                              "dev)", ["gru"], fused=("fragments_whole",)),
}
FUSION_WEIGHTS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)  # x std(global) / std(fused) scores
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
    for vectors, dim in WORD_VECTORS.items():
        if any(vectors in item for item in row.overrides) and not (ROOT / vectors).is_file():
            run([str(BIN / "defrag"), "featurize", "wordvecs", "--shards", row.shards,
                 "--out", vectors, "--dim", str(dim)])
    (ROOT / run_dir / PREEMPTED).unlink(missing_ok=True)  # an earlier stop's, resumed now
    train_s = run([str(BIN / "torchrun"), "--nproc_per_node", "1", "-m", "trainer.main",
                   "--config", row.config, "--resume", "latest", f"run.run_dir={run_dir}",
                   *row.overrides, *register_as(name)], ROOT / run_dir / "train.log")
    if (ROOT / run_dir / PREEMPTED).is_file():  # stopped on request, with a checkpoint
        raise SystemExit(f"{name}: the training stopped on request ({run_dir}/train.log); run "
                         "the same command to resume it")
    out = evaluate_on_dev(run_dir / "best", row.shards, run_dir / DEV_SCORES)
    history = [json.loads(line) for line in (ROOT / run_dir / "history.jsonl").open()]
    results[name] = {"title": row.title, "config": row.config, "overrides": row.overrides,
                     "train_wall_s": round(train_s), "dev": json.loads(out.splitlines()[-1]),
                     "epochs": history}
    print(out)


def evaluate_on_dev(model: Path, shards: str, scores: Path) -> str:
    """`defrag evaluate` of a model (or ensemble) folder on dev: its output, the last line JSON;
    the score matrix saved to `scores`."""
    evaluate = [str(BIN / "defrag"), "evaluate", "--model", str(model),
                "--shards", shards, "--split", "dev", "--save-scores", str(scores)]
    return subprocess.run(evaluate, check=True, cwd=ROOT, capture_output=True, text=True).stdout


def dev_scores(name: str) -> dict[str, torch.Tensor]:
    """A trained row's dev score matrix and sentence rows (evaluated again if not saved)."""
    path = ROOT / RUNS / name / DEV_SCORES
    if not path.is_file():
        evaluate_on_dev(RUNS / name / "best", ROWS[name].shards, path)
    return load_file(path)


def mean_scores(members: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The members' mean dev score matrix (an ensemble of weight 1 each)."""
    return sum(m["scores"] for m in members) / len(members)


def score_on_dev(ensemble: Ensemble) -> dict:
    """An ensemble's dev figures from its rows' saved score matrices, without building it (with
    fused rows: their weights chosen on dev, and the rsum of each candidate weight)."""
    if ensemble.fused:
        weights, rsums, metrics = fusion_weights(ensemble)
        return {**metrics, "fused_weights": weights, "fusion_rsum": rsums}
    members = [dev_scores(name) for name in ensemble.members]
    return retrieval_metrics(mean_scores(members), members[0]["sentence_image"])


def fusion_weights(ensemble: Ensemble) -> tuple[list[float], dict[str, dict[str, float]],
                                                dict[str, float]]:
    """Each fused row's weight, in turn, that maximises dev rsum (FUSION_WEIGHTS, in units of the
    scores so far's spread over the fused row's), the rsum of each candidate per row, the
    metrics of the whole; the weights are beside members of weight 1 each (0: no help)."""
    members = [dev_scores(name) for name in ensemble.members]
    sentence_image = members[0]["sentence_image"]
    scores = mean_scores(members)
    weights, rsums = [], {}
    for row in ensemble.fused:
        fused = dev_scores(row)["scores"]
        scale = float(scores.std() / fused.std())
        rsums[row] = {f"{w:g}": retrieval_metrics(scores + w * scale * fused,
                                                  sentence_image)["rsum"]
                      for w in FUSION_WEIGHTS}
        best = max(FUSION_WEIGHTS, key=lambda w: rsums[row][f"{w:g}"])
        scores = scores + best * scale * fused
        weights.append(best * scale * len(members))
    return weights, rsums, retrieval_metrics(scores, sentence_image)


def build_ensemble(name: str, ensemble: Ensemble, results: dict) -> None:
    """Score the members' best models together: the ensemble folder (registered), its dev
    figures; with fused rows, their weights are chosen on dev first."""
    rows = [*ensemble.members, *ensemble.fused]
    missing = [row for row in rows if row not in results]
    if missing:
        raise SystemExit(f"ensemble {name}: run the rows {missing} first")
    folder = RUNS / name / "model"
    if name in results and (ROOT / folder).is_dir():
        print(f"{name}: done already ({folder}); delete it to run again")
        return
    weights = [1.0] * len(ensemble.members)
    entry = {"title": ensemble.title, "members": rows,
             "train_wall_s": sum(results[row]["train_wall_s"] for row in rows)}
    if ensemble.fused:
        fused_weights, entry["fusion_rsum"], metrics = fusion_weights(ensemble)
        if not any(fused_weights):  # the fused rows add nothing on dev: no model to build
            print(f"{name}: the fused rows do not help on dev: {entry['fusion_rsum']}")
            results[name] = {**entry, "weights": [*weights, *fused_weights], "dev": metrics}
            return
        # a fused row of weight 0 stays out of the folder
        kept = [(row, w) for row, w in zip(ensemble.fused, fused_weights, strict=True) if w]
        rows = entry["members"] = [*ensemble.members, *(row for row, _ in kept)]
        weights += [w for _, w in kept]
    total = sum(weights)
    weights = [w / total for w in weights]
    register_name = ensemble.register_name or f"defrag-flickr8k-{name}"
    run([str(BIN / "defrag"), "registry", "ensemble",
         *(str(RUNS / row / "best") for row in rows), "--weights", *map(str, weights),
         "--out", str(folder), "--name", register_name, "--tracking-uri",
         f"sqlite:///{RUNS / name / 'mlflow.db'}"])
    # whole-image members read only the whole-image box of region shards (defrag evaluate)
    shards = next((ROWS[row].shards for row in rows if ROWS[row].shards != WHOLE_SHARDS),
                  WHOLE_SHARDS)
    out = evaluate_on_dev(folder, shards, RUNS / name / DEV_SCORES)
    results[name] = {**entry, "weights": weights, "registered": f"models:/{register_name}"
                     "@champion", "dev": json.loads(out.splitlines()[-1])}
    print(out)


def table(results: dict, config: str = CONFIG) -> str:
    """Markdown: our dev figures beside the paper's Flickr8K test figures, for the rows of
    `config` (Table 2's, or the comparison systems')."""
    head = ("| Model | image annotation R@1 / R@5 / R@10, med r | image search R@1 / R@5 / "
            "R@10, med r | paper (test): annotation | paper (test): search | train wall |\n"
            "|---|---|---|---|---|---|\n")
    lines = []
    for name, row in ROWS.items():
        if name not in results or row.config != config:
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
    parser.add_argument("rows", nargs="*", help=f"rows and ensembles to run (default: all): "
                        f"{', '.join([*ROWS, *ENSEMBLES])}")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument("--score", nargs="+", metavar="ROW",
                        help="print the dev figures of these trained rows' mean score, from their "
                             "saved matrices (nothing is trained, built or registered)")
    parser.add_argument("--fused", nargs="+", default=(), metavar="ROW",
                        help="with --score: fuse these rows' scores, each weight chosen on dev "
                             "in turn")
    args = parser.parse_args()
    if args.score:
        os.chdir(ROOT)
        print(json.dumps(score_on_dev(Ensemble("--score", args.score, tuple(args.fused)))))
        return
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:10} {' '.join(row.overrides)}")
        for name, ensemble in ENSEMBLES.items():
            print(f"{name:10} ensemble of {' '.join(ensemble.members)}"
                  + (f" + {' + '.join(ensemble.fused)} (weights chosen on dev)"
                     if ensemble.fused else ""))
        return
    unknown = set(args.rows) - set(ROWS) - set(ENSEMBLES)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join([*ROWS, *ENSEMBLES])}")
    os.chdir(ROOT)
    results_file = RUNS / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    # an ensemble's member rows run (or are found done) before it
    names = list(dict.fromkeys(
        item for name in args.rows or [*ROWS, *ENSEMBLES]
        for item in ([*ENSEMBLES[name].members, *ENSEMBLES[name].fused, name]
                     if name in ENSEMBLES else [name])))
    for shards in dict.fromkeys(ROWS[name].shards for name in names if name in ROWS):
        key, command = FEATURIZE[shards]
        if not (Path(shards) / "manifest.json").is_file() or key not in results:
            results[key] = round(run(command))
    for name in names:
        if name in ROWS:
            train_and_evaluate(name, ROWS[name], results)
        else:
            build_ensemble(name, ENSEMBLES[name], results)
        # Re-read before writing: another instance may be running other rows at the same time.
        merged = json.loads(results_file.read_text()) if results_file.is_file() else {}
        results = {**merged, **{k: v for k, v in results.items() if k == name or k not in merged}}
        results_file.write_text(json.dumps(results, indent=1))
        (RUNS / "results.md").write_text(tables(results))
    print(tables(results))


def quality_table(results: dict) -> str:
    """Markdown: the Flickr8k quality rows and ensembles on dev, with their training time."""
    head = ("| Model | image annotation R@1 / R@5 / R@10, med r | image search R@1 / R@5 / "
            "R@10, med r | rsum | train wall |\n|---|---|---|---|---|\n")
    lines = []
    for name in [*QUALITY_ROWS, *ENSEMBLES]:
        if name not in results:
            continue
        dev = results[name]["dev"]
        ours = [f"{dev[k]:.1f}" if "medr" not in k else f"{dev[k]:.0f}" for k in METRICS]
        minutes = results[name]["train_wall_s"] / 60
        title = results[name]["title"]
        lines.append(f"| {title} | {' / '.join(ours[:3])}, {ours[3]} | "
                     f"{' / '.join(ours[4:7])}, {ours[7]} | {dev['rsum']:.1f} | "
                     f"{minutes:.0f} min |")
    return head + "\n".join(lines) + "\n"


def tables(results: dict) -> str:
    """results.md: the Table 2 rows, the comparison systems' rows, the quality rows."""
    return (f"## Table 2\n\n{table(results)}\n"
            f"## The comparison systems\n\n{table(results, WHOLE_CONFIG)}\n"
            f"## Flickr8k quality\n\n{quality_table(results)}")


if __name__ == "__main__":
    main()
