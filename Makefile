# One entry point for set-up, tests and the demo. The virtualenv lives in .venv and is
# (re)built whenever pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast lint demo bench clean docker-check cluster-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# One thread per process: many tests run 2 or 3 training processes at once, which on 2 cores
# only contend with more (their multi-process tests take a third less time).
TEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

test: $(STAMP)
	$(BIN)/ruff check .
	$(TEST) -m "not cluster" tests

test-fast: $(STAMP)
	$(TEST) -m "not slow" tests

# The embedded default: synthetic scenes -> shards -> 2-process torchrun training -> evaluation
# -> a search index of the val images, which the last line says how to serve.
DEMO := runs/demo
demo: $(STAMP)
	$(BIN)/defrag featurize synthetic --out $(DEMO)/data --shard-size 100
	$(BIN)/torchrun --nproc_per_node 2 -m trainer.main --config launch/configs/demo.yaml
	$(BIN)/defrag evaluate --model $(DEMO)/run/best --shards $(DEMO)/data --split val
	$(BIN)/defrag index --model $(DEMO)/run/best --shards $(DEMO)/data --split val \
	    --out $(DEMO)/index
	@echo "MLflow UI: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(DEMO)/run/mlflow.db" \
	     "--default-artifact-root $(DEMO)/run/mlartifacts, then open http://127.0.0.1:5000"
	@echo "Search the demo collection in the browser: $(BIN)/defrag serve" \
	     "--index $(DEMO)/index, then open http://127.0.0.1:8000"

# docker/Dockerfile built for real (its CPU variant, on a Debian base made with debootstrap) and
# the demo run in the image; root, podman, runc and debootstrap (docker/README.md).
docker-check: $(STAMP)
	bash docker/check.sh

# launch/slurm/train.sbatch across two SLURM nodes made of Linux namespaces on this machine,
# set up and removed by the tests (tests/cluster.py; root, iproute2, SLURM and munge).
cluster-check: $(STAMP)
	DEFRAG_REQUIRE_CLUSTER=1 $(TEST) -m cluster tests

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
