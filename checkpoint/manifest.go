package checkpoint

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ckptd/ckptd/checkpoint/codec"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage"
)

// Format names and versions written by this build. Readers refuse others.
//
// Version 2 of both formats carries the attempt (the run of the job) and
// lives under the attempt's folder; version 1 (no attempt, objects in the
// step folder) is still read, so stores written before attempts restore.
// Manifest version 3 adds the tensors' counts of non-finite values; a
// manifest with none is written as version 2, which older ckptd read.
// Version 4 adds each chunk's content key: an incremental save
// (WriterOptions.Incremental) writes it, so that later saves can find the
// chunks they may reference.
const (
	ManifestFormat  = "ckptd.manifest"
	ManifestVersion = 2
	// ManifestVersionNonFinite is the version of a manifest with a
	// tensor holding NaN or Inf.
	ManifestVersionNonFinite = 3
	// ManifestVersionKeyed is the version of an incremental save's
	// manifest, whose chunks carry content keys, and the newest this build
	// reads.
	ManifestVersionKeyed = 4
	CommitFormat         = "ckptd.commit"
	CommitVersion        = 2

	// maxManifestBytes bounds what a reader accepts, so a corrupt or hostile
	// object cannot make it allocate without limit.
	maxManifestBytes = 256 << 20
	// MaxChunkSize bounds a chunk's raw length, and so the buffer a decoder
	// may be asked to fill.
	MaxChunkSize = 256 << 20
	// maxCommitBytes bounds a commit record: it lists one manifest per
	// rank, about 100 bytes each at MaxWorldSize.
	maxCommitBytes = 32 << 20
)

// Tensor is one entry of a tensor table. In a manifest, Offset is in data
// space (tensors back to back); in a staging request it is relative to the
// region.
type Tensor struct {
	Name   string      `json:"name"`
	DType  dtype.DType `json:"dtype"`
	Shape  []int64     `json:"shape"`
	Offset int64       `json:"offset"`
	Length int64       `json:"length"`
	// NonFinite counts the tensor's NaN and infinite values (each part
	// of a complex value), as the drain found them: manifest version 3.
	NonFinite int64 `json:"nonfinite,omitempty"`
}

func (t Tensor) equal(u Tensor) bool {
	return t.Name == u.Name && t.DType == u.DType && slices.Equal(t.Shape, u.Shape) && t.Offset == u.Offset && t.Length == u.Length
}

// Chunk locates one compressed piece of a shard.
type Chunk struct {
	Object    string      `json:"object"` // relative to the job folder
	Offset    int64       `json:"offset"` // of the stored bytes in Object
	Stored    int64       `json:"stored"`
	RawOffset int64       `json:"raw_offset"` // in data space
	Raw       int64       `json:"raw"`
	Codec     codec.Codec `json:"codec"`
	Hash      string      `json:"hash"` // of the raw bytes
	// Key is the content key of the raw bytes (codec.Key): manifest
	// version 4, written by incremental saves.
	Key string `json:"key,omitempty"`
}

// Manifest describes one rank's shard of one step.
type Manifest struct {
	Format     string    `json:"format"`
	Version    int       `json:"version"`
	Job        string    `json:"job"`
	Step       int64     `json:"step"`
	Rank       int       `json:"rank"`
	WorldSize  int       `json:"world_size"`
	Attempt    string    `json:"attempt,omitempty"` // version 2
	Created    time.Time `json:"created"`
	DataSize   int64     `json:"data_size"`
	StoredSize int64     `json:"stored_size"`
	Tensors    []Tensor  `json:"tensors"`
	Chunks     []Chunk   `json:"chunks"`
	Metadata   []byte    `json:"metadata"`
}

// NonFinite returns how many NaN and infinite values the shard's tensors
// hold, and in how many tensors.
func (m *Manifest) NonFinite() (values int64, tensors int) {
	for _, t := range m.Tensors {
		if t.NonFinite > 0 {
			values += t.NonFinite
			tensors++
		}
	}
	return values, tensors
}

// setNonFinite records counts, by tensor (nil: none), in a copy of the
// tensor table, making m a version 3 manifest when any is not 0.
func (m *Manifest) setNonFinite(counts []int64) {
	if counts == nil {
		return
	}
	m.Tensors = slices.Clone(m.Tensors)
	for i, n := range counts {
		m.Tensors[i].NonFinite = n
	}
	if values, _ := m.NonFinite(); values > 0 {
		m.Version = max(m.Version, ManifestVersionNonFinite)
	}
}

