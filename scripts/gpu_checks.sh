#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md. Two entries answer every target on one H100:
#
#   bash scripts/gpu_checks.sh proof DATA OUT        at most 8 minutes (scripts/gpu_proof.py: what runs beside
#                                                    what, and the time guard)
#   EARLIER=DIR bash scripts/gpu_checks.sh proof_rest DATA OUT
#                                                    at most 3 minutes, on another machine too: what `proof` skipped
#                                                    or failed, from DIR's proof.jsonl and compile_cache.bin.gz (DIR: an
#                                                    earlier `proof`'s OUT)
#
# The other parts measure what the entries leave out, each well inside 10 minutes on one H100 (resnet50 at batch
# 256): the model's precisions and layouts, the device path's operators, the loader against the textbook one, a
# checkpoint's cost, a two-rank restart on one GPU and an epoch under torchrun with NCCL. Runs
# from the repository root with the machine's own python3 (no install: `python3 -m imagenet_elastic` finds the
# package in the current folder, and so does bench/benchmark.py, which counts the device path's operators and
# measures the checkpoint). Every figure is one JSON line on stdout; docs/BENCHMARKS.md keeps them with the
# command line, the GPU, the versions line and the date.
#
#   bash scripts/gpu_checks.sh PART[,PART...] [DATA] [WORKDIR]
#
# Several parts (a comma list, or `all`) run one after another, each in a process of its own: a part that fails
# does not stop the ones after it, and each is followed by {"part", "exit", "seconds"}.
#
# MODEL, BATCH, SIZE, BATCHES (measured batches of every benchmark; default each part's own) and ROUNDS (the loader
# part's; default 3) may be set in the environment: tests/scripts/test_gpu_checks.py and
# tests/scripts/test_gpu_proof.py run the parts and both entries on a CPU with a tiny model, so that no GPU time goes
# to a flag the benchmark no longer takes.
#
# PART: proof | proof_rest | versions | data | synthetic | device_ops | loader | checkpoint | restart | train
#       | all (every part but the two entries, in order). The CUDA tests (every test marked cuda) run in `proof`.
#       Where nvImageCodec is not installed, its wheel can be installed from a folder of wheels:
#         python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#           --platform manylinux_2_28_x86_64 -d .whl nvidia-nvimgcodec-cu13==0.9.0.20
#         python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
PART=${1:?usage: bash scripts/gpu_checks.sh PART[,PART...] [DATA] [WORKDIR], PART as in the header of the script}
DATA=${2:-/tmp/gpu_data}
WORK=${3:-/tmp/gpu_checks}
PY=${PYTHON:-python3}
MODEL=${MODEL:-resnet50}
BATCH=${BATCH:-256}
SIZE=${SIZE:-224}
BATCHES=${BATCHES:-}
ROUNDS=${ROUNDS:-3}
mkdir -p "$WORK"

# Loader workers: the cores less two (the training process and its feeder), then fewer if /dev/shm cannot
# hold the batches in flight (each worker keeps up to 2 uint8 batches of BATCH x SIZE x SIZE x 3 there).
workers() {
    local cores=$(( $(nproc) - 2 )) batch_mb=$(( BATCH * SIZE * SIZE * 3 / 1000000 ))
    local shm_mb; shm_mb=$(df -Pm /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
    local fit=$(( ${shm_mb:-0} / (2 * batch_mb + 1) / 2 ))  # half of /dev/shm, a margin for the val loader
    local n=$(( cores < fit ? cores : fit )); (( n < 1 )) && n=1
    echo "{\"workers\": $n, \"cores\": $(nproc), \"dev_shm_free_mb\": ${shm_mb:-null}, \"batch_mb\": $batch_mb}" >&2
    echo "$n"
}

bench() { "$PY" -m imagenet_elastic benchmark "$DATA" --model "$MODEL" --batch-size "$BATCH" "$@"; }
# the modes that are not installed (device_ops, index, checkpoint), with the same settings
dev_bench() { "$PY" bench/benchmark.py "$DATA" --model "$MODEL" --batch-size "$BATCH" "$@"; }
batches() { echo "${BATCHES:-$1}"; }  # a part's own count unless BATCHES is set

need_data() {
    if [ ! -d "$DATA/train" ]; then
        echo "no data at $DATA: run 'bash scripts/gpu_checks.sh data $DATA' first" >&2
        exit 2
    fi
}

run_part() {
    case "$1" in
    proof)  # the 8-minute entry; DATA is made when missing, WORKDIR gets its lines, logs and compile cache
        "$PY" scripts/gpu_proof.py "$WORK" --data "$DATA" --budget "${BUDGET:-480}"
        ;;
    proof_rest)  # the 3-minute entry: what an earlier `proof` (its WORKDIR in EARLIER) skipped or failed
        local earlier=${EARLIER:?EARLIER=the folder of an earlier proof (its proof.jsonl, compile_cache.bin.gz)}
        local cache=()
        [ -f "$earlier/compile_cache.bin.gz" ] && cache=(--compile-cache "$earlier/compile_cache.bin.gz")
        "$PY" scripts/gpu_proof.py "$WORK" --data "$DATA" --budget "${BUDGET:-180}" --redo "$earlier/proof.jsonl" \
            "${cache[@]}"
        ;;
    versions)
        "$PY" - <<'PY'
