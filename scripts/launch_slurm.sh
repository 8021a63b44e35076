#!/bin/bash
# Multi-node training under Slurm: one torchrun per node, joined by torchrun's c10d rendezvous
# on the job's first node; 5 minutes before the time limit every worker gets SIGUSR1, saves a
# checkpoint and exits 0 (resubmit the same script to continue from it).
#
#   sbatch --nodes 4 --gpus-per-node 8 scripts/launch_slurm.sh --config train_configs/llama3_8b_128k.toml \
#          [--section.key value ...]
#
# Everything after the script name goes to train.py. The #SBATCH lines below are defaults;
# sbatch's command-line options win over them. Environment knobs:
#   GPUS_PER_NODE   workers per node (default: the GPUs Slurm gave the node, else 8)
#   MASTER_PORT     the rendezvous port on the first node (default 29500)
#   SAVE_SECONDS    how long torchrun lets the workers save after the signal (default 600)
#
#SBATCH --job-name=titan-ulysses
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --signal=USR1@300
#SBATCH --output=%x-%j.out
set -euo pipefail

if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "launch_slurm.sh: not inside a Slurm job (no SLURM_JOB_NODELIST); submit it with sbatch" >&2
    exit 2
fi
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads it all: head would end scontrol with SIGPIPE, fatal under pipefail
MASTER_PORT=${MASTER_PORT:-29500}
SAVE_SECONDS=${SAVE_SECONDS:-600}
cd "${SLURM_SUBMIT_DIR:-.}"
echo "launch_slurm.sh: $NNODES node(s) x $GPUS_PER_NODE worker(s), rendezvous at $MASTER_ADDR:$MASTER_PORT"

# --signals-to-handle: torchrun passes Slurm's SIGUSR1 on to its workers (the trainer saves on it)
# instead of dying on it; --shutdown-timeout gives them SAVE_SECONDS to finish the save.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "${SLURM_JOB_ID:-titan-ulysses}" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "$SAVE_SECONDS" \
    train.py "$@"
