package staging

import (
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the Prometheus metrics of the checkpoint path, which the
// Manager updates as it works. ckptd serve registers them on its /metrics
// registry; a Manager given none keeps an unregistered set.
type Metrics struct {
	StagedBytes  prometheus.Counter
	DrainedBytes prometheus.Counter
	StoredBytes  prometheus.Counter
	// ReferencedBytes counts the tensor bytes incremental saves referenced
	// in earlier steps instead of writing them.
	ReferencedBytes prometheus.Counter
	Restored        prometheus.Counter
	// RestoredInPlace counts the bytes restores read from the hot tier's
	// shared memory as they lie there (none of them copied by the daemon).
	RestoredInPlace prometheus.Counter
	QueueDepth      prometheus.Gauge
	ArenaUsed       prometheus.Gauge
	SaveStall       prometheus.Histogram
	DrainTime       prometheus.Histogram
	Errors          *prometheus.CounterVec
	// CodecRaw and CodecStored count chunk bytes by the codec they were
	// stored with: what --codec auto chose, and what it saved.
	CodecRaw    *prometheus.CounterVec
	CodecStored *prometheus.CounterVec
	// TableBytes is the memory booked by open saves' tensor tables and
	// metadata, against --tensor-table-bytes.
	TableBytes prometheus.Gauge
	// LeasesReleased counts leases ended without a commit or release, by
	// why: the client disconnected, or the lease timed out.
	LeasesReleased *prometheus.CounterVec
	// Quarantined counts journal entries set aside at start because they
	// no longer validated.
	Quarantined prometheus.Counter
	// Tiers counts saves by the strongest tier they reached: hot,
	// replicated (memory-only steps: --persist-every, --persist-interval),
	// committed.
	Tiers *prometheus.CounterVec
	// RestoreTiers counts restores by the tier that served them: hot,
	// peer, storage.
	RestoreTiers *prometheus.CounterVec
	// ReplicationFailures counts saves kept in memory only that did not
	// reach their --replicas peers: they ended hot, in one node's memory.
	ReplicationFailures prometheus.Counter
	// LastCommitted and LastCommitTime are, by job, the newest step this
	// daemon's saves committed and when it saw that (an alert on a job
	// whose checkpoints stopped: time() - ckptd_last_commit_timestamp_seconds).
	LastCommitted  *prometheus.GaugeVec
	LastCommitTime *prometheus.GaugeVec
	// NonFinite counts, by job, the tensors of drained saves that hold NaN
	// or Inf: a run diverging. At most maxCommitJobs job labels; the rest
	// count under "_other".
	NonFinite *prometheus.CounterVec
	// Spilled is what the spill folder holds: staged saves moved out of
	// the arena while storage did not take bytes.
	Spilled prometheus.Gauge

	mu     sync.Mutex
	errors map[string]uint64 // Errors' counts, for ErrorCounts
	// newest is the step LastCommitted shows by job, and when it was set;
	// at most maxCommitJobs jobs (a client naming a new job for every
	// save must not grow the metrics without bound): the longest idle
	// goes first.
	newest map[string]jobCommit
	// nonFiniteJobs are NonFinite's job labels (at most maxCommitJobs).
	nonFiniteJobs map[string]bool
}

// nonFinite counts n tensors holding NaN or Inf in a save of job.
func (m *Metrics) nonFinite(job string, n int) {
	m.mu.Lock()
	if !m.nonFiniteJobs[job] {
		if len(m.nonFiniteJobs) < maxCommitJobs {
			m.nonFiniteJobs[job] = true
		} else {
			job = "_other"
		}
	}
	m.mu.Unlock()
	m.NonFinite.WithLabelValues(job).Add(float64(n))
}

// maxCommitJobs bounds the jobs the commit gauges keep.
const maxCommitJobs = 256

type jobCommit struct {
	step int64
	at   time.Time
}

// NewMetrics creates the metrics and registers them with reg (nil: not
// registered, for tests).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		StagedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_staged_bytes_total", Help: "Tensor bytes accepted into the staging arena."}),
		DrainedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_drained_bytes_total", Help: "Tensor bytes made durable in storage."}),
		StoredBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_stored_bytes_total", Help: "Bytes written to storage after compression."}),
		ReferencedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_referenced_bytes_total", Help: "Tensor bytes incremental saves referenced in an earlier step instead of writing them."}),
		Restored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_restored_bytes_total", Help: "Bytes restores handed out: copied into the arena, or read in place from the hot tier."}),
		RestoredInPlace: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_restored_in_place_bytes_total", Help: "Bytes restores read straight from the hot tier's shared memory, not copied into the arena."}),
		QueueDepth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ckptd_drain_queue_depth", Help: "Staged saves not yet durable."}),
		ArenaUsed: &arenaGauge{Gauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ckptd_arena_used_bytes", Help: "Bytes of the staging arena in use: save and restore regions, dataset rings."})},
		SaveStall: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "ckptd_save_stall_seconds", Help: "Time from BeginSave to CommitSave accepted, as the trainer sees it.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
		DrainTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "ckptd_drain_seconds", Help: "Time from a save accepted to durable.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16)}),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_errors_total", Help: "Errors by operation."}, []string{"op"}),
		CodecRaw: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_codec_raw_bytes_total", Help: "Tensor bytes drained, by the codec their chunk was stored with."}, []string{"codec"}),
		CodecStored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_codec_stored_bytes_total", Help: "Bytes written to storage, by codec."}, []string{"codec"}),
		TableBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ckptd_tensor_table_bytes", Help: "Memory booked by open saves' tensor tables and metadata."}),
		LeasesReleased: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_leases_released_total", Help: "Leases ended without commit or release, by reason (disconnect, expired)."}, []string{"reason"}),
		Quarantined: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_journal_quarantined_total", Help: "Journal entries set aside at start because they no longer validated."}),
		Tiers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_saves_total", Help: "Saves by the strongest tier they reached (hot, replicated, committed)."}, []string{"tier"}),
		RestoreTiers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_restores_total", Help: "Restores by the tier that served them (hot, peer, storage)."}, []string{"tier"}),
		ReplicationFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_replication_failures_total", Help: "Saves kept in memory only that did not reach all the peers they are sent to (they ended hot: one node's memory)."}),
		LastCommitted: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ckptd_last_committed_step", Help: "The newest step of the job this daemon's saves committed."}, []string{"job"}),
		LastCommitTime: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ckptd_last_commit_timestamp_seconds", Help: "When this daemon saw the job's newest step committed (Unix time)."}, []string{"job"}),
		NonFinite: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_nonfinite_tensors_total", Help: "Tensors of drained saves that hold NaN or Inf, by job (a diverging run)."}, []string{"job"}),
		nonFiniteJobs: map[string]bool{},
		Spilled: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ckptd_spilled_bytes", Help: "Bytes of staged saves in the spill folder (moved out of the arena while storage did not take bytes)."}),
	}
	if reg != nil {
		reg.MustRegister(m.StagedBytes, m.DrainedBytes, m.StoredBytes, m.ReferencedBytes, m.Restored, m.RestoredInPlace,
			m.QueueDepth, m.ArenaUsed, m.SaveStall, m.DrainTime, m.Errors, m.CodecRaw, m.CodecStored,
			m.TableBytes, m.LeasesReleased, m.Quarantined, m.Tiers, m.RestoreTiers, m.ReplicationFailures, m.LastCommitted, m.LastCommitTime,
			m.NonFinite, m.Spilled)
	}
	return m
}

