#!/usr/bin/env bash
# Multi-node torchrun for clusters that export node-level variables into each node's container:
# MASTER_ADDR, MASTER_PORT, RANK (the node's rank) and WORLD_SIZE (the number of nodes).
# Run this same script on every node:
#   bash scripts/torchrun_multinode.sh /data/imagenet [more trainer options]
set -euo pipefail
DATA=${1:?usage: $0 DATA [trainer options]}
shift
: "${MASTER_ADDR:?set by the cluster: address of node 0}" "${MASTER_PORT:?set by the cluster}"
: "${RANK:?set by the cluster: the rank of this node}" "${WORLD_SIZE:?set by the cluster: number of nodes}"
NODE_RANK=$RANK
NNODES=$WORLD_SIZE
# torchrun re-exports RANK/WORLD_SIZE per worker process; the node-level values must not reach the trainer.
unset RANK WORLD_SIZE
exec python -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK" \
    --nproc-per-node="${NPROC_PER_NODE:-gpu}" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m imagenet_elastic "$DATA" --checkpoints-path "${CHECKPOINTS:-checkpoints}" --resume "$@"
