#!/usr/bin/env bash
# Regenerates the Go code for proto/ with the pinned protoc (from
# grpcio-tools) and plugins. `make proto` runs it; CI checks its output is
# committed (proto/gen_test.go).
#
# Usage: scripts/gen-proto.sh [OUTDIR]   (default: the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/tools.sh
out="${1:-$PWD}"
mkdir -p "$out"
PATH="$PWD/.tools/bin:$PATH" .venv/bin/python -m grpc_tools.protoc \
	-I proto \
	--go_out="$out" --go_opt=module=github.com/ckptd/ckptd \
	--go-grpc_out="$out" --go-grpc_opt=module=github.com/ckptd/ckptd \
	proto/ckptd/v1/ckptd.proto