// Target returns the shard the manifest describes.
func (m *Manifest) Target() Target {
	return Target{Job: m.Job, Step: m.Step, Rank: m.Rank, WorldSize: m.WorldSize, Attempt: m.Attempt}
}

// Encode renders the manifest as indented JSON (people read these).
func (m *Manifest) Encode() ([]byte, error) {
	for i := range m.Tensors {
		if m.Tensors[i].Shape == nil {
			m.Tensors[i].Shape = []int64{} // a 0-d tensor: [] not null
		}
	}
	return json.MarshalIndent(m, "", " ")
}

// Hash is the hash of m as stored: what a commit record pins.
func (m *Manifest) Hash() string {
	b, err := m.Encode()
	if err != nil {
		return ""
	}
	return codec.HashString(b)
}

// Holds reports whether m describes exactly sh: same target, tensors and
// metadata, and every chunk's hash that of sh's bytes (with a CopyCheck,
// bytes that also have the client's MACs: the staged bytes may have been
// rewritten by another user since).
func (m *Manifest) Holds(sh *Shard) bool {
	if m.Target() != sh.Target || m.DataSize != sh.Layout.DataSize || !bytes.Equal(m.Metadata, sh.Metadata) ||
		!slices.EqualFunc(m.Tensors, sh.Layout.Packed, Tensor.equal) {
		return false
	}
	if sh.Check != nil {
		return sh.Check.holds(m.Chunks, sh.Layout, sh.Data)
	}
	var buf []byte
	for _, c := range m.Chunks {
		spans, ok := sh.Layout.regionSpans(c.RawOffset, c.Raw)
		if !ok {
			return false
		}
		raw := (chunkPlan{spans: spans}).gather(sh.Data, &buf, false)
		if codec.HashString(raw) != c.Hash {
			return false
		}
	}
	return true
}

