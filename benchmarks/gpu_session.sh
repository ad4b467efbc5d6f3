#!/usr/bin/env bash
# Everything a GPU host runs for the GPU path's "Measure" list, in order, in a few calls.
#
#   benchmarks/gpu_session.sh [--device cpu|cuda] [quick | STEP...]   (from the repository root)
#
# quick: for a time-limited host (15 minutes of machine time, its 1-2 minute start included; commands of at
# most 10 minutes; a few files handed back), two calls: `gpu_session.sh cudatests`, then `gpu_session.sh quick`:
# setup env loader train-resnet50 train-resnet18 targets in at most 9 minutes wall, each step under its own
# time limit (QUICK_LIMITS), the loader and both models at 16 and at 8 cores (CORES, `stoker bench --cores`:
# pinned as a cloud instance with that many vCPUs per GPU is, the split's GPU share reported at each), on
# smaller sizes (2,000 images, 2 rounds: QUICK_* below). Without STEP and without quick, every
# step of the full run below, sized to finish in well under 10 minutes each on an H100/H200 with 16 CPU
# cores (docs/benchmarks.md has the time of each and how both profiles fit their calls):
#   setup    the region decoder (stoker._jpeg) built in place when stoker runs from the checkout (without
#            it stoker decodes whole images, about 14% more CPU per image), and whether it loads
#   env      what this host has: GPU, driver, torch/CUDA, torchvision, TorchCodec, nvImageCodec, DALI
#   tests    cudatests: pytest $CUDA_TESTS (tests/cuda) once, every failure listed (no -x, and no sanitizer:
#            its mode is per thread, so it sees only the main thread); then cputests: the CPU suite
#   loader   stoker bench, loaders alone: the cuda-* pipelines of the list (DataLoader+PIL vs stoker, CPU
#            and GPU decode and the two split by measured throughput, vs DALI), LOADER_STEPS batches a
#            round; the log has the split's GPU share, why, and the GPU path's seconds per phase
#   train    the same bench, each model of MODELS trained fed by the train-{model}-* pipelines of the list
#            vs synthetic data: one step per model, train-<model> (train-resnet50, train-resnet18; train50
#            and train18 are the same two)
#   decoders every GPU JPEG backend side by side (benchmarks/bench_gpu_decode.py), the one
#            gpu_decoder="auto" took, and stoker doctor with it
#   peers    the CPU bench with NVIDIA DALI beside stoker (benchmarks/bench_dali.py, when nvidia-dali imports here)
#   targets  benchmarks/targets.py on the loader and training results: each verdict with the start-up
#            share of the pipelines behind it (reported, not a gate)
#   demo     `make demo STOKER_PYTHON=$PY`: the demo on the GPU, from this checkout with this interpreter
#
# --device cpu (or DEVICE=cpu) runs the same steps on any machine, on tiny data when the sizes below
# are set small: a rehearsal of everything but the device itself (tests/test_gpu_session.py runs one).
#
# Every log and bench.json lands under $OUT (default ./gpu-session), beside conditions.md: what the
# figures were measured under (images in page cache, how the baseline copies). Each step's log holds
# the output of its commands, the bench's per-pipeline processes included (their stoker log lines,
# timers among them, prefixed with the pipeline's name: STOKER_BENCH_CHILD_LOGS). Nothing is printed
# as a result that was not measured in this run. RESULTS, when set, receives one small archive of this
# run (logs, bench.json and bench.md files, the decoder and demo results, conditions.md), rewritten
# after every step and on any exit (trap EXIT), so a run stopped by its time limit still hands back
# what its finished steps measured: for a machine that hands back only a few files.
# The host needs a CUDA build of torch and, for the models and the real baseline transforms, the
# matching torchvision; stoker installed (pip install -e ".[test]") or PYTHONPATH=src. The dali
# pipelines (cuda-dali, train-<model>-dali) run through benchmarks/bench_dali.py (stoker bench with NVIDIA
# DALI's pipelines added) and need NVIDIA DALI: pip install nvidia-dali-cuda130 (the env step says whether
# it imports; without it they are reported as skipped). GPU JPEG decode needs
# TorchCodec (pip install torchcodec, the build matching torch) or nvImageCodec
# (pip install 'nvidia-nvimgcodec-cu12[nvjpeg]' or -cu13, matching torch's CUDA).
# A host without a package index takes them as wheels: benchmarks/gpu_wheels.sh DIR on a machine
# with one. PY picks the interpreter (default: python3). WORKERS the CPU cores per pipeline (16).
# OUT holds the generated images and packed copies (about 1 GB; 0.4 GB quick). CORES (quick: 16,8; else unset):
# the core counts each bench step runs pinned to, in turn (replaces WORKERS: the threads follow the cores).
set -u -o pipefail

