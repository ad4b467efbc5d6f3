#!/usr/bin/env bash
# Everything a GPU host runs for the GPU path's "Measure" list, in order, in a few calls.
#
#   benchmarks/gpu_session.sh [STEP...]      (from the repository root; default: every step)
#
# Steps, each sized to finish in well under 10 minutes on an H100/H200 with 16 CPU cores:
#   env      what this host has: GPU, driver, torch/CUDA, torchvision, TorchCodec, nvImageCodec, DALI
#   tests    pytest tests/cuda under TORCH_CUDA_SANITIZER=1, then the CPU suite
#   loader   stoker bench --device cuda, loaders alone (DataLoader+PIL vs stoker, CPU and GPU decode, vs DALI);
#            pipelines whose start-up is 1% or more of their timed run are rerun once with the
#            --steps the bench's table asks for
#   train    the same bench, ResNet-50 and ResNet-18 training fed by each loader vs synthetic data:
#            train50 then train18, one bench each (either step alone fits one call more easily)
#   decoders every GPU JPEG backend side by side, region vs whole-image decode
#            (benchmarks/bench_gpu_decode.py), which one gpu_decoder="auto" measured fastest, and
#            stoker doctor with it
#   peers    the CPU bench with NVIDIA DALI beside stoker (when nvidia-dali imports here)
#   targets  benchmarks/targets.py on the loader and training results
#   demo     the demo on the GPU (what `make demo` runs, in this environment)
#
# Every log and bench.json lands under $OUT (default ./gpu-session); nothing is printed as a result
# that was not measured in this run. The host needs a CUDA build of torch and, for the models and the
# real baseline transforms, the matching torchvision; stoker installed (pip install -e ".[test]") or
# PYTHONPATH=src. The dali pipelines (cuda-dali, train-<model>-dali) need NVIDIA DALI on this host:
# pip install nvidia-dali-cuda130 (the env step says whether it imports; without it they are reported
# as skipped). nvImageCodec, a GPU JPEG backend beside torchvision's: pip install
# 'nvidia-nvimgcodec-cu12[nvjpeg]' (or -cu13, matching torch's CUDA; [nvjpeg] brings nvJPEG).
# A host without a package index takes them as wheels: benchmarks/gpu_wheels.sh DIR on a machine
# with one. PY picks the interpreter (default: python3). WORKERS the CPU cores per pipeline (16).
set -u -o pipefail

PY=${PY:-python3}
OUT=${OUT:-gpu-session}
WORKERS=${WORKERS:-16}
DEVICE=${DEVICE:-cuda}        # cpu runs the same plumbing on any machine (no GPU figure comes of it)
BATCH=${BATCH:-256}
ROUNDS=${ROUNDS:-3}
IMAGES=${IMAGES:-5000}        # generated ImageNet-like JPEGs, once, under $OUT/<first bench>/data
LOADER_STEPS=${LOADER_STEPS:-300}   # batches of 256 per timed round, loaders alone
TRAIN_STEPS=${TRAIN_STEPS:-100}     # timed steps per round; 3 rounds: 300 steps per model and feed
mkdir -p "$OUT"
STATUS=0

note() { printf '\n== %s  (%s)\n' "$1" "$(date -u +%H:%M:%S)" | tee -a "$OUT/session.log"; }
run() {  # run CMD..., its output to the step's log and the terminal; remember a failure
    printf '$ %s\n' "$*" | tee -a "$OUT/session.log"
    "$@" 2>&1 | tee -a "$OUT/$STEP.log"
    local rc=${PIPESTATUS[0]}
    printf '[exit %s]\n' "$rc" | tee -a "$OUT/session.log"
    [ "$rc" -eq 0 ] || STATUS=1
    return "$rc"
}
data_args() {  # the images the first bench generated ($OUT/<bench>/data), shared by every later bench
    local d
    for d in "$OUT"/bench-*/data; do
        [ -d "$d" ] && { printf -- '--data\n%s\n' "$d"; return; }
    done
    printf -- '--images\n%s\n' "$IMAGES"
}
bench() {  # bench DIR ARGS...: stoker bench --device $DEVICE into $OUT/DIR
    local dir=$1; shift
    local data; mapfile -t data < <(data_args)
    run "$PY" -m stoker.cli bench --device "$DEVICE" --workers "$WORKERS" --batch-size "$BATCH" \
        --rounds "$ROUNDS" "${data[@]}" --out "$OUT/$dir" "$@"
}
startup_steps() {  # startup_steps BENCH_JSON: "PIPELINES STEPS" to rerun, or nothing when all are under 1%
    "$PY" - "$1" <<'EOF'
import json, sys
from stoker.tools.bench_gpu import STARTUP_SHARE, steps_for_startup
r = json.load(open(sys.argv[1]))
late = [p for p in r["pipelines"] if (p.get("startup_share") or 0) >= STARTUP_SHARE]
if late:
    print(",".join(p["name"] for p in late), max(steps_for_startup(r["steps"], p["startup_share"]) for p in late))
EOF
}

