#!/usr/bin/env bash
# The GPU checks (benchmarks/README.md, "GPU checks"), in one command for a GPU machine:
#   1. tests/test_cuda.py: NCCL gather, pinned-memory prefetch, CUDA step == CPU step (DDP and
#      DeepSpeed), bf16 autocast;
#   2. an end-to-end `torchrun -m trainer.main` on NCCL with bf16, streaming the shards from a
#      web server on 127.0.0.1, then trainer.evaluate on the GPU from the same URL;
#   3. benchmarks/bench_train.py on the GPU, float32 and bf16;
#   4. benchmarks/bench_cnn_batch.py: a new CNN batch size's first pass, padded and not.
# Usage: bash benchmarks/cuda_check.sh TEST_SHARDS BENCH_SHARDS [LOGS]
#   TEST_SHARDS: `defrag featurize synthetic --num-train 40 --num-val 10 --shard-size 5`;
#   BENCH_SHARDS: `defrag featurize synthetic --num-train 200 --num-val 20 --shard-size 50`.
set -euo pipefail
test_shards=$1 bench_shards=$2 out=${3:-/tmp/cuda-check}
work=$(mktemp -d)  # the run and its MLflow store
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
torch.cuda.nccl.version())"

echo "== 1. tests/test_cuda.py"
status=0  # every part runs; the script fails at the end if one did
DEFRAG_TEST_SHARDS=$test_shards python -m pytest -q -p no:cacheprovider tests/test_cuda.py || status=1

echo "== 2. torchrun on NCCL + bf16, shards over HTTP"
python -m http.server 8765 --bind 127.0.0.1 --directory "$bench_shards" >"$out/http.log" 2>&1 &
server=$!
trap 'kill $server' EXIT
sleep 1
export MLFLOW_TRACKING_URI="file://$work/mlruns" MLFLOW_ALLOW_FILE_STORE=true
torchrun --nproc_per_node 1 -m trainer.main --config launch/configs/demo.yaml \
    data.shards=http://127.0.0.1:8765 run.run_dir="$work/run" run.device=cuda run.bf16=true \
    data.workers=4 optim.epochs=4 optim.frozen_cnn_epochs=2 2>&1 \
    | tr '\r' '\n' | grep -v "it/s]\|s/it]" | tee "$out/train.log" | tail -5 || status=1
defrag evaluate --model "$work/run/best" --shards http://127.0.0.1:8765 --split val \
    --device cuda 2>&1 | tail -2 || status=1
echo "shards fetched: $(grep -c 'GET /train/' "$out/http.log") train, \
$(grep -c 'GET /val/' "$out/http.log") val"

echo "== 3. bench_train on the GPU"
for precision in "" "--bf16"; do
    python benchmarks/bench_train.py --shards "$bench_shards" --device cuda --processes 1 \
        --steps 10 $precision 2>&1 | tail -2 | head -1 || status=1
done

echo "== 4. bench_cnn_batch on the GPU"
python benchmarks/bench_cnn_batch.py --device cuda 2>&1 | tail -3 | head -2 || status=1
exit $status
