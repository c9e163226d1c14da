"""`defrag COMMAND ...`: the one command line for everything users run besides training.

    defrag featurize synthetic --out data/synthetic
    defrag evaluate --model runs/x/best --shards data/synthetic --split val
    defrag index --model runs/x/best --shards data/synthetic --split val --out index/
    defrag retrieve --model runs/x/best --index index/ --query "a dog runs"
    defrag serve --index index/
    defrag registry download models:/defrag@champion --dst models/champion

Training is `torchrun ... -m trainer.main --config FILE` (and `-m trainer.caption.train` for the
captioner): torchrun starts the workers itself. Each command reports an error in one line and
takes `--debug` for the traceback (defrag.cli).
"""

from __future__ import annotations

import importlib
import sys

# name -> (the module whose main(argv) runs it, what it does). A command's module is imported only
# when it runs, so `defrag --help` and a command that needs no torch start at once.
COMMANDS = {
    "featurize": ("featurizer.command", "captioned images -> WebDataset shards and manifest"),
    "evaluate": ("trainer.evaluate", "R@K, median and mean rank of a model folder on a split"),
    "registry": ("trainer.store.registry", "download, verify, register models; build ensembles"),
    "tracking": ("trainer.store.tracking", "send what a run spooled while MLflow was away"),
    "index": ("trainer.search.index_builder",
              "build a search index of a split or a folder of images"),
    "retrieve": ("trainer.search.retrieve", "search images by sentences, sentences by images"),
    "serve": ("trainer.search.serve", "the search web app over one index"),
    "caption": ("trainer.caption.describe", "describe images in words with a trained captioner"),
    "caption-eval": ("trainer.caption.evaluate", "BLEU, CIDEr, METEOR of a captioner on a split"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
    return (f"usage: defrag COMMAND [-h] ...\n\ncommands:\n{rows}\n\n"
            "`defrag COMMAND -h` lists a command's options.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return
    if not argv:
        print(usage(), file=sys.stderr)
        sys.exit(2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.exit(f"defrag: error: no command {name!r}; the commands: {', '.join(COMMANDS)}")
    sys.exit(importlib.import_module(COMMANDS[name][0]).main(rest))

