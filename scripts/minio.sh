#!/usr/bin/env bash
# Installs the pinned MinIO server that the S3 tests and benchmark start
# (internal/miniotest), unless that exact build is already there: $MINIO_BIN
# if set, else GOBIN (or the first GOPATH's bin). Building it takes about 5
# minutes on 2 cores, once. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/.."

MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c

if [[ -n "${MINIO_BIN:-}" ]]; then
	[[ -x "$MINIO_BIN" ]] || { echo "MINIO_BIN=$MINIO_BIN is not an executable" >&2; exit 1; }
	echo "$MINIO_BIN"
	exit 0
fi
bin_dir="$(go env GOBIN)"
if [[ -z "$bin_dir" ]]; then
	bin_dir="$(go env GOPATH | cut -d: -f1)/bin"
fi
bin="$bin_dir/minio"
# `go version -m` names the module version a binary was built from.
if [[ -x "$bin" ]] && go version -m "$bin" 2>/dev/null | grep -Eq "^[[:space:]]*mod[[:space:]]+github.com/minio/minio[[:space:]]+$MINIO_VERSION([[:space:]]|$)"; then
	echo "$bin"
	exit 0
fi
echo "installing github.com/minio/minio@$MINIO_VERSION into $bin_dir (about 5 minutes on 2 cores)" >&2
GOBIN="$bin_dir" go install "github.com/minio/minio@$MINIO_VERSION"
echo "$bin"
