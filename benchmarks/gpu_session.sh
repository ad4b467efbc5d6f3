#!/usr/bin/env bash
# Everything a GPU host runs for the GPU path's "Measure" list, in order, in a few calls.
#
#   benchmarks/gpu_session.sh [STEP...]      (from the repository root; default: every step)
#
# Steps, each sized to finish in well under 10 minutes on an H100/H200 with 16 CPU cores
# (docs/benchmarks.md has the time of each and how they fit in a few calls):
#   setup    the region decoder (stoker._jpeg) built in place when stoker runs from the checkout (without
#            it stoker decodes whole images, about 14% more CPU per image), and whether it loads
#   env      what this host has: GPU, driver, torch/CUDA, torchvision, TorchCodec, nvImageCodec, DALI
#   tests    cudatests: pytest tests/cuda -x under TORCH_CUDA_SANITIZER=1 (again without the sanitizer
#            and without -x only when that fails, to list every failure); then cputests: the CPU suite
#   loader   stoker bench --device cuda, loaders alone (DataLoader+PIL vs stoker, CPU and GPU decode, vs DALI),
#            a short first pass (LOADER_STEPS); every pipeline whose start-up was 1% or more of its
#            timed run then runs again alone with the --steps its own start-up needs, cheapest first,
#            as many as fit in LOADER_RERUN_S seconds (the others are named, and not judged)
#   train    the same bench, ResNet-50 and ResNet-18 training fed by each loader vs synthetic data:
#            train50 then train18, one bench each (either step alone fits one call more easily); the
#            stoker feeds whose start-up was 1% or more of their timed run run again together with the
#            synthetic reference over the same, longer windows, within TRAIN_RERUN_S seconds per model
#   decoders every GPU JPEG backend side by side, region vs whole-image decode
#            (benchmarks/bench_gpu_decode.py), which one gpu_decoder="auto" measured fastest, and
#            stoker doctor with it
#   peers    the CPU bench with NVIDIA DALI beside stoker (when nvidia-dali imports here)
#   targets  benchmarks/targets.py on the loader and training results
#   demo     `make demo STOKER_PYTHON=$PY`: the demo on the GPU, from this checkout with this interpreter
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
# OUT (default ./gpu-session) holds the generated images and packed copies (about 1 GB); RESULTS, when
# set, receives one small archive per run of this script (its logs, bench.json and bench.md files, the
# decoder and demo results), for a machine that hands back only a few files.
set -u -o pipefail

