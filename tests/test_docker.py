"""docker/: the files agree with each other and with the repository (no Docker engine needed):
compose structure, COPY sources, the packages the code imports, the documented default command,
the torch and mlflow pins. docker/check.sh (`make docker-check`) builds and runs the image."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"


def instructions(name: str) -> list[str]:
    """The arguments of every `name` instruction of the Dockerfile (continuations joined)."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in text.splitlines()
            if line.split(None, 1)[:1] == [name]]


def copied_sources() -> list[str]:
    """The source paths of every COPY instruction."""
    return [source for copy in instructions("COPY")
            for source in [arg for arg in shlex.split(copy) if not arg.startswith("--")][:-1]]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def imported_packages(package: str, packages: set[str]) -> set[str]:
    """Which of the repository's `packages` the modules of `package` import, anywhere in them."""
    found = set()
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found & packages


def pin(package: str) -> str:
    """The version pyproject.toml pins `package` to."""
    found = re.search(rf'"{re.escape(package)}==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert found, f"pyproject.toml does not pin {package}"
    return found[1]


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_has_mlflow_and_the_trainer() -> None:
    spec = compose()
    assert set(spec["services"]) == {"mlflow", "trainer"}
    assert set(spec["volumes"]) == {"mlflow", "runs"}
    mlflow, trainer = spec["services"]["mlflow"], spec["services"]["trainer"]

    command = shlex.split(mlflow["command"])
    assert command[:2] == ["mlflow", "server"] and "--serve-artifacts" in command
    assert "mlflow:/mlflow" in mlflow["volumes"]
    store = command[command.index("--backend-store-uri") + 1]
    artifacts = command[command.index("--artifacts-destination") + 1]
    assert store.startswith("sqlite:////mlflow/") and artifacts.startswith("/mlflow/")
    assert "mlflow:5000" in command[command.index("--allowed-hosts") + 1].split(",")

    assert trainer["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert (DOCKER / trainer["build"]["context"] / trainer["build"]["dockerfile"]).is_file()
    assert trainer["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert trainer["depends_on"]["mlflow"]["condition"] == "service_healthy"
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    targets = {volume.removesuffix(":ro").rsplit(":", 1)[1]: volume
               for volume in trainer["volumes"]}
    assert targets["/data/shards"].endswith(":ro") and targets["/runs"] == "runs:/runs"


def test_mlflow_image_matches_the_pin() -> None:
    image = compose()["services"]["mlflow"]["image"]
    assert image == f"ghcr.io/mlflow/mlflow:v{pin('mlflow')}"


def test_base_image_matches_the_torch_pin() -> None:
    (image,), (arg,) = instructions("FROM"), instructions("ARG")
    name, base = arg.split("=", 1)
    assert name == "BASE_IMAGE" and image == "${BASE_IMAGE}"
    assert re.fullmatch(rf"pytorch/pytorch:{re.escape(pin('torch'))}-cuda[\d.]+-cudnn\d+-"
                        r"(runtime|devel)", base), base


def test_every_copied_path_exists_and_reaches_the_build() -> None:
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = copied_sources()
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        top = Path(source).parts[0]
        assert not any(fnmatch.fnmatch(top, pattern) for pattern in ignored), (
            f"COPY {source}: excluded by .dockerignore")


def test_every_package_the_code_imports_is_copied_and_installed() -> None:
    """From the image's entry points (its CMD's module, the console scripts), every package of
    the repository they import, directly or through another, is COPYed and packaged."""
    packages = {path.name for path in REPO.iterdir() if (path / "__init__.py").is_file()}
    command = json.loads(instructions("CMD")[0])
    entry_points = [command[command.index("-m") + 1],
                    *pyproject()["project"]["scripts"].values()]
    needed, todo = set(), [entry.split(".")[0] for entry in entry_points]
    while todo:
        package = todo.pop()
        if package not in needed:
            needed.add(package)
            todo.extend(imported_packages(package, packages))
    assert needed >= {"defrag", "trainer", "featurizer"}
    copied = {Path(source).parts[0] for source in copied_sources()}
    assert not needed - copied, f"imported but not COPYed: {sorted(needed - copied)}"
    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(any(fnmatch.fnmatch(package, pattern) for pattern in include)
               for package in needed), f"{sorted(needed)} not all in {include}"


def test_default_command_is_the_documented_one() -> None:
    (entrypoint,), (cmd,) = instructions("ENTRYPOINT"), instructions("CMD")
    image_command = json.loads(entrypoint) + json.loads(cmd)
    readme = (DOCKER / "README.md").read_text()
    section = readme.split("## Default command", 1)[1]
    documented = re.search(r"```\n(.*?)\n```", section, re.S)[1]
    assert shlex.split(documented) == image_command
    assert image_command[0] == "torchrun" and "trainer.main" in image_command
    config = image_command[image_command.index("--config") + 1]
    assert (REPO / config).is_file()
