// Package checkpoint is ckptd's checkpoint format and the operations on
// it: it validates shards, writes them to a storage.Backend as compressed,
// hashed chunks, commits steps, and lists, verifies, reads and prunes them.
// It is all that `ckptd restore`, `export`, `list`, `verify` and `prune`
// need, with no daemon running. The daemon's runtime (leases on the arena,
// the drain, save states, restores into the arena) is package staging,
// which calls into this one. It knows nothing of gRPC.
//
// # Storage layout
//
// Under a store's root, each job owns a folder (see attemptDir). Every save
// names its attempt: one run of the job, shared by all its ranks and
// different for the next run, so that a step never mixes the ranks of two
// runs:
//
//	<job>/steps/<step, 12 digits>/<attempt>/rank-<rank, 5 digits>.data   chunk data
//	<job>/steps/<step>/<attempt>/rank-<rank>.manifest.json               per-rank manifest
//	<job>/steps/<step>/<attempt>/group-<first rank, 5 digits>.json       group summary (over 100 ranks)
//	<job>/steps/spread-<hh>/<step>/<attempt>/rank-<rank>.data            chunk data instead (WriterOptions.SpreadData)
//	<job>/steps/<step>/COMMIT.json                                       written last
//	<job>/pins/<base step>/<step>-<attempt>-<rank>                       an incremental save relies on base (empty)
//	<job>/prune/<id>                                                     a prune or DeleteStep is running (empty)
//
// Steps written before attempts existed (format 1) keep their rank objects
// in the step folder itself; they are read as before.
//
// A rank's .data object is its chunks' stored bytes back to back. Chunks
// are cut from the shard's tensor data laid out back to back in tensor
// order (the "data space", which is also a safetensors file's data section):
// a chunk never mixes dtypes, small tensors of one dtype share a chunk, and
// a large tensor is split at element boundaries every ChunkSize bytes.
//
// # Manifest (format "ckptd.manifest", version 2)
//
// JSON, one per rank:
//
//	{
//	  "format": "ckptd.manifest", "version": 2,
//	  "job": "llama", "step": 9000, "rank": 0, "world_size": 8,
//	  "attempt": "slurm-4242-0",          // absent in version 1
//	  "created": "2026-11-29T14:00:00Z",
//	  "data_size": 1073741824,          // bytes of tensor data (data space)
//	  "stored_size": 912345678,         // bytes of chunk data stored
//	  "tensors": [{"name": "w", "dtype": "BF16", "shape": [4096, 4096],
//	               "offset": 0, "length": 33554432}],  // in data space
//	  "chunks": [{"object": "steps/000000009000/slurm-4242-0/rank-00000.data",
//	              "offset": 0, "stored": 3000000,   // where in the object
//	              "raw_offset": 0, "raw": 4194304,  // where in data space
//	              "codec": "float-bf16", "hash": "xxh3:0123456789abcdef"}],
//	  "metadata": "<base64 of the trainer's opaque bytes>"
//	}
//
// Version 3 is version 2 whose tensors may carry "nonfinite": how many NaN
// and infinite values the drain counted in the tensor (each part of a
// complex value). It is written only when some tensor holds any, so that
// a manifest of finite tensors stays readable by a ckptd that knows
// version 2 only.
//
// Version 4 is version 3 whose chunks carry "key": the content key of
// their raw bytes (codec.Key, "xxh3-128:" and 32 hex digits). Incremental
// saves (WriterOptions.Incremental) write it for every chunk, and a chunk
// whose key, raw length and hash equal one of the base step's is the base's
// chunk (its object, offset, stored length and codec) at the new raw
// offset. The pins and prune markers that keep prune from taking a base a
// save in flight relies on are described in incremental.go.
//
// # Commit record (format "ckptd.commit", version 2)
//
//	{
//	  "format": "ckptd.commit", "version": 2,
//	  "job": "llama", "step": 9000, "attempt": "slurm-4242-0", "world_size": 8,
//	  "bytes": 8589934592, "stored_bytes": 7298765424, "committed_at": "...",
//	  "manifests": [{"object": "steps/000000009000/slurm-4242-0/rank-00000.manifest.json",
//	                 "hash": "xxh3:..."}, ...],  // one per rank, in rank order
//	  "nonfinite": 6, "nonfinite_tensors": 3     // optional: the manifests' counts summed
//	}
//
// Readers use exactly the manifests it names, and check each one's hash:
// a manifest replaced after the commit is corrupt, not trusted. Version 1
// has no attempt and no manifest list (the manifests are in the step
// folder).
//
// Chunk objects are relative to the job's folder, so a chunk may point into
// an earlier step's object (incremental checkpoints); that is why Prune is
// reference-aware. The hash is of the raw (decompressed) bytes. A chunk's
// codec is what it was written with (package checkpoint/codec documents
// each: none, zstd, lz4, float-bf16, float-f16, float-f32, float-f64), never
// "auto". A tensor's dtype is one of package checkpoint/dtype's names (the
// safetensors spellings, and ckptd's own for the dtypes safetensors has no
// name for: C128, C32, BCOMPLEX32, FLOAT4_E2M1FN_X2, BITS8, UINT4, ...).
// Readers reject any other format name or a version they do not know.
//
// # Commit
//
// After writing a rank's data and manifest, a sidecar lists the manifests
// of the rank's group of 100 in its attempt's folder of the step (names
// sharing "rank-NNN"; Store.TryCommitRank). In a step of up to 100 ranks,
// once world_size manifests of that attempt are there it creates
// COMMIT.json with storage.Backend.PutIfAbsent. In a larger one, the
// sidecar that finds its group whole writes the group's summary
// ("ckptd.group", JSON: job, step, attempt, world_size, first_rank, the
// group's manifests as the commit record names them, their bytes,
// stored_bytes and non-finite counts), then lists the summaries and,
// finding every group's, commits the step from them (group.go). Waiters
// that commit a stuck step (below) read every manifest instead. Manifests of other
// attempts never count, whatever their world size. Several sidecars
// sharing one store commit a step exactly once with no coordinator: the
// manifest that completes a group is always followed by a listing that
// sees the group whole, so the last one written is followed by a listing
// of every rank, and the conditional create picks one winner, whichever
// attempt it is. Ranks waiting for the commit read COMMIT.json and commit
// the step themselves only when it stays uncommitted long after it could
// have been (Store.PollCommit). A save whose step another attempt committed fails (ALREADY_EXISTS,
// naming that attempt) and its objects are removed. Readers ignore steps
// without COMMIT.json, so a crash at any point leaves the previous
// committed step restorable; `ckptd prune` removes what no commit record
// names.
//
// Listing a job's steps reads the step folders (storage.Backend.ListDirs,
// a delimiter listing on S3) and one COMMIT.json per step, never the
// objects inside the folders, so `ckptd list` and --latest stay cheap on a
// store holding thousands of ranks per step.
package checkpoint
