# ckptd developer entry points. The README names two: `make run` and
# `make test`; CI runs .ci/run, which calls `make test`.
GO       ?= go
FUZZTIME ?= 5s

.PHONY: all build run test lint test-go fuzz bench proto tools clean

all: build

build:
	$(GO) build -o bin/ckptd ./cmd/ckptd

# Run the daemon on its defaults: socket /tmp/ckptd-$UID.sock, checkpoints
# under ~/.local/share/ckptd, a 1 GiB staging arena in /dev/shm.
run: build
	./bin/ckptd serve

# Everything CI checks: formatting, vet, generated code, the race-enabled
# test suite (unit, conformance, end-to-end) and a short fuzz of every parser.
test: tools lint test-go fuzz

tools:
	scripts/tools.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	  if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

test-go:
	CKPTD_PROTO_CHECK=1 $(GO) test -race -count=1 ./...

fuzz:
	FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

bench:
	$(GO) run ./test/bench $(BENCHFLAGS)

proto:
	scripts/gen-proto.sh

clean:
	rm -rf bin .bench
