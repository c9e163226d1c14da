#!/usr/bin/env bash
# The GPU checks in one prepared command for a lent GPU machine (8 minutes of it,
# its set-up included), from the repository root:
#
#   COMMIT=<the commit> bash benchmarks/cuda_check.sh OUT_DIR
#
# It needs .whl/ and .devdata/ (made here by benchmarks/device_prepare.sh and carried), and runs
# in this order, each part under `timeout` within what is left of $BUDGET seconds (default 470)
# since the start, every part even if an earlier one failed:
#   setup  installs the carried wheels (pip --target /tmp/site) and the project (pip -e, offline);
#   tests  tests/test_cuda.py: NCCL gather, pinned-memory prefetch, CUDA step == CPU step (DDP
#          and DeepSpeed), bf16 step against float32, nvJPEG decoding;
#   cnn    bench_cnn_batch.py: first and second pass per batch size, padded and not;
#   train  bench_train.py at the paper's batch: 100 pairs, roi, EfficientNet-Lite0 at 224 px,
#          bf16, channels-last: finetuning images/s and the step over the bare CNN pass;
#   feed   bench_feed.py: images/s per loader core with `loader` and `device` decoding of 500x375
#          JPEGs, the cores one GPU needs for each, and the step fed by 4 loader processes;
#   e2e    last, only with 120 s left (E2E=0 skips it): `torchrun -m trainer.main` on NCCL with
#          bf16, streaming the shards from a web server on 127.0.0.1, then `trainer.evaluate` on
#          the GPU from the same URL.
# Writes OUT_DIR/gpu_check.json (benchmarks/gpu_figures.py: machine, versions, commit, each
# part's status and seconds, the figures, the targets as {value, target, met}) and
# OUT_DIR/gpu_check.log (this output). Exits 1 if a part failed, timed out or is missing.
#
# --dry-run OUT_DIR rehearses it on a CPU machine: tiny sizes, --device cpu (tests/test_cuda.py
# skips), the wheels' install only checked for Python 3.12 (not used), the project's
# .venv/bin/python unless $PYTHON names another; the JSON says dry_run and each part "dry".
set -uo pipefail
dry=0
if [[ ${1:-} == --dry-run ]]; then
    dry=1
    shift
