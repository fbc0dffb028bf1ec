#!/usr/bin/env bash
# An sbatch script that runs one ckptd sidecar per node beside a torchrun
# job. Submit with: sbatch --nodes=4 --gpus-per-node=8 deploy/slurm/ckptd-sbatch.sh
#
# Every rank of this run gets the same CKPTD_ATTEMPT: the job id and
# Slurm's restart count (a requeued job is a new attempt; the restart count
# is the same on every node, unlike torchelastic's).
#
# Preemption: 90 s before the time limit (and when the job is preempted
# with a GraceTime), Slurm sends SIGUSR1 to this script alone (B:, not to
# the sidecars, which must stay up to drain). The trap below passes SIGTERM
# to the training step: srun forwards it to torchrun, which forwards it to
# every worker (and kills them 30 s later). In the trainer,
# ckptd.on_preemption() turns it into a flag its loop checks between steps:
# every rank saves the step it is in, waits for the commit and exits (see
# clients/python/README.md, "Save on preemption"). The script then requeues
# the job; its next run resumes with --resume latest. Signal earlier
# (--signal=B:USR1@300) if a step and its save take longer than 30 s.
#SBATCH --job-name=train
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=B:USR1@90
set -euo pipefail

export CKPTD_ATTEMPT="slurm-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
export CKPTD_SOCKET="/tmp/ckptd-${SLURM_JOB_ID}/ckptd.sock"
CKPTD_STORAGE="${CKPTD_STORAGE:-/lustre/ckpt}"
CKPTD_JOB="${CKPTD_JOB:-${SLURM_JOB_NAME}}"

# Tiers, when CKPTD_HOT_BYTES is set: each sidecar keeps the newest steps in
# memory, and with CKPTD_PEER_CA (and CKPTD_PEER_CERT, CKPTD_PEER_KEY) the
# sidecars also keep replicas of each other's shards, over mutual TLS on port
# 7465, so that only every CKPTD_PERSIST_EVERY-th step (default: every one)
# is written to $CKPTD_STORAGE. The peers are this job's nodes, listed in a
# file on each node; each sidecar finds itself in it by its host name.
tiers=()
if [[ -n "${CKPTD_HOT_BYTES:-}" ]]; then
	tiers+=(--hot-bytes "$CKPTD_HOT_BYTES" --persist-every "${CKPTD_PERSIST_EVERY:-1}")
	if [[ -n "${CKPTD_PEER_CA:-}" ]]; then
		peer_file="/tmp/ckptd-${SLURM_JOB_ID}.peers" # beside, not in, the socket's private folder
		srun --ntasks-per-node=1 bash -c 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/:7465/" >"$1.tmp" && mv "$1.tmp" "$1"' _ "$peer_file"
		tiers+=(--peers-file "$peer_file" --peer-listen :7465 --peer-cert "$CKPTD_PEER_CERT" --peer-key "$CKPTD_PEER_KEY" --peer-ca "$CKPTD_PEER_CA")
	fi
fi

# One sidecar per node, in the background for the life of the job. --overlap
# lets the training step share the nodes' CPUs with it.
srun --overlap --ntasks-per-node=1 --kill-on-bad-exit=0 \
	ckptd serve --socket "$CKPTD_SOCKET" --storage "$CKPTD_STORAGE" --job "$CKPTD_JOB" \
	--staging-bytes "${CKPTD_STAGING_BYTES:-16GiB}" --log-format json "${tiers[@]}" &
sidecars=$!

# Wait until every node's sidecar answers.
srun --ntasks-per-node=1 bash -c 'for i in $(seq 60); do ckptd health --socket "$CKPTD_SOCKET" >/dev/null 2>&1 && exit 0; sleep 1; done; echo "ckptd did not start on $(hostname)" >&2; exit 1'

head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun --ntasks-per-node=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
	--rdzv-backend c10d --rdzv-endpoint "$head:29500" train.py --resume latest &
trainer=$!
preempted=0
trap 'preempted=1; kill -TERM "$trainer" 2>/dev/null || true' USR1
status=0
wait "$trainer" || status=$?
while kill -0 "$trainer" 2>/dev/null; do # the trap cut the wait short: wait for the save
	status=0
	wait "$trainer" || status=$?
done
if ((preempted)); then
	echo "preempted: the trainers saved their last step; requeueing" >&2
	scontrol requeue "$SLURM_JOB_ID"
	status=0
fi

# SIGTERM the sidecars: they drain what is staged (--shutdown-grace) and exit.
kill -TERM "$sidecars"
wait "$sidecars" || true
exit "$status"
