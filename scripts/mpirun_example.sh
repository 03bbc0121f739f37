#!/usr/bin/env bash
# OpenMPI as the launcher (the process group is still nccl/gloo): ranks from OMPI_COMM_WORLD_*.
#   bash scripts/mpirun_example.sh NP /data/imagenet [more trainer options]
# Across nodes add -H node1:4,node2:4 and give rank 0's address: -x MASTER_ADDR=node1 (or --dist-url tcp://node1:29500).
set -euo pipefail
NP=${1:?usage: $0 NP DATA [trainer options]}
DATA=${2:?usage: $0 NP DATA [trainer options]}
shift 2
OPTS=(-n "$NP" --bind-to none -x PATH)
[ "$(id -u)" = 0 ] && OPTS+=(--allow-run-as-root)
for var in PYTHONPATH MASTER_ADDR MASTER_PORT; do   # forward only what is set
    [ -n "${!var:-}" ] && OPTS+=(-x "$var")
done
exec mpirun "${OPTS[@]}" \
    python -m imagenet_elastic "$DATA" --dist-init-method mpi --checkpoints-path "${CHECKPOINTS:-checkpoints}" \
    --resume "$@"
