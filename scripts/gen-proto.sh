#!/usr/bin/env bash
# Regenerates the Go code and the Python stubs for proto/ with the pinned
# protoc (from grpcio-tools) and plugins. `make proto` runs it; CI checks its
# output is committed (proto/gen_test.go for Go,
# clients/python/tests/test_proto_current.py for Python).
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
# Python: the stubs land in the package as ckptd.v1 (the proto package's
# own path, so the generated imports need no rewriting).
mkdir -p "$out/clients/python/src"
.venv/bin/python -m grpc_tools.protoc \
	-I proto \
	--python_out="$out/clients/python/src" \
	--pyi_out="$out/clients/python/src" \
	--grpc_python_out="$out/clients/python/src" \
	proto/ckptd/v1/ckptd.proto
