#!/usr/bin/env bash
# Runs every Go fuzz target in the module for $FUZZTIME executions each
# (default 50000x, a few seconds per target here), starting from its seed
# corpus. Found crashers land in testdata/fuzz/ of the package and fail the
# run, with the fuzzer's output printed.
#
# The budget is a count, not a duration: with a duration Go 1.26's fuzz
# coordinator can race its own deadline and fail a clean target with a bare
# "context deadline exceeded" (go.dev/issue/75804, fixed in Go 1.27), which
# is what a loaded CI machine hit.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime="${FUZZTIME:-50000x}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
n=0
for pkg in $(go list ./...); do
	for target in $(go test -list '^Fuzz' "$pkg" | grep '^Fuzz' || true); do
		echo "fuzz $pkg $target ($fuzztime)"
		if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" -timeout 10m "$pkg" >"$log" 2>&1; then
			tail -n 40 "$log"
			exit 1
		fi
		n=$((n + 1))
	done
done
echo "fuzzed $n targets"
