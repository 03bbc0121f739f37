#!/usr/bin/env bash
# Elastic torchrun: run this same line on every node (2 to 4 of them); nodes may die and new ones may
# join while the job runs. Each membership change restarts the workers, which continue from the newest
# checkpoint at the new world size with the same global batch (say it with --global-batch-size and pick
# one that every possible world size divides, e.g. 4 nodes x 8 GPUs -> a multiple of 8, 16, 24 and 32).
#   HEAD=node01 bash scripts/torchrun_elastic.sh /data/imagenet --global-batch-size 1536 [more options]
set -euo pipefail
DATA=${1:?usage: HEAD=host bash $0 DATA [trainer options]}
shift
: "${HEAD:?set HEAD to the host that serves the rendezvous (any node that stays up)}"
# Re-form in seconds after a node is lost (torchrun's defaults take ~46 s), and let a node that joins
# later not hang: without a shared agent store every round gets a fresh one (torch 2.6-2.13).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec python -m torch.distributed.run --nnodes="${NNODES:-2:4}" --nproc-per-node="${NPROC_PER_NODE:-gpu}" \
    --max-restarts="${MAX_RESTARTS:-20}" --rdzv-backend=c10d --rdzv-endpoint="$HEAD:${RDZV_PORT:-29400}" \
    --rdzv-id="${RDZV_ID:-imagenet-elastic}" \
    --rdzv-conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3 \
    -m imagenet_elastic "$DATA" --checkpoints-path "${CHECKPOINTS:-checkpoints}" --resume \
    --checkpoint-interval "${CHECKPOINT_INTERVAL:-10m}" "$@"
