"""Prints pyproject.toml's dependencies, one a line: the image's dependency layer
(docker/Dockerfile) and docker/check.sh's wheelhouse install the same list."""

import sys
import tomllib

with open(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml", "rb") as file:
    print("\n".join(tomllib.load(file)["project"]["dependencies"]))
