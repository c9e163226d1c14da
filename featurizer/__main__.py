"""`python -m featurizer`: the design card's name for `defrag featurize` (featurizer/command.py)."""

import sys

from featurizer.command import main

if __name__ == "__main__":
    sys.exit(main())