# The pipelines the loader and train steps run, one list per profile: loaders alone (cuda-*) and training
# feeds (train-{model}-*, run for each model of MODELS). A new pipeline of `stoker bench` joins here
# (train-{model}-stoker-process, train-{model}-stoker-interference, cuda-stoker-auto: the CPU+GPU split
# decode loader, ...); PIPELINES in the environment replaces the profile's list.
FULL_PIPELINES="cuda-baseline cuda-stoker cuda-stoker-gpu cuda-stoker-auto cuda-dali train-{model}-synthetic
train-{model}-baseline train-{model}-stoker train-{model}-stoker-process train-{model}-stoker-interference
train-{model}-stoker-gpu train-{model}-dali"
QUICK_PIPELINES="cuda-stoker cuda-stoker-gpu cuda-stoker-auto train-{model}-synthetic train-{model}-baseline
train-{model}-stoker train-{model}-stoker-process train-{model}-stoker-interference"
# quick: each step's time limit in seconds (LIMITS="step=seconds ..." in the environment overrides some).
# Their sum, 525 s, keeps the run under 9 minutes; the H200's times were: CUDA tests 111 s, each training
# bench of 3 feeds 60-75 s at 2 rounds x 60 steps, GPU decode the slowest loader (docs/benchmarks.md).
# At two core counts each bench step runs twice: cudatests (145 s) is the first call of its own.
QUICK_LIMITS="setup=30 env=20 cudatests=145 loader=150 train-resnet50=165 train-resnet18=150 targets=15"

PY=${PY:-python3}
OUT=${OUT:-gpu-session}
WORKERS=${WORKERS:-16}
DEVICE=${DEVICE:-cuda}        # cpu runs the same plumbing on any machine (no GPU figure comes of it)
RESULTS=${RESULTS:-}
CUDA_TESTS=${CUDA_TESTS:-tests/cuda}
MODELS=${MODELS:-resnet50 resnet18}   # torchvision model names or module:callable, one train step each
export STOKER_BENCH_CHILD_LOGS=1      # the bench passes on its pipeline processes' log lines

PROFILE=full
STEPS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) [ $# -ge 2 ] || { echo "gpu_session.sh: --device needs a value (cpu or cuda)" >&2; exit 2; }
                  DEVICE=$2; shift 2 ;;
        --device=*) DEVICE=${1#--device=}; shift ;;
        quick) PROFILE=quick; shift ;;
        *) STEPS+=("$1"); shift ;;
    esac
done
if [ "$PROFILE" = quick ]; then
    BATCH=${BATCH:-256}
    ROUNDS=${ROUNDS:-2}
    IMAGES=${IMAGES:-2000}
    LOADER_STEPS=${LOADER_STEPS:-30}
    TRAIN_STEPS=${TRAIN_STEPS:-25}
    CORES=${CORES-16,8}
    WARMUP_STEPS=${WARMUP_STEPS:-5}
    PIPELINES=${PIPELINES:-$QUICK_PIPELINES}
    LIMITS="$QUICK_LIMITS ${LIMITS:-}"
else
    BATCH=${BATCH:-256}
    ROUNDS=${ROUNDS:-3}
    IMAGES=${IMAGES:-5000}        # generated ImageNet-like JPEGs, once, under $OUT/<first bench>/data
    LOADER_STEPS=${LOADER_STEPS:-200}     # batches per round, loaders alone (a warm-up round, then ROUNDS)
    TRAIN_STEPS=${TRAIN_STEPS:-100}       # timed steps per round, after WARMUP_STEPS untimed ones
    WARMUP_STEPS=${WARMUP_STEPS:-10}
    PIPELINES=${PIPELINES:-$FULL_PIPELINES}
    LIMITS=${LIMITS:-}
    CORES=${CORES:-}
fi
DECODE_IMAGES=${DECODE_IMAGES:-1024}  # images bench_gpu_decode.py decodes a round

