#!/usr/bin/env bash
# One Slurm task per node that starts one process per visible GPU (rank = task * procs + local index).
#   sbatch scripts/sbatch_task_per_node.sh RUN_DIR /data/imagenet [more trainer options]
# RUN_DIR is the run's checkpoints folder, always given: the first submission starts it, a requeue or a
# chained resubmission of the same line continues it (--resume), and a new experiment gets a folder of its
# own because it has to be named (keying it on the script's fixed job name sent a second experiment into
# the first one's folder, quietly continuing its weights).
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
CHECKPOINTS=${1:?usage: sbatch $0 RUN_DIR DATA [trainer options]: RUN_DIR is the checkpoints folder of this run}
DATA=${2:?usage: sbatch $0 RUN_DIR DATA [trainer options]}
shift 2
# --nproc-per-node defaults to the task's visible GPUs; pass it to override.
srun --kill-on-bad-exit=1 python -m imagenet_elastic "$DATA" --dist-init-method slurm \
    --checkpoints-path "$CHECKPOINTS" --resume --requeue-on-preempt "$@"