step_env() {
    run nvidia-smi
    run "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "cuDNN", torch.backends.cudnn.version())
for mod in ("torchvision", "torchcodec", "nvidia.nvimgcodec", "nvidia.dali", "stoker"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as exc:  # a torchvision built for another torch raises RuntimeError, not ImportError
        print(mod, "does not import:", type(exc).__name__, exc)
EOF
}

step_tests() {
    # -rs lists every skip with its reason: on a GPU host only a missing optional library may skip
    TORCH_CUDA_SANITIZER=1 run "$PY" -m pytest tests/cuda -x -rs -p no:cacheprovider
    run "$PY" -m pytest tests/cuda -rs -p no:cacheprovider   # the same without the sanitizer's slowdown
    run "$PY" -m pytest -x -q -p no:cacheprovider --ignore=tests/cuda
}

step_loader() {
    # generates the images once ($OUT/data), packs them, then the four loader-alone pipelines
    bench bench-loader --pipelines cuda-baseline,cuda-stoker,cuda-stoker-gpu,cuda-dali --steps "$LOADER_STEPS"
    local again
    again=$(startup_steps "$OUT/bench-loader/bench.json")
    if [ -n "$again" ]; then
        set -- $again
        note "loader: start-up of $1 was 1% or more of the timed run: again with --steps $2"
        bench bench-loader-long --pipelines "$1" --steps "$2"
    fi
}

late_note() {  # late_note DIR: say which pipelines of $OUT/DIR started up too slowly to be judged
    local again
    [ -f "$OUT/$1/bench.json" ] || return 0   # the bench failed: its log says why
    again=$(startup_steps "$OUT/$1/bench.json")
    [ -z "$again" ] || note "$1: start-up of ${again% *} was 1% or more of its timed run; rerun with --steps ${again#* } (not done here: time)"
}

step_train50() {
    bench bench-train-resnet50 --models resnet50 --steps "$TRAIN_STEPS" --pipelines \
train-resnet50-synthetic,train-resnet50-baseline,train-resnet50-stoker,train-resnet50-stoker-gpu,train-resnet50-dali
    late_note bench-train-resnet50
}

step_train18() {
    bench bench-train-resnet18 --models resnet18 --steps "$TRAIN_STEPS" --pipelines \
train-resnet18-synthetic,train-resnet18-baseline,train-resnet18-stoker,train-resnet18-stoker-gpu,train-resnet18-dali
    late_note bench-train-resnet18
}

step_train() {
    step_train50
    step_train18
}

step_decoders() {
    run "$PY" benchmarks/bench_gpu_decode.py "$OUT/decoders-cache" --device "$DEVICE" --json "$OUT/decoders.json"
    run "$PY" - "$OUT" <<'EOF'
import sys
from pathlib import Path
import stoker
from stoker.tools.doctor import run_doctor
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

packed = next(p for p in sorted(Path(sys.argv[1]).glob("bench-*/packed")) if (p / "stoker.json").exists())
opts = stoker.DeviceOptions("cuda", normalize="imagenet", dtype="bf16", memory_format="channels_last", decode="gpu")
with stoker.Loader(packed, 256, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()], device=opts) as loader:
    for _ in zip(range(20), loader):
        pass
    print("gpu_decoder='auto' chose:", loader.stats.gpu_decoder)
    print("decoded on the GPU:", loader.stats.gpu_decoded, "CPU fallbacks:", loader.stats.gpu_fallbacks)
print(run_doctor(packed, batch_size=256, steps=20, model="resnet50", device="cuda", decode="gpu").format())
EOF
}

step_peers() {
    if "$PY" -c "import nvidia.dali" 2>/dev/null; then
        local data; mapfile -t data < <(data_args)
        run "$PY" -m stoker.cli bench --workers "$WORKERS" "${data[@]}" --out "$OUT/bench-cpu"
    else
        note "peers: nvidia.dali does not import here (pip install nvidia-dali-cuda130); DALI not measured"
    fi
}

step_targets() {  # every result together; the longer loader rerun replaces its first run
    local f found=()
    for f in "$OUT"/bench-loader/bench.json "$OUT"/bench-loader-long/bench.json "$OUT"/bench-train-*/bench.json; do
        [ -f "$f" ] && found+=("$f")
    done
    if [ ${#found[@]} -gt 0 ]; then
        run "$PY" benchmarks/targets.py "${found[@]}"
    else
        note "targets: no bench.json under $OUT yet (run the loader and train steps first)"
    fi
}

step_demo() {
    run "$PY" -m stoker.cli demo --device cuda --out "$OUT/demo"
}

STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(env tests loader train50 train18 decoders peers targets demo)
for STEP in "${STEPS[@]}"; do
    case "$STEP" in
        env|tests|loader|train|train50|train18|decoders|peers|targets|demo) note "$STEP"; "step_$STEP" || true ;;
        *) echo "gpu_session.sh: unknown step '$STEP'; expected env tests loader train (train50 train18) decoders peers targets demo" >&2
           exit 2 ;;
    esac
done
note "done: logs and bench.json files in $OUT (exit status $STATUS: 1 when any command failed)"
exit "$STATUS"
