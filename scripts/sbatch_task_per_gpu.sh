#!/usr/bin/env bash
# One Slurm task per GPU: every task is one rank (--dist-init-method slurm).
#   sbatch scripts/sbatch_task_per_gpu.sh RUN_DIR /data/imagenet [more trainer options]
# RUN_DIR is the run's checkpoints folder, always given: the first submission starts it, a requeue or a
# chained resubmission of the same line continues it (--resume), and a new experiment gets a folder of its
# own because it has to be named (keying it on the script's fixed job name sent a second experiment into
# the first one's folder, quietly continuing its weights).
# MASTER_ADDR is the first host of the job's nodelist, MASTER_PORT = 15000 + SLURM_JOB_ID % 15000.
# --resume makes the same script serve the first run and every requeue. 120 s before the time limit
# Slurm sends SIGUSR1: every rank stops at the next step, rank 0 writes a checkpoint and requeues the
# job (--requeue-on-preempt), and the requeued run continues from that very step. Logs are appended.
#SBATCH --job-name=imagenet-elastic
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
#SBATCH --requeue
#SBATCH --signal=USR1@120
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail
CHECKPOINTS=${1:?usage: sbatch $0 RUN_DIR DATA [trainer options]: RUN_DIR is the checkpoints folder of this run}
DATA=${2:?usage: sbatch $0 RUN_DIR DATA [trainer options]}
shift 2
srun --kill-on-bad-exit=1 python -m imagenet_elastic "$DATA" --dist-init-method slurm \
    --checkpoints-path "$CHECKPOINTS" --resume --requeue-on-preempt "$@"