// ParseManifest decodes and fully validates a manifest from untrusted
// bytes: every later step (restore, verify, prune) relies on the checks
// here to stay within bounds.
func ParseManifest(b []byte) (*Manifest, error) {
	if len(b) > maxManifestBytes {
		return nil, fmt.Errorf("%w: manifest is %d bytes, more than %d", ErrCorrupt, len(b), maxManifestBytes)
	}
	var head struct {
		Format  string `json:"format"`
		Version int    `json:"version"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, fmt.Errorf("%w: manifest is not valid JSON: %v", ErrCorrupt, err)
	}
	if err := checkFormat(head.Format, head.Version, ManifestFormat, 1, ManifestVersionKeyed); err != nil {
		return nil, err
	}
	var m Manifest
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("%w: manifest: %v", ErrCorrupt, err)
	}
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("%w: manifest of %s: %v", ErrCorrupt, m.Target(), err)
	}
	return &m, nil
}

func checkFormat(format string, version int, wantFormat string, oldest, newest int) error {
	if format != wantFormat {
		return fmt.Errorf("%w: format %q, want %q", ErrCorrupt, format, wantFormat)
	}
	if version < oldest || version > newest {
		return fmt.Errorf("%w: %s version %d is not supported by this ckptd (it reads versions %d to %d); use a ckptd release that supports it",
			ErrCorrupt, format, version, oldest, newest)
	}
	return nil
}

// checkAttempt requires an attempt in version 2 records and none in
// version 1.
func checkAttempt(version int, attempt string) error {
	if version == 1 && attempt != "" {
		return fmt.Errorf("version 1 has no attempt, found %q", attempt)
	}
	if version >= 2 && attempt == "" {
		return fmt.Errorf("version %d names no attempt", version)
	}
	return nil
}

func (m *Manifest) validate() error {
	if err := checkAttempt(m.Version, m.Attempt); err != nil {
		return err
	}
	if err := m.Target().validateStored(); err != nil {
		return err
	}
	size, err := validatePacked(m.Tensors)
	if err != nil {
		return err
	}
	for _, t := range m.Tensors {
		switch {
		case t.NonFinite < 0 || t.NonFinite > t.Length:
			return fmt.Errorf("tensor %q: %d non-finite values in %d bytes", t.Name, t.NonFinite, t.Length)
		case t.NonFinite > 0 && m.Version < ManifestVersionNonFinite:
			return fmt.Errorf("tensor %q: non-finite counts in a version %d manifest", t.Name, m.Version)
		}
	}
	if size != m.DataSize {
		return fmt.Errorf("tensors hold %d bytes but data_size is %d", size, m.DataSize)
	}
	stored, err := validateChunks(m.Chunks, m.DataSize)
	if err != nil {
		return err
	}
	for i, c := range m.Chunks {
		switch {
		case c.Key != "" && m.Version < ManifestVersionKeyed:
			return fmt.Errorf("chunk %d: a content key in a version %d manifest", i, m.Version)
		case c.Key != "":
			if err := codec.ParseKey(c.Key); err != nil {
				return fmt.Errorf("chunk %d: %w", i, err)
			}
		}
	}
	if stored != m.StoredSize {
		return fmt.Errorf("chunks store %d bytes but stored_size is %d", stored, m.StoredSize)
	}
	return nil
}

// validatePacked checks a manifest's tensor table: valid, unique names and
// dtypes, and tensors back to back from offset 0. It returns the total size.
func validatePacked(ts []Tensor) (int64, error) {
	seen := make(map[string]bool, len(ts))
	var off int64
	for i, t := range ts {
		if err := checkTensor(t, seen); err != nil {
			return 0, err
		}
		if t.Offset != off {
			return 0, fmt.Errorf("tensor %d (%q) at offset %d, want %d", i, t.Name, t.Offset, off)
		}
		var ok bool
		if off, ok = addInt64(off, t.Length); !ok {
			return 0, fmt.Errorf("tensor %d (%q): the tensors' total size overflows", i, t.Name)
		}
	}
	return off, nil
}

// checkTensor validates one table entry's name, dtype and length.
func checkTensor(t Tensor, seen map[string]bool) error {
	if err := ValidateName("tensor", t.Name); err != nil {
		return err
	}
	if seen[t.Name] {
		return fmt.Errorf("%w: tensor %q appears twice", ErrInvalid, t.Name)
	}
	seen[t.Name] = true
	if _, err := dtype.Parse(string(t.DType)); err != nil {
		return fmt.Errorf("%w: tensor %q: %v", ErrInvalid, t.Name, err)
	}
	n, err := t.DType.NumBytes(t.Shape)
	if err != nil {
		return fmt.Errorf("%w: tensor %q: %v", ErrInvalid, t.Name, err)
	}
	if n != t.Length {
		return fmt.Errorf("%w: tensor %q: %s%v needs %d bytes, length is %d", ErrInvalid, t.Name, t.DType, t.Shape, n, t.Length)
	}
	return nil
}

// validateChunks checks that chunks tile [0, dataSize) in order with sane
// sizes, codecs, hashes and object names; it returns the stored total.
func validateChunks(cs []Chunk, dataSize int64) (int64, error) {
	var raw, stored int64
	for i, c := range cs {
		if err := checkChunk(c); err != nil {
			return 0, fmt.Errorf("chunk %d: %w", i, err)
		}
		if c.RawOffset != raw {
			return 0, fmt.Errorf("chunk %d at raw offset %d, want %d", i, c.RawOffset, raw)
		}
		var okRaw, okStored bool
		raw, okRaw = addInt64(raw, c.Raw)
		stored, okStored = addInt64(stored, c.Stored)
		if !okRaw || !okStored {
			return 0, fmt.Errorf("chunk %d: the chunks' total size overflows", i)
		}
	}
	if raw != dataSize {
		return 0, fmt.Errorf("chunks cover %d bytes, data_size is %d", raw, dataSize)
	}
	return stored, nil
}

func checkChunk(c Chunk) error {
	if !strings.HasPrefix(c.Object, "steps/") {
		return fmt.Errorf("object %q is not under steps/", c.Object)
	}
	if err := storage.ValidName(c.Object); err != nil {
		return err
	}
	if c.Raw <= 0 || c.Raw > MaxChunkSize {
		return fmt.Errorf("raw length %d out of range (0, %d]", c.Raw, MaxChunkSize)
	}
	if _, ok := addInt64(c.Offset, c.Stored); !ok || c.Stored > 2*MaxChunkSize {
		return fmt.Errorf("stored range %d+%d out of range", c.Offset, c.Stored)
	}
	if _, err := codec.Parse(string(c.Codec)); err != nil {
		return err
	}
	if c.Codec == codec.None && c.Stored != c.Raw {
		return fmt.Errorf("codec none but stored %d != raw %d", c.Stored, c.Raw)
	}
	_, err := codec.ParseHash(c.Hash)
	return err
}

// CommitRecord is COMMIT.json: the proof a step is complete, naming the
// attempt whose ranks it holds and each rank's manifest, and a summary so
// that listing steps needs no manifest reads.
type CommitRecord struct {
	Format      string    `json:"format"`
	Version     int       `json:"version"`
	Job         string    `json:"job"`
	Step        int64     `json:"step"`
	Attempt     string    `json:"attempt,omitempty"` // version 2
	WorldSize   int       `json:"world_size"`
	Bytes       int64     `json:"bytes"`
	StoredBytes int64     `json:"stored_bytes"`
	CommittedAt time.Time `json:"committed_at"`
	// Manifests[r] is rank r's manifest (version 2).
	Manifests []ManifestRef `json:"manifests,omitempty"`
	// NonFinite is how many NaN and infinite values the step's tensors
	// hold, in NonFiniteTensors tensors, summed over the ranks' manifests:
	// a step of a run that diverged. Records written before the count
	// existed have none (and older readers ignore both).
	NonFinite        int64 `json:"nonfinite,omitempty"`
	NonFiniteTensors int   `json:"nonfinite_tensors,omitempty"`
}

// ManifestRef names one rank's manifest in a commit record: its object,
// relative to the job folder, and the hash of its bytes, so a manifest
// replaced after the commit is caught rather than trusted.
type ManifestRef struct {
	Object string `json:"object"`
	Hash   string `json:"hash"`
}

// ParseCommit decodes and validates a commit record.
func ParseCommit(b []byte) (*CommitRecord, error) {
	if len(b) > maxCommitBytes {
		return nil, fmt.Errorf("%w: commit record is %d bytes, more than %d", ErrCorrupt, len(b), maxCommitBytes)
	}
	var c CommitRecord
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("%w: commit record is not valid JSON: %v", ErrCorrupt, err)
	}
	if err := checkFormat(c.Format, c.Version, CommitFormat, 1, CommitVersion); err != nil {
		return nil, err
	}
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("%w: commit record: %v", ErrCorrupt, err)
	}
	return &c, nil
}

func (c *CommitRecord) validate() error {
	if err := checkAttempt(c.Version, c.Attempt); err != nil {
		return err
	}
	t := Target{Job: c.Job, Step: c.Step, WorldSize: c.WorldSize, Attempt: c.Attempt}
	if err := t.validateStored(); err != nil {
		return err
	}
	if c.NonFinite < 0 || c.NonFiniteTensors < 0 {
		return fmt.Errorf("%d non-finite values in %d tensors", c.NonFinite, c.NonFiniteTensors)
	}
	if c.Version == 1 {
		return nil
	}
	if len(c.Manifests) != c.WorldSize {
		return fmt.Errorf("%d manifests listed for a world size of %d", len(c.Manifests), c.WorldSize)
	}
	for rank, ref := range c.Manifests {
		// Exactly the canonical name: a record cannot send a reader
		// anywhere else in the store.
		if want := (Target{Step: c.Step, Attempt: c.Attempt, Rank: rank}).manifestObject(); ref.Object != want {
			return fmt.Errorf("rank %d's manifest is %q, want %q", rank, ref.Object, want)
		}
		if _, err := codec.ParseHash(ref.Hash); err != nil {
			return fmt.Errorf("rank %d's manifest hash: %v", rank, err)
		}
	}
	return nil
}

// manifestObject returns the object of rank's manifest and its expected
// hash ("" for version 1, which records none).
func (c *CommitRecord) manifestObject(rank int) (object, hash string) {
	if c.Version == 1 {
		return Target{Step: c.Step, Attempt: "", Rank: rank}.manifestObject(), ""
	}
	ref := c.Manifests[rank]
	return ref.Object, ref.Hash
}

// Pins reports whether the record names, for rank, the manifest whose
// Hash is hash (records before attempts pin none): a copy held in memory,
// a peer's above all, is served only when it is exactly what the step
// committed.
func (c *CommitRecord) Pins(rank int, hash string) bool {
	_, want := c.manifestObject(rank)
	return want == "" || want == hash
}
