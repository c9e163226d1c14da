"""Kiros et al.'s multimodal vector arithmetic (trainer/search/arithmetic.py) on a really trained
model: a linear-encoder model learns generated scenes, then for every val image, every colour c it
shows and every colour c' it does not, the query image - "c" + "c'" ranks the val images, and the
images with colour c' fill its top 10 far above chance.

The model is trained by the project's own Trainer (`Trainer.fit`: loader, frozen-CNN feature
cache, loss, validation, best model folder), in this process, on one rank and one thread: what
`trainer.main` runs, without its MLflow tracking and registration. The same measurement at a
larger size (docs/retrieval.md): `python -m tests.test_arithmetic --num-train 1000 --num-val 300`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import trainer.search.retrieve as retrieve
from featurizer.pipeline import Settings, featurize
from featurizer.sources import read_jsonl
from featurizer.synthetic import COLOURS, generate
from tests.small_training import train_small
from trainer.search.arithmetic import arithmetic_scores, term_vectors
from trainer.search.embedder import Embedder, embed_images
from trainer.search.fragment_set import top_k
from trainer.store.model_folder import ModelFolder

pytestmark = pytest.mark.slow
TOP = 10  # the images of each query that are checked for the added colour


def scenes(root: Path, num_train: int, num_val: int) -> tuple[Path, Path, dict[str, set[str]]]:
    """Generated scenes (64 px) featurized with whole-image boxes (new images have no other
    ones): the shards, a folder of the val images, and each val image's colours (those its
    captions name)."""
    jsonl = generate(root / "source", num_train, num_val, seed=0, image_size=64)
    featurize(read_jsonl(jsonl, jsonl.parent, "train"),
              Settings(out=root / "shards", parser="spacy", boxes="fullframe", shard_size=50,
                       workers=1))
    images = root / "images"
    images.mkdir()
    colours = {}
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "val":
            path = jsonl.parent / record["image"]
            shutil.copy2(path, images / path.name)
            words = {w.strip(".,").lower() for c in record["captions"] for w in c.split()}
            colours[path.name] = words & set(COLOURS)
    return root / "shards", images, colours


def train_linear(shards: Path, run_dir: Path, epochs: int) -> Path:
    """A linear-encoder model trained with Kiros et al.'s objective (cosine scores, C_G alone)
    with VSE++'s hardest negatives (they ground the colour words better in runs this small),
    the CNN fixed; its best model folder."""
    return train_small(shards, run_dir, epochs, lr=0.05, model={"sentence_encoder": "linear"},
                       objective={"use_fragment": False, "score": "cosine", "margin": 0.2,
                                  "hardest_negative": True})


def colour_swaps(model_dir: Path, images: Path, colours: dict[str, set[str]]) -> dict:
    """For every image naming two colours or more, every colour c of it and every colour c' it
    lacks: among the top TOP images of `image - c + c'`, the share whose captions name c'
    (`added`), name c (`removed`) and name the image's other colours (`kept`, per colour), each
    against chance (the share of all images naming those colours) and against the image alone
    (its TOP nearest other images, no arithmetic); and how often the query image itself is
    among the TOP."""
    embedder = Embedder.from_folder(ModelFolder.open(model_dir))
    embedded, _ = embed_images(sorted(images.iterdir()), embedder, skip_bad=False)
    word = {c: term_vectors([c], "--plus", embedder) for c in COLOURS}
    nothing = torch.zeros(0, embedder.cfg.model.embed_dim)
    share = {c: sum(c in named for named in colours.values()) / len(colours) for c in COLOURS}

    def naming(top: list[int], wanted: set[str]) -> float:
        """The share of (image of `top`, colour of `wanted`) pairs the image's captions name."""
        return sum(c in colours[embedded.items[i]] for i in top for c in wanted) / (
            len(top) * len(wanted))

    totals: Counter[str] = Counter()
    for k, name in enumerate(embedded.items):
        if len(colours[name]) < 2:
            continue
        query = embedded.select([k])
        alone = [i for i, _ in top_k(arithmetic_scores(embedded, query, nothing, nothing),
                                     TOP + 1) if i != k][:TOP]
        for c in colours[name]:
            for added in set(COLOURS) - colours[name]:
                top = [i for i, _ in top_k(arithmetic_scores(embedded, query, word[c],
                                                             word[added]), TOP)]
                totals.update({"queries": 1, "query_image_in_top": k in top})
                for what, wanted in (("added", {added}), ("removed", {c}),
                                     ("kept", colours[name] - {c})):
                    totals.update({what: naming(top, wanted),
                                   f"{what}_alone": naming(alone, wanted),
                                   f"{what}_chance": sum(share[w] for w in wanted) / len(wanted)})
    queries = totals.pop("queries")
    return {"queries": queries, "images": len(embedded.items), "top": TOP,
            **{key: round(value / queries, 4) for key, value in sorted(totals.items())}}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread: the matrices are tiny, more threads only contend (2-core CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Path, Path, dict[str, set[str]]]]:
    root = tmp_path_factory.mktemp("arithmetic")
    with one_thread():
        shards, images, colours = scenes(root, num_train=300, num_val=150)
        yield train_linear(shards, root / "run", epochs=12), images, colours


def test_added_colour_fills_the_top_images(trained) -> None:
    model_dir, images, colours = trained
    measured = colour_swaps(model_dir, images, colours)
    assert measured["queries"] > 1500, measured
    assert measured["added"] > 1.5 * measured["added_chance"], measured
    assert measured["added"] > measured["added_alone"] + 0.2, measured
    assert measured["removed"] < 0.7 * measured["removed_chance"], measured


def test_the_command_reports_the_expression_and_the_query_image(trained, capsys) -> None:
    model_dir, images, colours = trained
    name = next(n for n in sorted(colours) if "red" in colours[n] and "blue" not in colours[n])
    retrieve.main(["--model", str(model_dir), "--images", str(images), "--query-image",
                   str(images / name), "--minus", "red", "--plus", "blue", "--top-k", "10",
                   "--json"])
    query = json.loads(capsys.readouterr().out)["queries"][0]
    assert query["kind"] == "arithmetic"
    assert query["query"] == f"{images / name} - 'red' + 'blue'"
    assert (query["minus"], query["plus"]) == (["red"], ["blue"])
    own, top = query["query_image_rank"], [r["image"] for r in query["results"]]
    assert (own > 10 and name not in top) or top[own - 1] == name  # ranked, reported
    assert len(query["results"]) == 10 and query["boxes"] == 1


def main() -> None:
    """The measurement at a chosen size: prints its figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tests.test_arithmetic")
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-val", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("runs/arithmetic"),
                        help="a new folder for the scenes, shards and run")
    args = parser.parse_args()
    args.out.mkdir(parents=True)
    started = time.perf_counter()
    with one_thread():
        shards, images, colours = scenes(args.out, args.num_train, args.num_val)
        measured = colour_swaps(train_linear(shards, args.out / "run", args.epochs), images,
                                colours)
    print(json.dumps({**vars(args), "out": str(args.out), **measured,
                      "seconds": round(time.perf_counter() - started)}))


if __name__ == "__main__":
    main()
