#!/usr/bin/env bash
# Wheels for a GPU host that cannot reach a package index: what gpu_session.sh needs beyond a
# PyTorch GPU image (CUDA 13 torch and torchvision, numpy, Pillow, pyarrow, OpenCV, tqdm, psutil,
# pytest, hypothesis).
#
#   benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]     (the GPU host's Python, default 3.12)
#
# Downloaded here (any machine with pip and an index), Linux x86_64, one version of each, without
# dependencies:
#   always    simplejpeg (a stoker dependency); TorchCodec, nvImageCodec and nvJPEG (decode="gpu"
#             backends beside torchvision's): about 40 MB (CUDA=12: no TorchCodec, whose CUDA 12 builds
#             are on the PyTorch index)
#   DALI=1    NVIDIA DALI, the bench peer, with the packages it needs: about 235 MB more
# On the host:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:src
# CUDA=12 fetches the CUDA 12 builds instead.
set -euo pipefail

DIR=${1:?usage: benchmarks/gpu_wheels.sh DIR [PYTHON_VERSION]}
PYV=${2:-3.12}
CUDA=${CUDA:-13}
PY=${PY:-python3}

if [ "$CUDA" = 13 ]; then
    NAMES=(simplejpeg torchcodec nvidia-nvimgcodec-cu13 nvidia-nvjpeg)  # PyPI's TorchCodec is a CUDA 13 build
    # DALI 2.4.0's Requires-Dist, pinned where it pins (nvcomp)
    DALI_NAMES=(nvidia-dali-cuda130==2.4.0 nvidia-libnvcomp-cu13==5.3.0.16)
elif [ "$CUDA" = 12 ]; then
    NAMES=(simplejpeg nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12)
    DALI_NAMES=(nvidia-dali-cuda120 nvidia-libnvcomp-cu12)
else
    echo "gpu_wheels.sh: CUDA must be 12 or 13, got '$CUDA'" >&2
    exit 2
fi
if [ "${DALI:-0}" = 1 ]; then
    NAMES+=("${DALI_NAMES[@]}" astunparse gast optree nvtx makefun "libcst~=1.8")
fi

platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$PYV" \
    "${platforms[@]}" -d "$DIR" "${NAMES[@]}"
ls -1 "$DIR"
echo "$(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
