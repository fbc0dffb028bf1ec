#!/usr/bin/env bash
# Installs the pinned developer tools into .tools/ (Go binaries) and .venv/
# (Python: protoc via grpcio-tools; the Python client, editable, with its
# pinned test dependencies). Idempotent and quick when everything is already
# there. Sourced by the Makefile's targets. `scripts/tools.sh go` installs the
# Go tools only (what make test-deploy needs).
set -euo pipefail
cd "$(dirname "$0")/.."

PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2
STATICCHECK_VERSION=v0.8.2
# Validates deploy/kubernetes against the API's OpenAPI schemas, which it
# embeds up to Kubernetes 1.30: it needs no cluster and no network.
KUBECTL_VALIDATE_VERSION=v0.0.4
GRPCIO_TOOLS_VERSION=1.85.1

TOOLS="$PWD/.tools"
VENV="$PWD/.venv"
mkdir -p "$TOOLS/bin"

install_go() { # name module@version
	local bin="$TOOLS/bin/$1" stamp="$TOOLS/$1.version"
	if [[ -x "$bin" && "$(cat "$stamp" 2>/dev/null)" == "$2" ]]; then return; fi
	echo "installing $2" >&2
	GOBIN="$TOOLS/bin" go install "$2"
	echo "$2" >"$stamp"
}

install_go protoc-gen-go "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION"
install_go protoc-gen-go-grpc "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION"
install_go staticcheck "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK_VERSION"
install_go kubectl-validate "sigs.k8s.io/kubectl-validate@$KUBECTL_VALIDATE_VERSION"
[[ "${1:-}" == go ]] && exit 0

if [[ ! -x "$VENV/bin/python" ]]; then
	# torch's PyPI wheel brings CUDA's libraries: the virtualenv takes about
	# 7 GiB. Said first, so that a full disk is not found out as pip's ENOSPC.
	free_kib="$(df -Pk . | awk 'NR == 2 { print $4 }')"
	if ((free_kib < 8 * 1024 * 1024)); then
		echo "warning: $((free_kib / 1024)) MiB free under $PWD; the virtualenv needs about 7 GiB" >&2
	fi
	echo "creating $VENV" >&2
	python3 -m venv "$VENV"
fi
want="grpcio-tools==$GRPCIO_TOOLS_VERSION"
if [[ "$(cat "$VENV/.tools.version" 2>/dev/null)" != "$want" ]]; then
	"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$want"
	echo "$want" >"$VENV/.tools.version"
fi

# The Python client (clients/python): its pinned runtime and test
# dependencies, then the package itself, editable. Redone only when the pins
# or its pyproject change; the first run takes about a minute (torch).
py_want="$(cat clients/python/requirements-dev.txt clients/python/pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$VENV/.python-client.version" 2>/dev/null)" != "$py_want" ]]; then
	echo "installing the Python client and its test dependencies into $VENV" >&2
	"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r clients/python/requirements-dev.txt
	"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e clients/python
	echo "$py_want" >"$VENV/.python-client.version"
fi

# zipnn, the baseline of the float codec benchmark (make bench-codec).
[[ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("zipnn"))' 2>/dev/null)" == 0.5.4 ]] || "$VENV/bin/python" -m pip install -q --disable-pip-version-check zipnn==0.5.4
