#!/usr/bin/env bash
# One Slurm task per node that starts one process per visible GPU (rank = task * procs + local index).
#   sbatch scripts/sbatch_task_per_node.sh /data/imagenet [more trainer options]
# Site wrappers work the same way: fastsrun -N 2 --ntasks-per-node=1 --gpus-per-task=2 python -m imagenet_elastic ...
#SBATCH --job-name=imagenet-elastic
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=64
#SBATCH --requeue
#SBATCH --signal=USR1@120
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail
DATA=${1:?usage: sbatch $0 DATA [trainer options]}
shift
CHECKPOINTS=${CHECKPOINTS:-checkpoints/$SLURM_JOB_NAME}
# --nproc-per-node defaults to the task's visible GPUs; pass it to override.
srun --kill-on-bad-exit=1 python -m imagenet_elastic "$DATA" --dist-init-method slurm \
    --checkpoints-path "$CHECKPOINTS" --resume --requeue-on-preempt "$@"
