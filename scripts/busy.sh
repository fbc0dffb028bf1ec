#!/usr/bin/env bash
# Runs a command while a busy loop per core keeps every CPU of the machine
# busy, as another job on a shared CI machine would: `make test-busy` runs
# the whole suite this way, and it must pass. The loops run at the
# command's own priority and end with it, however it ends.
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: $0 command [args...]" >&2; exit 2; }
hogs=()
stop() { ((${#hogs[@]})) && kill "${hogs[@]}" 2>/dev/null; true; }
trap stop EXIT
for _ in $(seq "$(nproc)"); do
	# A shell that spins until this script's shell is gone, should a
	# SIGKILL of the script leave it behind.
	bash -c 'while kill -0 "$1" 2>/dev/null; do for _ in {1..100000}; do :; done; done' hog $$ &
	hogs+=($!)
done
echo "busy.sh: $(nproc) busy loops running; load from here on is the command's and theirs" >&2
start=$SECONDS
rc=0
"$@" || rc=$?
echo "busy.sh: '$*' exited $rc after $((SECONDS - start)) s with every core kept busy" >&2
exit $rc