fi
if [[ $# -ne 1 ]]; then
    echo "usage: bash benchmarks/cuda_check.sh [--dry-run] OUT_DIR" >&2
    exit 2
fi
out=$1
python=${PYTHON:-python3}
if ((dry)) && [[ -z ${PYTHON:-} && -x .venv/bin/python ]]; then
    python=.venv/bin/python
fi
for needed in .devdata/tests .devdata/bench .devdata/feed benchmarks/gpu_figures.py; do
    if [[ ! -e $needed ]]; then
        echo "cuda_check: $needed is missing: run from the repository root, after" \
            "bash benchmarks/device_prepare.sh, carrying .devdata and .whl" >&2
        exit 2
    fi
done
mkdir -p "$out"
work=$(mktemp -d)
budget=${BUDGET:-470}
status=0
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} dry python work

# record PART STATUS SECONDS RC: one line of parts.jsonl (read by gpu_figures.py).
record() {
    printf '{"part": "%s", "status": "%s", "seconds": %s, "rc": %s}\n' "$@" >>"$work/parts.jsonl"
    echo "-- $1: $2 in $3 s"
    [[ $2 == passed || $2 == skipped ]] || status=1
}

# part NAME CAP COMMAND...: COMMAND under `timeout` for CAP seconds, or what is left of the
# budget if less (skipped under 20 s). A function runs in `bash -c` (exported below).
part() {
    local name=$1 cap=$2
    shift 2
    local left=$((budget - SECONDS))
    local limit=$((cap < left ? cap : left))
    echo "== $name (at most $limit s; $SECONDS s since the start)"
    if ((limit < 20)); then
        record "$name" skipped 0 0
        return
    fi
    local started=$SECONDS
    if declare -F "$1" >/dev/null; then
        timeout -k 10 "$limit" bash -c '"$@"' "$1" "$@"
    else
        timeout -k 10 "$limit" "$@"
    fi
    local rc=$?
    local outcome=failed
    ((rc == 0)) && outcome=passed
    ((rc == 124 || rc == 137)) && outcome=timeout
    record "$name" "$outcome" $((SECONDS - started)) "$rc"
}

setup() {
    if ((dry)); then  # cp312 wheels: checked for the GPU machine's Python, not used here
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --only-binary=:all: --python-version 3.12 --target "$work/site312" .whl/*.whl
        return
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return
    # The project's metadata (MLflow registration reads it) and the `defrag` command; offline.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
}

# e2e DEVICE BF16 WORKERS EPOCHS FROZEN SHARDS: train over HTTP with torchrun, then evaluate.
e2e() {
    local port=8765 run=$work/run
    "$python" -m http.server $port --bind 127.0.0.1 --directory "$6" >"$work/http.log" 2>&1 &
    local server=$!
    sleep 1
    MLFLOW_TRACKING_URI="file://$work/mlruns" MLFLOW_ALLOW_FILE_STORE=true \
        "$python" -m torch.distributed.run --nproc_per_node 1 -m trainer.main \
        --config launch/configs/demo.yaml data.shards=http://127.0.0.1:$port run.run_dir="$run" \
        run.device="$1" run.bf16="$2" data.workers="$3" optim.epochs="$4" \
        optim.frozen_cnn_epochs="$5" >"$work/e2e_train.log" 2>&1
    local rc=$?
    tr '\r' '\n' <"$work/e2e_train.log" | grep -v "it/s]\|s/it]" | tail -5
    if ((rc == 0)); then
        "$python" -m trainer.evaluate --model "$run/best" --shards http://127.0.0.1:$port \
            --split val --device "$1" >"$work/e2e_eval.log" 2>&1
        rc=$?
        tail -3 "$work/e2e_eval.log"
    fi
    echo "shards fetched: $(grep -c 'GET /train/' "$work/http.log") train," \
        "$(grep -c 'GET /val/' "$work/http.log") val"
    kill $server
    return $rc
}
export -f setup e2e

checks() {
    if [[ -d .whl ]]; then
        part setup 90 setup
    else
        echo "== setup: no .whl folder, the machine's own packages only"
        record setup skipped 0 0
    fi
    if ((!dry)) && [[ -d /tmp/site ]]; then
        export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
    "$python" benchmarks/gpu_figures.py environment "$work"

    local device=cuda bf16=(--bf16) cnn=() train=(--batch 100 --image-size 224 --steps 10)
    local feed=(--shards .devdata/feed --workers 4 --batch 100 --image-size 224)
    local e2e_args=(cuda true 4 4 2 .devdata/bench)
    if ((dry)); then
        device=cpu bf16=() cnn=(--sizes 3 4 17 18 --image-size 64)
        train=(--batch 10 --image-size 64 --steps 2)
        feed=(--shards .devdata/tests --workers 1 --batch 10 --image-size 64 --steps 2
              --repeats 1)
        e2e_args=(cpu false 1 2 1 .devdata/tests)
    fi

    DEFRAG_TEST_SHARDS=.devdata/tests part tests 120 "$python" -m pytest -q \
        -p no:cacheprovider --junitxml="$work/tests.xml" tests/test_cuda.py
    part cnn 90 "$python" benchmarks/bench_cnn_batch.py --device $device "${cnn[@]}" \
        --json "$work/cnn.json"
    part train 120 "$python" benchmarks/bench_train.py --shards .devdata/bench \
        --device $device --processes 1 "${bf16[@]}" "${train[@]}" --json "$work/train.json"
    if [[ -f benchmarks/bench_feed.py ]]; then
        part feed 150 "$python" benchmarks/bench_feed.py --device $device "${bf16[@]}" \
            "${feed[@]}" --json "$work/feed.json"
    else
        echo "== feed: benchmarks/bench_feed.py is missing"
        record feed missing 0 0
    fi
    if [[ ${E2E:-1} == 0 ]] || ((budget - SECONDS < 120)); then
        echo "== e2e: skipped ($((budget - SECONDS)) s left of $budget; E2E=${E2E:-1})"
        record e2e skipped 0 0
    else
        part e2e 300 e2e "${e2e_args[@]}"
    fi

    local dry_flag=()
    ((dry)) && dry_flag=(--dry-run)
    "$python" benchmarks/gpu_figures.py assemble "$work" "$out/gpu_check.json" \
        "${dry_flag[@]}" || status=1
    echo "cuda_check: $SECONDS s in all"
    return $status
}

checks 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
