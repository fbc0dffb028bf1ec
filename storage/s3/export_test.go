package s3

// PeakBuffers is the most part buffers the backend's Puts have held at
// once; BuffersInUse how many they hold now.
func (b *Backend) PeakBuffers() int64  { return b.bufs.peak.Load() }
func (b *Backend) BuffersInUse() int64 { return b.bufs.inUse.Load() }
