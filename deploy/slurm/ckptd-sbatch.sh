#!/usr/bin/env bash
# An sbatch script that runs one ckptd sidecar per node beside a torchrun
# job. Submit with: sbatch --nodes=4 --gpus-per-node=8 deploy/slurm/ckptd-sbatch.sh
#
# Every rank of this run gets the same CKPTD_ATTEMPT: the job id and
# Slurm's restart count (a requeued job is a new attempt; the restart count
# is the same on every node, unlike torchelastic's).
#SBATCH --job-name=train
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
set -euo pipefail

export CKPTD_ATTEMPT="slurm-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
export CKPTD_SOCKET="/tmp/ckptd-${SLURM_JOB_ID}/ckptd.sock"
CKPTD_STORAGE="${CKPTD_STORAGE:-/lustre/ckpt}"
CKPTD_JOB="${CKPTD_JOB:-${SLURM_JOB_NAME}}"

# One sidecar per node, in the background for the life of the job. --overlap
# lets the training step share the nodes' CPUs with it.
srun --overlap --ntasks-per-node=1 --kill-on-bad-exit=0 \
	ckptd serve --socket "$CKPTD_SOCKET" --storage "$CKPTD_STORAGE" --job "$CKPTD_JOB" \
	--staging-bytes "${CKPTD_STAGING_BYTES:-16GiB}" --log-format json &
sidecars=$!

# Wait until every node's sidecar answers.
srun --ntasks-per-node=1 bash -c 'for i in $(seq 60); do ckptd health --socket "$CKPTD_SOCKET" >/dev/null 2>&1 && exit 0; sleep 1; done; echo "ckptd did not start on $(hostname)" >&2; exit 1'

head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun --ntasks-per-node=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
	--rdzv-backend c10d --rdzv-endpoint "$head:29500" train.py --resume latest

# SIGTERM the sidecars: they drain what is staged (--shutdown-grace) and exit.
kill -TERM "$sidecars"
wait "$sidecars" || true
