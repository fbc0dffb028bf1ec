#!/usr/bin/env bash
# Runs every Go fuzz target in the module for $FUZZTIME (default 5s) each,
# starting from its seed corpus. Found crashers land in testdata/fuzz/ of
# the package and fail the run.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${FUZZTIME:-5s}"
n=0
for pkg in $(go list ./...); do
	for target in $(go test -list '^Fuzz' "$pkg" | grep '^Fuzz' || true); do
		echo "fuzz $pkg $target ($fuzztime)"
		go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg" >/dev/null
		n=$((n + 1))
	done
done
echo "fuzzed $n targets"
