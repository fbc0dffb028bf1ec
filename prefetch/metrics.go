package prefetch

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the Prometheus metrics of the dataset service, which its
// sessions update. ckptd serve registers them on its /metrics registry; a
// Service given none keeps an unregistered set.
type Metrics struct {
	Wait        *prometheus.CounterVec // seconds trainers waited, by cause
	Samples     prometheus.Counter
	CacheHits   prometheus.Counter
	CacheMisses prometheus.Counter
	Corrupt     prometheus.Counter
	Sessions    prometheus.Gauge
	RingGrown   prometheus.Counter
	// The disk tier (--disk-cache-dir): shards it served, bytes it holds.
	DiskHits  prometheus.Counter
	DiskBytes prometheus.Gauge
}

// NewMetrics creates the prefetch metrics and registers them with reg
// (nil: not registered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Wait: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ckptd_prefetch_wait_seconds_total",
			Help: "Seconds trainers waited for a batch, by cause (storage, cache, ring, work)."}, []string{"cause"}),
		Samples: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_prefetch_samples_total", Help: "Samples delivered."}),
		CacheHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_prefetch_cache_hits_total", Help: "Shards served from the cache."}),
		CacheMisses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_prefetch_cache_misses_total", Help: "Shards read from storage."}),
		Corrupt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_prefetch_corrupt_shards_total", Help: "Shards skipped because they failed to parse."}),
		Sessions: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ckptd_prefetch_sessions", Help: "Open dataset sessions."}),
		RingGrown: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_prefetch_ring_slots_grown_total", Help: "Ring slots added to sessions whose trainer caught up with a full ring."}),
		DiskHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ckptd_prefetch_disk_hits_total", Help: "Shards of remote sources served from the datasets' disk tier."}),
		DiskBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ckptd_prefetch_disk_bytes", Help: "Bytes the datasets' disk tier holds, its files' trailers included."}),
	}
	if reg != nil {
		reg.MustRegister(m.Wait, m.Samples, m.CacheHits, m.CacheMisses, m.Corrupt, m.Sessions, m.RingGrown, m.DiskHits, m.DiskBytes)
	}
	return m
}
