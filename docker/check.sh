#!/usr/bin/env bash
# `make docker-check`: builds docker/Dockerfile for real where neither Docker Hub nor a GPU can be
# reached (the CPU variant: BASE_IMAGE = a Debian base made with debootstrap, the pinned wheels
# from a wheelhouse that this machine's pip fills), then runs the demo in the image: `defrag -h`,
# featurize, a one-epoch 2-process training and `defrag evaluate`. Needs root, podman and
# debootstrap (Debian's packages); see docker/README.md "Check the image".
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"

CACHE=${DEFRAG_DOCKER_CACHE:-$HOME/.cache/defrag-docker}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-.venv/bin/python}
BASE=localhost/defrag-base:$SUITE
IMAGE=localhost/defrag-trainer:cpu-check
VENV_PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# runc, not crun: crun refuses a cgroup v1 machine whose cgroup2 mount has a controller (hybrid
# mode, as here). Limits low enough to set without CAP_SYS_RESOURCE: podman's defaults (nofile
# 1048576, nproc 4194304) fail where root lacks it, as here.
PODMAN=(podman --runtime runc)
LIMITS=(--ulimit nofile=8192:8192 --ulimit nproc=4096:4096)

# What the check made and removes at its end, whatever the outcome (--one-file-system: never
# into something mounted inside).
TEMPS=()
trap 'rm -rf --one-file-system "${TEMPS[@]}"' EXIT

die() { echo "docker-check: $*" >&2; exit 1; }
step() { echo "docker-check: [${SECONDS}s] $*"; }

# The Debian base: minbase with python3 and a venv at /opt/venv first on PATH (pip installs
# there; Debian's own python refuses `pip install`). Built once, then kept in podman's storage.
base_image() {
    "${PODMAN[@]}" image exists "$BASE" && return
    step "debootstrap $SUITE -> $BASE"
    local root
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    TEMPS+=("$root")
    debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$root" "$MIRROR" \
        >"$CACHE/debootstrap.log" 2>&1 \
        || die "debootstrap $SUITE from $MIRROR failed: see $CACHE/debootstrap.log"
    chroot "$root" python3 -m venv /opt/venv
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | "${PODMAN[@]}" import --quiet --change "ENV PATH=$VENV_PATH" \
        --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
}

# Every pinned wheel (and setuptools + wheel, to build the package) for the image's Python, got
# by this machine's pip with its own configuration (its index or mirror); refilled only when the
# pins change. The image build then installs from it with no index and no network.
wheelhouse() {
    local host image
    host=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    image=$("${PODMAN[@]}" run --rm --network none "${LIMITS[@]}" "$BASE" python -c \
        'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ $host == "$image" ]] || die "$PYTHON is Python $host but $BASE has $image:" \
        "set PYTHON to a Python $image that has pip"
    "$PYTHON" docker/requirements.py pyproject.toml >"$CACHE/requirements.txt"
    if ! cmp -s "$CACHE/requirements.txt" "$CACHE/wheelhouse/requirements.txt"; then
        step "wheelhouse: $PYTHON -m pip wheel -> $CACHE/wheelhouse"
        "$PYTHON" -m pip wheel -qq --wheel-dir "$CACHE/wheelhouse" \
            -r "$CACHE/requirements.txt" 'setuptools>=68' wheel
        cp "$CACHE/requirements.txt" "$CACHE/wheelhouse/requirements.txt"
    fi
    printf '[global]\nno-index = true\nfind-links = /wheelhouse\n' >"$CACHE/pip.conf"
}

# `podman run` of the built image, offline, with the check's folder as /runs (the image's user
# defrag, uid 10001, owns it as it owns the image's /runs).
in_image() {
    "${PODMAN[@]}" run --rm --network none "${LIMITS[@]}" --shm-size 1g -e OMP_NUM_THREADS=1 \
        -v "$RUNS:/runs" "$@"
}

[[ $(id -u) == 0 ]] || die "run it as root (podman's image storage and debootstrap's chroot)"
for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null || die "$tool not found: apt-get install podman runc debootstrap"
done
[[ -x $PYTHON ]] || die "$PYTHON not found: run make venv first (its pip fills the wheelhouse)"
mkdir -p "$CACHE"

base_image
wheelhouse
step "podman build --build-arg BASE_IMAGE=$BASE -> $IMAGE"
"${PODMAN[@]}" build --network none "${LIMITS[@]}" --build-arg "BASE_IMAGE=$BASE" \
    -v "$CACHE/wheelhouse:/wheelhouse:ro" -v "$CACHE/pip.conf:/etc/pip.conf:ro" \
    -f docker/Dockerfile -t "$IMAGE" .

RUNS=$(mktemp -d "$CACHE/runs.XXXXXX")
TEMPS+=("$RUNS")
chown 10001:10001 "$RUNS"
step "defrag -h"
in_image --entrypoint defrag "$IMAGE" -h
step "defrag featurize synthetic"
in_image --entrypoint defrag "$IMAGE" featurize synthetic --out /runs/data --shard-size 100 \
    --num-train 200 --num-val 50
step "torchrun -m trainer.main: demo.yaml, 1 epoch, 2 processes"
in_image "$IMAGE" --nproc_per_node 2 -m trainer.main --config launch/configs/demo.yaml \
    data.shards=/runs/data run.run_dir=/runs/run optim.epochs=1 optim.frozen_cnn_epochs=1 \
    optim.anneal_last_epochs=0
step "defrag evaluate"
in_image --entrypoint defrag "$IMAGE" evaluate --model /runs/run/best --shards /runs/data \
    --split val
step "passed: $IMAGE built from $BASE, demo featurized, trained and evaluated in it"