PY=${PY:-python3}
OUT=${OUT:-gpu-session}
WORKERS=${WORKERS:-16}
DEVICE=${DEVICE:-cuda}        # cpu runs the same plumbing on any machine (no GPU figure comes of it)
BATCH=${BATCH:-256}
ROUNDS=${ROUNDS:-3}
IMAGES=${IMAGES:-5000}        # generated ImageNet-like JPEGs, once, under $OUT/<first bench>/data
# The first passes are short on purpose: they measure each pipeline's rate and start-up, and a pipeline
# whose start-up weighs 1% or more of its timed run (which targets.py does not judge) runs again at the
# steps its start-up needs. One long pass for all would time the slowest pipeline (the DataLoader
# baseline, 4-5x slower than stoker) for as many steps as the fastest one's start-up needs.
LOADER_STEPS=${LOADER_STEPS:-100}   # batches of 256 per round, loaders alone (a warm-up round, then ROUNDS)
LOADER_RERUN_S=${LOADER_RERUN_S:-330}
TRAIN_STEPS=${TRAIN_STEPS:-50}      # timed steps per round, after the bench's 10 warm-up steps
TRAIN_RERUN_S=${TRAIN_RERUN_S:-150} # per model
RESULTS=${RESULTS:-}
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
reruns() {  # reruns BENCH_JSON BUDGET_S together|alone [NAMES]: "PIPELINES STEPS SECONDS" a run; "- NAME" left out
    "$PY" - "$@" <<'EOF'
import json, sys
from stoker.tools.bench_gpu import reruns
names = sys.argv[4].split(",") if len(sys.argv) > 4 else None
runs, left = reruns(json.load(open(sys.argv[1])), float(sys.argv[2]), names, together=sys.argv[3] == "together")
for pipelines, steps, seconds in runs:
    print(",".join(pipelines), steps, round(seconds))
for name in left:
    print("-", name)
EOF
}
rerun_late() {  # rerun_late DIR BUDGET_S together|alone NAMES [BENCH ARGS...]: the late pipelines of $OUT/DIR again
    local dir=$1 budget=$2 how=$3 names=$4 line pipelines steps seconds plans
    shift 4
    [ -f "$OUT/$dir/bench.json" ] || return 0   # the bench failed: its log says why
    mapfile -t plans < <(reruns "$OUT/$dir/bench.json" "$budget" "$how" ${names:+"$names"})
    for line in "${plans[@]}"; do
        read -r pipelines steps seconds <<<"$line"
        if [ "$pipelines" = "-" ]; then
            note "$dir: start-up of $steps was 1% or more of its timed run; not run again (over $budget s): not judged"
            continue
        fi
        note "$dir: start-up of $pipelines was 1% or more of its timed run: again with --steps $steps (about $seconds s)"
        bench "$dir-${pipelines##*,}" --pipelines "$pipelines" --steps "$steps" "$@"
    done
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

step_setup() {
    if ! "$PY" -c "import stoker._jpeg" 2>/dev/null; then
        run "$PY" setup.py -q build_ext --inplace   # an optional extension: a failure leaves whole-image decode
    fi
    run "$PY" -c "from stoker import codecs; from stoker._libjpeg import describe; \
print('region decode:', codecs.region_decode_available(), '|', describe())"
}

step_cudatests() {
    # -rs lists every skip with its reason: on a GPU host only a missing optional library may skip
    if ! TORCH_CUDA_SANITIZER=1 run "$PY" -m pytest tests/cuda -x -rs -p no:cacheprovider; then
        run "$PY" -m pytest tests/cuda -rs -p no:cacheprovider   # every failure, without the sanitizer's slowdown
    fi
}

step_cputests() {  # CPU_TESTS_TIMEOUT: seconds before the suite is stopped (0, the default: never)
    run timeout "${CPU_TESTS_TIMEOUT:-0}" "$PY" -m pytest -x -q -p no:cacheprovider --ignore=tests/cuda
}

step_tests() {
    step_cudatests
    step_cputests
}

step_loader() {
    # generates the images once ($OUT/data), packs them, then the four loader-alone pipelines
    bench bench-loader --pipelines cuda-baseline,cuda-stoker,cuda-stoker-gpu,cuda-dali --steps "$LOADER_STEPS"
    rerun_late bench-loader "$LOADER_RERUN_S" alone ""   # each into bench-loader-<pipeline>/
}

step_train50() {
    bench bench-train-resnet50 --models resnet50 --steps "$TRAIN_STEPS" --pipelines \
train-resnet50-synthetic,train-resnet50-baseline,train-resnet50-stoker,train-resnet50-stoker-gpu,train-resnet50-dali
    rerun_late bench-train-resnet50 "$TRAIN_RERUN_S" together train-resnet50-stoker,train-resnet50-stoker-gpu \
        --models resnet50
}

step_train18() {
    bench bench-train-resnet18 --models resnet18 --steps "$TRAIN_STEPS" --pipelines \
train-resnet18-synthetic,train-resnet18-baseline,train-resnet18-stoker,train-resnet18-stoker-gpu,train-resnet18-dali
    rerun_late bench-train-resnet18 "$TRAIN_RERUN_S" together train-resnet18-stoker,train-resnet18-stoker-gpu \
        --models resnet18
}

step_train() {
    step_train50
    step_train18
}

step_decoders() {
    run "$PY" benchmarks/bench_gpu_decode.py "$OUT/decoders-cache" --device "$DEVICE" --json "$OUT/decoders.json"
    local d packed=""
    for d in "$OUT"/bench-*/packed; do
        [ -f "$d/stoker.json" ] && { packed=$d; break; }
    done
    if [ -z "$packed" ]; then   # no bench ran on this machine (a fresh one): 5,000 generated images, packed
        packed=$OUT/decoders-packed
        [ -f "$packed/stoker.json" ] || { run "$PY" -m stoker.cli synth "$OUT/decoders-data" --images 5000 --quiet &&
            run "$PY" -m stoker.cli pack "$OUT/decoders-data" "$packed" --quiet; } || return 1
    fi
    run "$PY" - "$packed" <<'EOF'
import sys
import stoker
from stoker.tools.doctor import run_doctor
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

packed = sys.argv[1]
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

step_targets() {  # every result together; a rerun (DIR-<pipeline>/) replaces its first pass (DIR/)
    local f found=()
    for f in "$OUT"/bench-loader/bench.json "$OUT"/bench-loader-*/bench.json \
             "$OUT"/bench-train-resnet50/bench.json "$OUT"/bench-train-resnet50-*/bench.json \
             "$OUT"/bench-train-resnet18/bench.json "$OUT"/bench-train-resnet18-*/bench.json; do
        [ -f "$f" ] && found+=("$f")
    done
    if [ ${#found[@]} -gt 0 ]; then
        run "$PY" benchmarks/targets.py "${found[@]}"
    else
        note "targets: no bench.json under $OUT yet (run the loader and train steps first)"
    fi
}

step_demo() {  # `make demo` itself, with this interpreter (no .venv, nothing downloaded); results into $OUT/demo
    run make demo STOKER_PYTHON="$PY" && mkdir -p "$OUT/demo" && cp stoker-demo/demo.* "$OUT/demo/"
}

collect() {  # this run's small files (logs, results; no images) in one archive under $RESULTS
    local name="gpu-session-$(date -u +%H%M%S).tar.gz"
    mkdir -p "$RESULTS"
    (cd "$OUT" && find . -maxdepth 3 \( -name '*.log' -o -name 'bench.json' -o -name 'bench.md' \
        -o -name 'decoders.json' -o -name 'demo.md' -o -name 'demo.json' \) -print0 |
        tar -czf "$RESULTS/$name" --null -T -) && echo "results: $RESULTS/$name"
}

STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(setup env tests loader train50 train18 decoders peers targets demo)
for STEP in "${STEPS[@]}"; do
    case "$STEP" in
        setup|env|tests|cudatests|cputests|loader|train|train50|train18|decoders|peers|targets|demo)
            note "$STEP"; "step_$STEP" || true ;;
        *) echo "gpu_session.sh: unknown step '$STEP'; expected setup env tests (cudatests cputests) loader" \
                "train (train50 train18) decoders peers targets demo" >&2
           exit 2 ;;
    esac
done
note "done: logs and bench.json files in $OUT (exit status $STATUS: 1 when any command failed)"
[ -z "$RESULTS" ] || collect
exit "$STATUS"