label() { local m=${1##*:}; printf '%s' "${m##*.}"; }   # a model's name in pipelines: resnet50, small_cnn
MODEL_STEPS=()
for m in $MODELS; do MODEL_STEPS+=("train-$(label "$m")"); done
if [ ${#STEPS[@]} -eq 0 ]; then
    if [ "$PROFILE" = quick ]; then
        STEPS=(setup env loader "${MODEL_STEPS[@]}" targets)   # cudatests: a call of its own first
    else
        STEPS=(setup env tests loader "${MODEL_STEPS[@]}" decoders peers targets demo)
    fi
fi
model_of() {  # the model of step train-<label>, from MODELS (train50, train18: resnet50, resnet18)
    local m
    case "$1" in train50) echo resnet50; return ;; train18) echo resnet18; return ;; esac
    for m in $MODELS; do [ "train-$(label "$m")" = "$1" ] && { echo "$m"; return; }; done
    return 1
}
for STEP in "${STEPS[@]}"; do   # every name checked before anything runs: a typo costs nothing
    case "$STEP" in
        setup|env|tests|cudatests|cputests|loader|train|train50|train18|decoders|peers|targets|demo) ;;
        train-*) model_of "$STEP" >/dev/null || { echo "gpu_session.sh: step '$STEP' names no model of" \
                 "MODELS ($MODELS)" >&2; exit 2; } ;;
        *) echo "gpu_session.sh: unknown step '$STEP'; expected quick, or setup env tests (cudatests cputests)" \
                "loader train (train-<model>: ${MODEL_STEPS[*]}) decoders peers targets demo" >&2
           exit 2 ;;
    esac
done
limit_of() {  # the time limit of step $1 in seconds from LIMITS (0: none)
    local kv limit=0
    case "$1" in train50) set -- train-resnet50 ;; train18) set -- train-resnet18 ;; esac
    for kv in $LIMITS; do [ "${kv%%=*}" = "$1" ] && limit=${kv#*=}; done
    case "$1" in train-*) [ "$limit" -gt 0 ] || for kv in $LIMITS; do   # another model: the smallest model's
        [ "${kv%%=*}" = train-resnet18 ] && limit=${kv#*=}; done ;; esac
    echo "$limit"
}
mkdir -p "$OUT"
STATUS=0
STEP=session
DEADLINE=0    # when the current step's time runs out (seconds since the epoch; 0: no limit)
ARCHIVE=gpu-session-$(date -u +%Y%m%d-%H%M%S).tar.gz

