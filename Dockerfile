# ckptd: a static binary on a minimal base, running as a non-root user.
#
# The staging arena lives in /dev/shm, which Docker limits to 64 MiB by
# default: give the container room for --staging-bytes, and share /dev/shm
# and the socket folder with the trainer containers, e.g.
#
#   docker run --ipc=shareable --shm-size=16g -v ckptd-run:/run/ckptd \
#     -v /lustre/ckpt:/ckpt ckptd serve --storage /ckpt --staging-bytes 12GiB
#
# The socket is $CKPTD_SOCKET, /run/ckptd/ckptd.sock, for serve and for the
# health check alike (set the variable, not --socket, to move it). A named
# volume (ckptd-run above) starts as the image's /run/ckptd, owned by the
# daemon's user; a host folder mounted there must be owned by uid 65532 and
# writable by nobody else (clients refuse a socket others could replace).
#
# Start trainers with --ipc=container:<ckptd> (or a shared /dev/shm
# volume), the same volume, CKPTD_SOCKET=/run/ckptd/ckptd.sock and CKPTD_DAEMON_UID=65532:
# the daemon runs as the image's nonroot user (uid 65532), and clients trust
# only a daemon of their own uid, root, or CKPTD_DAEMON_UID. A trainer that
# runs as another uid must also be let in: add `--socket-group <gid>` (a gid
# the trainer's user has, e.g. the pod's fsGroup) to the serve command, which
# opens the socket and the arena to that group. Datasets are read only from
# the folders and buckets given with --dataset-allow. Locking the arena in
# memory needs --ulimit memlock=-1 (or CAP_IPC_LOCK); without it ckptd warns
# and runs unlocked.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# docker build --build-arg VERSION=$(git describe --tags --always) .
ARG VERSION=devel
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=${VERSION}" -o /out/ckptd ./cmd/ckptd
# The socket's folder: distroless has no shell to make it in the final stage.
RUN mkdir -p /out/run/ckptd

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ckptd /usr/local/bin/ckptd
COPY --from=build --chown=65532:65532 /out/run/ckptd /run/ckptd
USER nonroot:nonroot
ENV CKPTD_SOCKET=/run/ckptd/ckptd.sock
# Healthy while the daemon serves on its socket and its storage answers.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s \
  CMD ["/usr/local/bin/ckptd", "health"]
ENTRYPOINT ["/usr/local/bin/ckptd"]
CMD ["serve", "--storage", "/ckpt"]
