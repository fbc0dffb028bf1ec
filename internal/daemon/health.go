package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/ckptd/ckptd/storage"
)

// probeTimeout bounds one look at storage for readiness: a probe must
// answer quickly even when the store does not.
const probeTimeout = 3 * time.Second

// readiness says whether the daemon can do its work now: it is serving
// (the arena is mapped and the journal replayed before the socket opens)
// and its storage answers. It probes storage at most every interval and
// publishes the answer to the gRPC health service, /readyz and the log.
type readiness struct {
	b        storage.Backend
	probe    string // an object name in the store; whether it exists does not matter
	interval time.Duration
	grpc     *health.Server
	log      *slog.Logger

	mu      sync.Mutex
	checked time.Time
	err     error // why not ready; nil when ready
}

func newReadiness(b storage.Backend, job string, grpc *health.Server, log *slog.Logger) *readiness {
	return &readiness{b: b, probe: job + "/health-probe", interval: 5 * time.Second, grpc: grpc, log: log}
}

// check probes storage unless it did so less than an interval ago.
func (r *readiness) check(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.checked) < r.interval && !r.checked.IsZero() {
		return r.err
	}
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	_, err := r.b.Stat(pctx, r.probe)
	if err == nil || errors.Is(err, storage.ErrNotFound) {
		err = nil
	} else {
		err = fmt.Errorf("storage %s does not answer: %w", r.b.Location(), err)
	}
	if (err == nil) != (r.err == nil) || r.checked.IsZero() {
		if err != nil {
			r.log.Warn("not ready", "why", err)
		} else if !r.checked.IsZero() {
			r.log.Info("ready again: storage answers")
		}
		status := healthpb.HealthCheckResponse_SERVING
		if err != nil {
			status = healthpb.HealthCheckResponse_NOT_SERVING
		}
		r.grpc.SetServingStatus("", status)
	}
	r.checked, r.err = time.Now(), err
	return err
}

// run keeps the gRPC health status current until ctx ends.
func (r *readiness) run(ctx context.Context) {
	t := time.NewTicker(r.interval)
	defer t.Stop()
	for {
		_ = r.check(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// handlers are /healthz (the process serves) and /readyz (it can do its
// work: storage answers), for Kubernetes probes and load balancers.
func (r *readiness) handlers(mux *http.ServeMux) {
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, req *http.Request) {
		if err := r.check(req.Context()); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
}
