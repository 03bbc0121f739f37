#!/usr/bin/env bash
# srun starts one torchrun agent per node; the agents meet through c10d rendezvous on the first node.
# torchrun's variables win over Slurm's, and a failed worker is restarted by its agent (--max-restarts).
#   sbatch scripts/sbatch_srun_torchrun.sh RUN_DIR /data/imagenet [more trainer options]
# RUN_DIR is the run's checkpoints folder, always given: the first submission starts it, a requeue or a
# chained resubmission of the same line continues it (--resume), and a new experiment gets a folder of its
# own because it has to be named (keying it on the script's fixed job name sent a second experiment into
# the first one's folder, quietly continuing its weights).
#SBATCH --job-name=imagenet-elastic
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=64
#SBATCH --requeue
# SIGTERM, not SIGUSR1: torchrun forwards SIGTERM to its workers (and waits 30 s for them), while
# SIGUSR1 would simply kill the agent.
#SBATCH --signal=TERM@120
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail
CHECKPOINTS=${1:?usage: sbatch $0 RUN_DIR DATA [trainer options]: RUN_DIR is the checkpoints folder of this run}
DATA=${2:?usage: sbatch $0 RUN_DIR DATA [trainer options]}
shift 2
HEAD=$(python -c 'import os; from imagenet_elastic.launch.hostlist import first_host; print(first_host(os.environ["SLURM_JOB_NODELIST"]))')
RDZV_PORT=${RDZV_PORT:-29400}
NPROC=${NPROC_PER_NODE:-gpu}   # torchrun's "gpu": one process per visible GPU
# last_call_timeout/keep_alive_*: a group re-forms in seconds after a node is lost, not torchrun's ~46 s.
# Without a shared agent store, an agent that joins a running job does not hang (torch 2.6-2.13).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
srun --kill-on-bad-exit=0 python -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC" --max-restarts=3 \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-conf=last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3 \
    -m imagenet_elastic "$DATA" --dist-init-method slurm --checkpoints-path "$CHECKPOINTS" --resume --requeue-on-preempt "$@"