note() { printf '\n== %s  (%s)\n' "$1" "$(date -u +%H:%M:%S)" | tee -a "$OUT/session.log"; }
run() {  # run CMD..., its output to the step's log and the terminal, within the step's time; remember a failure
    printf '$ %s\n' "$*" | tee -a "$OUT/session.log"
    local limit=() left rc
    if [ "$DEADLINE" -gt 0 ]; then
        left=$(( DEADLINE - $(date +%s) ))
        if [ "$left" -le 0 ]; then
            printf '[not run: step %s is out of time]\n' "$STEP" | tee -a "$OUT/session.log" "$OUT/$STEP.log"
            STATUS=1
            return 124
        fi
        limit=(timeout --kill-after=5 "$left")   # the command's whole process group, bench children too
    fi
    "${limit[@]}" "$@" 2>&1 | tee -a "$OUT/$STEP.log"
    rc=${PIPESTATUS[0]}
    if [ "${#limit[@]}" -gt 0 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
        printf '[timed out: step %s reached its limit of %s s]\n' "$STEP" "$(limit_of "$STEP")" |
            tee -a "$OUT/session.log" "$OUT/$STEP.log"
    fi
    printf '[exit %s]\n' "$rc" | tee -a "$OUT/session.log"
    [ "$rc" -eq 0 ] || STATUS=1
    return "$rc"
}
pipelines() {  # pipelines PATTERN [MODEL]: the list's entries matching PATTERN, {model} replaced, comma-joined
    local p out=()
    for p in $PIPELINES; do
        p=${p//\{model\}/${2:-}}
        case "$p" in $1) out+=("$p") ;; esac
    done
    (IFS=,; printf '%s' "${out[*]}")
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
    local cores=(--workers "$WORKERS")
    [ -n "${CORES:-}" ] && cores=(--cores "$CORES")   # pinned to each count in turn, the threads following it
    local args=(--device "$DEVICE" "${cores[@]}" --batch-size "$BATCH" --rounds "$ROUNDS" "${data[@]}"
                --out "$OUT/$dir" "$@")
    case " $* " in
        *dali*) run "$PY" benchmarks/bench_dali.py "${args[@]}" ;;   # stoker bench with DALI's pipelines added
        *) run "$PY" -m stoker.cli bench "${args[@]}" ;;
    esac
}
conditions() {  # what every figure of this run was measured under, kept beside the figures
    cat >"$OUT/conditions.md" <<EOF
# Conditions of this run ($(date -u +%Y-%m-%dT%H:%M:%SZ))

- Device: $DEVICE; profile: $PROFILE; steps: ${STEPS[*]}; ${CORES:-$WORKERS} CPU cores per pipeline; batches of $BATCH;
  $ROUNDS timed rounds; loaders alone $LOADER_STEPS batches a round, training $WARMUP_STEPS warm-up + $TRAIN_STEPS
  steps a round. Step time limits: ${LIMITS:-none}.
- Data: $IMAGES generated ImageNet-like JPEGs (about 400 x 350 px) and their packed copy on local disk.
  After the first pass every read comes from the page cache (the host has far more memory than these
  files), so the loader figures are decode-bound, not I/O-bound: reads from cold disk or object
  storage are not measured here.
- Baseline (cuda-baseline, train-<model>-baseline): torchvision ImageFolder + DataLoader($WORKERS workers,
  pin_memory, persistent workers) with ToTensor + Normalize on the workers, so float32 batches cross
  the bus (4x the bytes of uint8), each copied with .to(device, non_blocking=True) on the default
  stream of the training thread: the copy queues behind the step on that stream, no overlap; then a
  cast to bfloat16 on the device.
- stoker (cuda-stoker, cuda-stoker-gpu, cuda-stoker-auto, train-<model>-stoker*): uint8 batches copied on the loader's
  own stream and converted there (bfloat16, normalized), overlapping the step.
- Start-up (construction to first batch) is untimed warm-up; targets.py shows, beside each verdict,
  the start-up share of the pipelines behind it (start-up over the timed run), not a gate.
EOF
}
collect() {  # this run's small files (logs, results, conditions; no images) in one archive under $RESULTS
    [ -n "$RESULTS" ] || return 0
    mkdir -p "$RESULTS" || return 0
    (cd "$OUT" && find . -maxdepth 3 \( -name '*.log' -o -name 'bench*.json' -o -name 'bench*.md' \
        -o -name 'decoders.json' -o -name 'demo.md' -o -name 'demo.json' -o -name 'conditions.md' \) -print0 |
        tar -czf "$RESULTS/$ARCHIVE.part" --null -T -) && mv -f "$RESULTS/$ARCHIVE.part" "$RESULTS/$ARCHIVE"
}

step_env() {
    if [ "$DEVICE" != cpu ]; then
        run nvidia-smi
    fi
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
    # once, every failure listed; -rs lists every skip with its reason: on a GPU host only a missing
    # optional library may skip; the slowest tests' times for the next sizing of this step
    # shellcheck disable=SC2086
    run "$PY" -m pytest $CUDA_TESTS -q -rs --durations=10 -p no:cacheprovider
}

step_cputests() {  # CPU_TESTS_TIMEOUT: seconds before the suite is stopped (0, the default: never)
    run timeout "${CPU_TESTS_TIMEOUT:-0}" "$PY" -m pytest -x -q -p no:cacheprovider --ignore=tests/cuda
}

step_tests() {
    step_cudatests
    step_cputests
}

step_loader() {
    # generates the images once ($OUT/bench-loader/data), packs them, then the list's loader-alone pipelines
    local list; list=$(pipelines 'cuda-*')
    if [ -z "$list" ]; then note "loader: no cuda-* pipeline in the list"; return 0; fi
    bench bench-loader --pipelines "$list" --steps "$LOADER_STEPS"
}

step_train_model() {  # one model fed by each train-{model}-* pipeline of the list, into $OUT/bench-train-<label>
    local model=$1 name; name=$(label "$model")
    local list; list=$(pipelines "train-$name-*" "$name")
    if [ -z "$list" ]; then note "train: no train-{model}-* pipeline in the list"; return 0; fi
    bench "bench-train-$name" --models "$model" --steps "$TRAIN_STEPS" --warmup-steps "$WARMUP_STEPS" \
        --pipelines "$list"
}

step_train50() { step_train_model resnet50; }
step_train18() { step_train_model resnet18; }

step_train() {
    local m
    for m in $MODELS; do step_train_model "$m"; done
}