// arenaGauge reads the arena's use when it is collected: dataset rings
// take and give back arena space without the Manager knowing, so a value
// set on the Manager's own events would lag them.
type arenaGauge struct {
	prometheus.Gauge
	used atomic.Pointer[func() int64]
}

func (g *arenaGauge) Collect(ch chan<- prometheus.Metric) {
	if used := g.used.Load(); used != nil {
		g.Set(float64((*used)()))
	}
	g.Gauge.Collect(ch)
}

// followArena makes ckptd_arena_used_bytes read a's use when collected.
func (m *Metrics) followArena(a Arena) {
	if g, ok := m.ArenaUsed.(*arenaGauge); ok {
		used := a.Used
		g.used.Store(&used)
	}
}

// failed counts an error of operation op.
func (m *Metrics) failed(op string) {
	if m == nil {
		return
	}
	m.Errors.WithLabelValues(op).Inc()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.errors == nil {
		m.errors = map[string]uint64{}
	}
	m.errors[op]++
}

// ErrorCounts returns the errors counted so far by operation (drain,
// commit, restore, alloc, journal, copy_check), as ckptd_errors_total has
// them.
func (m *Metrics) ErrorCounts() map[string]uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.errors)
}

// committed records that a save of this daemon's committed step of job:
// the gauges move to it unless they show a newer step.
func (m *Metrics) committed(job string, step int64, now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.newest == nil {
		m.newest = map[string]jobCommit{}
	}
	if c, ok := m.newest[job]; ok && c.step >= step {
		return
	}
	if _, ok := m.newest[job]; !ok && len(m.newest) >= maxCommitJobs {
		oldest := ""
		for j, c := range m.newest {
			if oldest == "" || c.at.Before(m.newest[oldest].at) {
				oldest = j
			}
		}
		delete(m.newest, oldest)
		m.LastCommitted.DeleteLabelValues(oldest)
		m.LastCommitTime.DeleteLabelValues(oldest)
	}
	m.newest[job] = jobCommit{step, now}
	m.LastCommitted.WithLabelValues(job).Set(float64(step))
	m.LastCommitTime.WithLabelValues(job).Set(float64(now.UnixNano()) / 1e9)
}
