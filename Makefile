# ckptd developer entry points. The README names two: `make run` and
# `make test`; CI runs .ci/run, which calls `make test`.
GO       ?= go
FUZZTIME ?= 50000x
# bench-compare's litdata (what pip chose beside mosaicml-streaming 0.13.0
# on 2026-12-04).
LITDATA_VERSION ?= 0.2.76
# What `ckptd --version` says: the commit, or the tag on it.
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)

.PHONY: all build run test test-busy lint test-go test-python test-deploy fuzz chaos outage bench bench-python bench-codec bench-compare bench-scale proto docs tools clean

all: build

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o bin/ckptd ./cmd/ckptd

# Run the daemon on its defaults: socket $XDG_RUNTIME_DIR/ckptd.sock or
# /tmp/ckptd-$UID/ckptd.sock, checkpoints
# under ~/.local/share/ckptd, a 1 GiB staging arena in /dev/shm.
run: build
	./bin/ckptd serve

# Everything CI checks: formatting, vet, generated code, the race-enabled
# test suite (unit, conformance, end-to-end) and a short fuzz of every parser.
# The Go and the Python suites run side by side: each leaves a core idle
# much of the time (waiting on daemons, MinIO, subprocesses), so together
# they take little longer than the longer one. Each one's output is shown
# whole when it ends.
test: tools lint
	$(MAKE) --no-print-directory -j2 --output-sync=target test-go test-python
	$(MAKE) --no-print-directory test-deploy fuzz

tools:
	scripts/tools.sh
	scripts/minio.sh >/dev/null

lint: tools
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	$(GO) vet ./...
	.tools/bin/staticcheck ./...
	cd clients/python && ../../.venv/bin/mypy

# Every package runs under an explicit timeout of at least 3x its time on
# a busy 2-core machine: the slowest, test/attempts, takes 2.4 minutes idle
# and took 12.7 with every core busy and two more test suites running.
# The end-to-end packages run ckptd built once here: with the race
# detector, and without it for the memory measurements.
GO_TEST_TIMEOUT ?= 45m
test-go: build
	$(GO) build -race -o bin/ckptd-race ./cmd/ckptd
	CKPTD_PROTO_CHECK=1 CKPTD_TEST_RACE_BIN=$(CURDIR)/bin/ckptd-race CKPTD_TEST_BIN=$(CURDIR)/bin/ckptd \
	  $(GO) test -race -count=1 -timeout $(GO_TEST_TIMEOUT) ./...

# make test with every core kept busy by a busy loop, as on a shared CI
# machine; it must pass as it is, with no slowdown factor set.
test-busy:
	scripts/busy.sh $(MAKE) test

# The Python client: ruff, mypy --strict (configured in its pyproject.toml),
# then pytest against a real `ckptd serve` built from this tree (torch tests
# included; under CI a skipped test fails).
test-python: build
	scripts/tools.sh
	.venv/bin/ruff check clients/python examples
	.venv/bin/ruff format --check clients/python examples
	cd clients/python && ../../.venv/bin/mypy
	CKPTD_TEST_BIN=$(CURDIR)/bin/ckptd .venv/bin/python -m pytest -q clients/python/tests

# The deployment examples (deploy/): Kubernetes manifests against the API
# types and, with kubectl-validate (pinned in scripts/tools.sh), against the
# API's schemas for Kubernetes 1.30; flags against ckptd serve, the dashboard
# against the metrics. A module of its own, so the Kubernetes types stay out
# of ckptd's.
test-deploy:
	scripts/tools.sh go
	cd deploy/validate && $(GO) mod tidy -diff && $(GO) vet ./... && \
	  KUBECTL_VALIDATE=$(CURDIR)/.tools/bin/kubectl-validate $(GO) test -count=1 ./...

fuzz:
	FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

# The memory tiers' chaos test (test/tiers TestChaos) for 10 minutes: ranks
# drifting apart, nodes lost. `make test` runs it for about a minute.
# A 2-minute storage outage with a save every 5 s through a 32 MiB arena
# and a spill folder, then kill -9: every acknowledged save commits.
outage: build
	scripts/minio.sh >/dev/null
	CKPTD_OUTAGE_DURATION=2m CKPTD_TEST_BIN=$(CURDIR)/bin/ckptd \
	  $(GO) test -count=1 -timeout 20m -run '^TestS3SpillDuringOutage$$' -v ./test/s3

chaos: build
	$(GO) build -race -o bin/ckptd-race ./cmd/ckptd
	CKPTD_CHAOS_DURATION=10m CKPTD_TEST_RACE_BIN=$(CURDIR)/bin/ckptd-race CKPTD_TEST_BIN=$(CURDIR)/bin/ckptd \
	  $(GO) test -count=1 -timeout 30m -run '^TestChaos$$' -v ./test/tiers

bench:
	$(GO) run ./test/bench $(BENCHFLAGS)
	$(MAKE) bench-python
	$(MAKE) bench-codec

# save() stall from Python vs a numpy copy into shared memory, and torch.save;
# then Client.dataset's samples/s and stall vs torch DataLoader + webdataset and
# the disk's raw read bandwidth (about a minute); then ckptd.dcp against DCP's
# own writers and reader, 4 processes (a few minutes).
bench-python:
	scripts/tools.sh
	scripts/minio.sh >/dev/null
	.venv/bin/python clients/python/bench/bench_save.py $(PYBENCHFLAGS)
	.venv/bin/python clients/python/bench/bench_dataset.py $(PYDSBENCHFLAGS)
	.venv/bin/python clients/python/bench/bench_dcp.py $(PYDCPBENCHFLAGS)
	.venv/bin/python clients/python/bench/bench_resume.py $(PYRESUMEBENCHFLAGS)
	.venv/bin/python clients/python/bench/bench_frameworks.py $(PYFWBENCHFLAGS)

# Client.dataset against Mosaic streaming and litdata on their own formats,
# from the local disk and from MinIO (a few minutes, and the first run installs
# both, with torch, into a virtualenv of their own: they pin older numpy and
# transformers than the project's).
bench-compare:
	scripts/minio.sh >/dev/null
	test -x .bench/venv-compare/bin/python || python3 -m venv .bench/venv-compare
	.bench/venv-compare/bin/pip install -q "mosaicml-streaming==0.13.0" "litdata==$(LITDATA_VERSION)" -e clients/python
	.bench/venv-compare/bin/python clients/python/bench/bench_compare.py $(COMPAREFLAGS)

# The chunk codecs (float-aware, zstd, lz4) and zipnn on the weights and Adam
# states of a small transformer trained on the spot (torch, CPU, ~1 minute):
# ratio and GB/s per core against the targets in test/bench/floatcodec
bench-codec:
	scripts/tools.sh
	.venv/bin/python test/bench/floatcodec/bench.py $(CODECBENCHFLAGS)

# How the requests and times of a step, its commit and the commands on it
# grow with the ranks: 16 to 1,024 ranks over 8 ckptd serve processes, on
# MinIO and on a POSIX folder (several minutes; not part of make test). The
# table and what it means: docs/scale.md.
bench-scale:
	scripts/minio.sh >/dev/null
	$(GO) run ./test/bench/scale $(SCALEFLAGS)

proto:
	scripts/gen-proto.sh

# docs/cli.md from the command tree (a test of cmd/ckptd fails when stale).
docs:
	CKPTD_UPDATE_DOCS=1 $(GO) test -count=1 -run '^TestCLIReference$$' ./cmd/ckptd

clean:
	rm -rf bin .bench