step_decoders() {
    run "$PY" benchmarks/bench_gpu_decode.py "$OUT/decoders-cache" --device "$DEVICE" --images "$DECODE_IMAGES" \
        --batch "$BATCH" --rounds "$ROUNDS" --json "$OUT/decoders.json"
    local d packed=""
    for d in "$OUT"/bench-*/packed; do
        [ -f "$d/stoker.json" ] && { packed=$d; break; }
    done
    if [ -z "$packed" ]; then   # no bench ran on this machine (a fresh one): IMAGES generated images, packed
        packed=$OUT/decoders-packed
        [ -f "$packed/stoker.json" ] || { run "$PY" -m stoker.cli synth "$OUT/decoders-data" --images "$IMAGES" --quiet &&
            run "$PY" -m stoker.cli pack "$OUT/decoders-data" "$packed" --quiet; } || return 1
    fi
    run "$PY" - "$packed" "$DEVICE" "$BATCH" <<'EOF'
import sys
import stoker
from stoker.tools.doctor import run_doctor
from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop

packed, device, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
if device == "cpu":  # the rehearsal: the same path, nvImageCodec's CPU backend standing in for the GPU's
    from stoker.device.gpu_decode import NvImageCodecDecoder
    decoder = NvImageCodecDecoder("cpu")
else:
    decoder = "auto"
opts = stoker.DeviceOptions(device, normalize="imagenet", dtype="bf16", memory_format="channels_last", decode="gpu",
                            gpu_decoder=decoder)
with stoker.Loader(packed, batch, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()], device=opts) as loader:
    for _ in zip(range(20), loader):
        pass
    print("gpu_decoder='auto' took:", loader.stats.gpu_decoder)
    print("decoded on the GPU:", loader.stats.gpu_decoded, "CPU fallbacks:", loader.stats.gpu_fallbacks)
    print("decode='gpu' seconds per phase:", loader.stats.gpu_phases)
# decode="auto": each batch split between the GPU and the worker threads by measured throughput
auto = stoker.DeviceOptions(device, normalize="imagenet", dtype="bf16", memory_format="channels_last", decode="auto",
                            gpu_decoder=decoder)
with stoker.Loader(packed, batch, transforms=[RandomResizedCrop(224), RandomHorizontalFlip()], device=auto) as loader:
    for _ in zip(range(60), loader):
        pass
    print(f"decode='auto': {loader.stats.gpu_share:.0%} on the GPU: {loader.stats.gpu_split}")
    print("decode='auto' seconds per phase:", loader.stats.gpu_phases)
on_gpu = device != "cpu"
print(run_doctor(packed, batch_size=batch, steps=20, model="resnet50" if on_gpu else None, device=device,
                 decode="gpu" if on_gpu else "cpu", progress=False).format())
EOF
}

step_peers() {
    if "$PY" -c "import nvidia.dali" 2>/dev/null; then
        local data; mapfile -t data < <(data_args)
        run "$PY" benchmarks/bench_dali.py --workers "$WORKERS" "${data[@]}" --out "$OUT/bench-cpu"
    else
        note "peers: nvidia.dali does not import here (pip install nvidia-dali-cuda130); DALI not measured"
    fi
}

step_targets() {  # every result together
    local f found=()
    for f in "$OUT"/bench-loader/bench*.json "$OUT"/bench-train-*/bench*.json; do
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

trap 'collect' EXIT     # however the run ends, what its finished steps measured is handed back
trap 'exit 143' TERM    # a signal ends the run through the EXIT trap
trap 'exit 130' INT
conditions
START=$(date +%s)
for STEP in "${STEPS[@]}"; do
    LIMIT=$(limit_of "$STEP")
    DEADLINE=0
    if [ "$LIMIT" -gt 0 ]; then
        note "$STEP (limit $LIMIT s)"
        DEADLINE=$(( $(date +%s) + LIMIT ))
    else
        note "$STEP"
    fi
    case "$STEP" in
        train-*) step_train_model "$(model_of "$STEP")" || true ;;
        *) "step_$STEP" || true ;;
    esac
    DEADLINE=0
    collect             # after every step: a step killed outright loses only itself
done
STEP=session
note "done in $(( $(date +%s) - START )) s: logs and bench.json files in $OUT (exit status $STATUS: 1 when any command failed)"
[ -z "$RESULTS" ] || echo "results: $RESULTS/$ARCHIVE"
exit "$STATUS"
