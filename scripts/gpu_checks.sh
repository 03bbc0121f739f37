#!/usr/bin/env bash
# Every GPU figure of docs/BENCHMARKS.md in one go, for a machine with one CUDA GPU (about 10 minutes on
# an H100). Prints the versions, then one JSON line per benchmark, then a short trainer run under torchrun
# with NCCL at one rank and --decode gpu. Paste the output into docs/BENCHMARKS.md with this command line.
#   bash scripts/gpu_checks.sh [DATA] [WORKDIR]
set -euo pipefail
DATA=${1:-/tmp/gpu_data}
WORK=${2:-/tmp/gpu_checks}
WORKERS=${WORKERS:-$(( $(nproc) - 2 ))}
mkdir -p "$WORK"
python - <<'PY'
import json, platform, torch, torchvision, timm
print(json.dumps({"versions": {"python": platform.python_version(), "torch": torch.__version__,
                  "torchvision": torchvision.__version__, "timm": timm.__version__},
                  "gpu": torch.cuda.get_device_name(0), "cpus": __import__("os").cpu_count()}))
PY
if [ ! -d "$DATA/train" ]; then  # ImageNet-sized JPEGs (500x375, quality 90): 6,400 train, 400 val
    python scripts/make_fake_imagenet.py "$DATA" --classes 100 --train-per-class 64 --val-per-class 4 \
        --size 500x375 >/dev/null
fi
bench() { imagenet-elastic benchmark "$DATA" --model resnet50 --batch-size 256 "$@"; }
bench --mode synthetic --amp bf16 --channels-last --batches 50
bench --mode synthetic --amp bf16 --no-channels-last --batches 50
bench --mode synthetic --amp fp16 --channels-last --batches 50
bench --mode synthetic --amp bf16 --channels-last --compile --batches 50
bench --mode end_to_end --amp bf16 --channels-last --workers "$WORKERS" --decode cpu --batches 40
bench --mode end_to_end --amp bf16 --channels-last --workers "$WORKERS" --decode gpu --batches 40
bench --mode end_to_end --amp bf16 --channels-last --workers "$WORKERS" --decode gpu --compile --batches 40
bench --mode loader --workers "$WORKERS" --batches 20 --rounds 3
bench --mode checkpoint --rounds 5 --checkpoints-path "$WORK"  # stall of a background save: the pinned copy
torchrun --standalone --nproc-per-node=1 -m imagenet_elastic "$DATA" --model resnet50 --batch-size 256 \
    --epochs 1 --max-steps-per-epoch 24 --decode gpu --log-interval 8 --checkpoints-path "$WORK/ckpt"
tail -n 1 "$WORK/ckpt/metrics.jsonl"