import json, os, platform, torch, torchvision, timm
cuda = torch.cuda.is_available()
print(json.dumps({"versions": {"python": platform.python_version(), "torch": torch.__version__,
                               "torchvision": torchvision.__version__, "timm": timm.__version__,
                               "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()},
                  "gpu": torch.cuda.get_device_name(0) if cuda else None,
                  "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
                  "cpus": os.cpu_count()}))
PY
        ;;
    data)  # ImageNet-sized JPEGs (500x375, quality 90): 6,400 train, 400 val
        [ -d "$DATA/train" ] || "$PY" scripts/make_fake_imagenet.py "$DATA" --classes 100 --train-per-class 64 \
            --val-per-class 4 --size 500x375 >&2
        echo "{\"data\": \"$DATA\", \"train_images\": $(find "$DATA/train" -name '*.jpg' | wc -l)}"
        ;;
    synthetic)
        need_data
        local b; b=$(batches 50)
        bench --mode synthetic --image-size "$SIZE" --amp bf16 --channels-last --no-compile --batches "$b"
        bench --mode synthetic --image-size "$SIZE" --amp bf16 --no-channels-last --no-compile --batches "$b"
        bench --mode synthetic --image-size "$SIZE" --amp fp16 --channels-last --no-compile --batches "$b"
        # FFCV's recipes: what the blur costs
        bench --mode synthetic --image-size "$SIZE" --amp bf16 --channels-last --blurpool --no-compile --batches "$b"
        ;;
    device_ops)  # the operators --decode gpu's device path dispatches per batch of 64, 128, 256 on this GPU
        need_data
        dev_bench --mode device_ops --image-size "$SIZE" --no-compile --decode gpu
        dev_bench --mode device_ops --image-size "$SIZE" --no-compile --decode gpu --auto-augment ta_wide \
            --random-erase 0.1
        ;;
    loader)
        need_data
        local n b; n=$(workers); b=$(batches 20)
        local decode
        for decode in cpu gpu; do  # gpu: what the workers supply of --decode gpu's encoded batches
            bench --mode loader --image-size "$SIZE" --workers "$n" --no-compile --batches "$b" --rounds "$ROUNDS" \
                --decode "$decode"
            bench --mode loader --image-size "$SIZE" --workers "$n" --no-compile --batches "$b" --rounds "$ROUNDS" \
                --decode "$decode" --auto-augment ta_wide --random-erase 0.1
        done
        ;;
    checkpoint)
        need_data
        dev_bench --mode checkpoint --no-compile --rounds 5 --checkpoints-path "$WORK"  # a background save's stall
        ;;
    restart)  # the first multi-GPU restart, on one GPU: two ranks share it over gloo (NCCL refuses two ranks on
              # one device), train, are restarted with --resume (rank 1 receives rank 0's checkpoint: load-once)
              # and train on with fused SGD; tests/state_probe.py has each rank report its restored state's layout
        need_data
        rm -rf "$WORK/restart"
        mkdir -p "$WORK/restart/probe"
        local args=("$DATA" --model "$MODEL" --batch-size "$(( (BATCH + 1) / 2 ))" --image-size "$SIZE" --no-compile
                    --model-ema --max-steps-per-epoch "$(batches 4)" --log-interval 2
                    --checkpoints-path "$WORK/restart/ckpt")
        for round in "--epochs 1" "--epochs 2 --resume"; do
            # shellcheck disable=SC2086  # the round's two words
            STATE_PROBE_DIR="$WORK/restart/probe" STATE_PROBE_ONE_GPU=1 "$PY" -m torch.distributed.run --standalone \
                --nproc-per-node=2 tests/state_probe.py "${args[@]}" $round >&2
        done
        "$PY" - "$WORK/restart" <<'PY'
import json, pathlib, sys, torch
folder = pathlib.Path(sys.argv[1])
ranks = [json.loads((folder / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
last = torch.load(folder / "ckpt" / "last.pt", map_location="cpu", weights_only=True)
print(json.dumps({"restart": "2 ranks, one device, resumed", "step": last["step"], "ranks": ranks}))
PY
        ;;
    train)  # NCCL at one rank, --decode gpu, a background checkpoint; the last line is the epoch's row
        need_data
        rm -rf "$WORK/ckpt"
        "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 -m imagenet_elastic "$DATA" --model "$MODEL" \
            --batch-size "$BATCH" --image-size "$SIZE" --no-compile --epochs 1 --max-steps-per-epoch "$(batches 24)" \
            --decode gpu --log-interval 8 --checkpoints-path "$WORK/ckpt" >&2
        tail -n 1 "$WORK/ckpt/metrics.jsonl"
        ;;
    *)
        echo "unknown part '$1' (see the script's header)" >&2
        exit 2
        ;;
    esac
}

EVERY_PART=(versions data synthetic device_ops loader checkpoint restart train)
if [ "$PART" = all ]; then
    parts=("${EVERY_PART[@]}")
else
    IFS=, read -r -a parts <<< "$PART"
fi
if (( ${#parts[@]} == 1 )); then
    run_part "${parts[0]}"
    exit 0
fi
# Several parts: every name is checked before any runs, and each part runs in a process of its own, so one that
# fails (a CUDA test, a missing library) costs that part, not the parts after it. After each,
# a line says how it ended and how long it took; the exit status is 1 if any part failed.
for part in "${parts[@]}"; do
    [[ " ${EVERY_PART[*]} proof proof_rest " == *" $part "* ]] ||
        { echo "unknown part '$part' (see the script's header)" >&2; exit 2; }
done
failed=0
for part in "${parts[@]}"; do
    start=$SECONDS status=0
    bash "$0" "$part" "$DATA" "$WORK" || status=$?
    echo "{\"part\": \"$part\", \"exit\": $status, \"seconds\": $(( SECONDS - start ))}"
    (( status == 0 )) || failed=1
done
exit "$failed"
