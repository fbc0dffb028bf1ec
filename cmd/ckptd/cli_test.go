package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ckptd/ckptd/checkpoint"
	"github.com/ckptd/ckptd/checkpoint/dtype"
	"github.com/ckptd/ckptd/storage/posix"
)

func TestParseBytes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"1073741824", 1 << 30, true}, {"1GiB", 1 << 30, true}, {"512MiB", 512 << 20, true},
		{"4k", 4096, true}, {"2G", 2 << 30, true}, {"1.5GiB", 3 << 29, true}, {"10MB", 10e6, true},
		{"", 0, false}, {"-1", 0, false}, {"lots", 0, false}, {"1e30", 0, false},
	} {
		got, err := parseBytes(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseBytes(%q) = %d, %v", tc.in, got, err)
		}
	}
}

// Command line beats environment beats config file.
func TestConfigPrecedence(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "ckptd.yaml")
	if err := os.WriteFile(cfg, []byte("job: fromfile\ncodec: lz4\nstaging-bytes: 2GiB\nstorage: /from/file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CKPTD_CODEC", "none")
	t.Setenv("CKPTD_STAGING_BYTES", "3GiB")
	cmd := newServeCmd()
	cmd.Flags().String("config", "", "") // normally a persistent flag of the root
	if err := cmd.ParseFlags([]string{"--config", cfg, "--staging-bytes", "4GiB"}); err != nil {
		t.Fatal(err)
	}
	if err := applyConfig(cmd); err != nil {
		t.Fatal(err)
	}
	get := func(name string) string { return cmd.Flags().Lookup(name).Value.String() }
	if get("staging-bytes") != "4GiB" || get("codec") != "none" || get("job") != "fromfile" || get("storage") != "/from/file" {
		t.Fatalf("staging-bytes %s codec %s job %s storage %s", get("staging-bytes"), get("codec"), get("job"), get("storage"))
	}
}

// A config file may nest keys under their flag group, as serve --help
// groups them; a key named like a group with a value that is not a
// mapping is the flag (storage, peers); one given twice is refused.
func TestConfigGroups(t *testing.T) {
	for _, tc := range []struct {
		yaml, err string
		want      map[string]string
	}{
		{"storage:\n  storage: /s\n  job: j\nstaging:\n  staging-bytes: 2GiB\npeers: [a:1, b:2]\n", "",
			map[string]string{"storage": "/s", "job": "j", "staging-bytes": "2GiB", "peers": "[a:1,b:2]"}},
		{"storage: /flat\ntiers:\n  hot-bytes: 64MiB\n", "", map[string]string{"storage": "/flat", "hot-bytes": "64MiB"}},
		{"job: a\nstorage:\n  job: b\n", `key "job" is given twice`, nil},
	} {
		cfg := filepath.Join(t.TempDir(), "ckptd.yaml")
		if err := os.WriteFile(cfg, []byte(tc.yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := newServeCmd()
		cmd.Flags().String("config", "", "")
		if err := cmd.ParseFlags([]string{"--config", cfg}); err != nil {
			t.Fatal(err)
		}
		err := applyConfig(cmd)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: %v, want %q", tc.yaml, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%q: %v", tc.yaml, err)
		}
		for name, want := range tc.want {
			if got := cmd.Flags().Lookup(name).Value.String(); got != want {
				t.Errorf("%q: --%s = %s, want %s", tc.yaml, name, got, want)
			}
		}
	}
}

// serve --help lists every flag under a group heading, within 100
// columns, byte sizes in binary units.
func TestServeHelpGrouped(t *testing.T) {
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"serve", "--help"})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	help := out.String()
	for _, g := range flagGroups {
		if !strings.Contains(help, "\n"+g.title+":\n") {
			t.Errorf("no %q heading", g.title)
		}
	}
	if strings.Contains(help, "Other flags:") {
		t.Errorf("serve flags outside every group:\n%s", help[strings.Index(help, "Other flags:"):])
	}
	for line := range strings.Lines(help) {
		if len(strings.TrimRight(line, "\n")) > helpColumns {
			t.Errorf("line of %d columns: %q", len(line), line)
		}
	}
	for _, w := range []string{"(default 1GiB)", "(default 256MiB)", "(default 4MiB)"} {
		if !strings.Contains(help, w) {
			t.Errorf("help lacks %q", w)
		}
	}
}

// A key that names no flag is a usage error naming it: flags are spelled
// with dashes, and staging_bytes used to be ignored without a word. A key
// of another command is fine (one file may serve them all).
func TestConfigUnknownKey(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want []string // in the error; nil: no error
	}{
		{"staging_bytes: 2GiB\n", []string{`unknown key "staging_bytes"`, `did you mean "staging-bytes"?`}},
		{"Socket_Group: 5\nstorage: /x\n", []string{`"Socket_Group" (did you mean "socket-group"?`}},
		{"stagin-bytes: 1\nbogus: 2\n", []string{`unknown keys "bogus", "stagin-bytes"`, `the keys of "ckptd serve" are: `, "staging-bytes, staging-wait, storage"}},
		{"staging-bytes: 2GiB\nkeep-last: 3\nlog-level: debug\n", nil},
	} {
		cfg := filepath.Join(t.TempDir(), "ckptd.yaml")
		if err := os.WriteFile(cfg, []byte(tc.yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		root := newRootCmd()
		var serve *cobra.Command
		for _, c := range root.Commands() {
			if c.Name() == "serve" {
				serve = c
			}
		}
		serve.RunE = func(*cobra.Command, []string) error { return nil } // only the config is under test
		root.SetArgs([]string{"serve", "--config", cfg})
		err := root.Execute()
		if tc.want == nil {
			if err != nil {
				t.Errorf("%q: %v", tc.yaml, err)
			}
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(fmtErr(err), w) {
				t.Errorf("%q: error %q lacks %q", tc.yaml, fmtErr(err), w)
			}
		}
		if exitCode(err) != 2 {
			t.Errorf("%q: exit code %d, want 2", tc.yaml, exitCode(err))
		}
	}
}

// writeStep saves a one-rank step 1 of job "j" under root.
func writeStep(t *testing.T, root string) []byte {
	t.Helper()
	b, err := posix.New(root)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	data := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	l, err := checkpoint.NewLayout([]checkpoint.Tensor{{Name: "w", DType: dtype.U8, Shape: []int64{int64(len(data))}, Length: int64(len(data))}})
	if err != nil {
		t.Fatal(err)
	}
	w, err := checkpoint.NewWriter(b, checkpoint.WriterOptions{ChunkSize: 256 << 10})
	if err != nil {
		t.Fatal(err)
	}
	sh := &checkpoint.Shard{Target: checkpoint.Target{Job: "j", Step: 1, WorldSize: 1, Attempt: "a"}, Layout: l, Data: data, Metadata: []byte("m")}
	if _, err := w.WriteShard(context.Background(), sh); err != nil {
		t.Fatal(err)
	}
	store, err := checkpoint.NewStore(b, "j")
	if err != nil {
		t.Fatal(err)
	}
	if rec, _, err := store.TryCommit(context.Background(), 1, "a", 1); rec == nil || err != nil {
		t.Fatalf("commit: %v %v", rec, err)
	}
	return data
}

func TestRestoreAndList(t *testing.T) {
	root := t.TempDir()
	writeStep(t, root)
	so := storageOptions{URL: root, Job: "j"}
	var out bytes.Buffer
	if err := runList(context.Background(), &listOptions{storageOptions: so, JSON: true}, &out); err != nil {
		t.Fatal(err)
	}
	var steps []stepJSON
	if err := json.Unmarshal(out.Bytes(), &steps); err != nil || len(steps) != 1 || steps[0].Step != 1 {
		t.Fatalf("list --json: %s %v", out.String(), err)
	}
	dir := filepath.Join(t.TempDir(), "out")
	if err := runRestore(context.Background(), &restoreOptions{storageOptions: so, stepChoice: stepChoice{Latest: true}, Out: dir, Rank: -1}, &out); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"rank-00000.safetensors", "metadata.json"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Error(err)
		}
	}
	err := runRestore(context.Background(), &restoreOptions{storageOptions: so, stepChoice: stepChoice{Step: 2}, Out: dir, Rank: -1}, &out)
	if !errors.Is(err, checkpoint.ErrStepNotFound) || !strings.Contains(err.Error(), "latest committed step: 1") {
		t.Fatalf("unknown step: %v", err)
	}
	err = runRestore(context.Background(), &restoreOptions{storageOptions: so, stepChoice: stepChoice{Step: 1}, Out: dir, Rank: 3}, &out)
	if !strings.Contains(fmtErr(err), "--rank 3 out of range") || exitCode(err) != 2 {
		t.Fatalf("bad rank: %v", err)
	}
}

func fmtErr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// A corrupt chunk fails the restore naming step, rank and chunk, and
// leaves nothing in --out that could pass for a checkpoint.
func TestRestoreCorrupt(t *testing.T) {
	root := t.TempDir()
	writeStep(t, root)
	data := filepath.Join(root, "j/steps/000000000001/a/rank-00000.data")
	f, err := os.OpenFile(data, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := f.Stat()
	if _, err := f.WriteAt([]byte("garbage!"), fi.Size()-100); err != nil {
		t.Fatal(err)
	}
	f.Close()
	dir := t.TempDir()
	so := storageOptions{URL: root, Job: "j"}
	err = runRestore(context.Background(), &restoreOptions{storageOptions: so, stepChoice: stepChoice{Step: 1}, Out: dir, Rank: -1}, &bytes.Buffer{})
	if !errors.Is(err, checkpoint.ErrCorrupt) || !strings.Contains(err.Error(), "step 1 rank 0 chunk ") {
		t.Fatalf("corrupt restore: %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("restore left %v in --out", ents)
	}
	err = runVerify(context.Background(), &verifyOptions{storageOptions: so, Latest: true}, &bytes.Buffer{})
	if !errors.Is(err, checkpoint.ErrCorrupt) {
		t.Fatalf("verify: %v", err)
	}
}

func TestBadStorageURL(t *testing.T) {
	so := storageOptions{URL: "ftp://host/x", Job: "j"}
	err := runList(context.Background(), &listOptions{storageOptions: so}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "unsupported scheme") {
		t.Fatalf("ftp: %v", err)
	}
	so = storageOptions{URL: t.TempDir(), Job: "a/../b"}
	if err := runList(context.Background(), &listOptions{storageOptions: so}, &bytes.Buffer{}); exitCode(err) != 2 {
		t.Fatalf("bad job: %v", err)
	}
}

// Readers never create storage: a mistyped path is an error, not a new
// empty folder.
func TestReadersDoNotCreateStorage(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "typo")
	err := runList(context.Background(), &listOptions{storageOptions: storageOptions{URL: missing, Job: "j"}}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "no such folder") {
		t.Fatalf("list of a missing folder: %v", err)
	}
	if _, err := os.Stat(missing); !os.IsNotExist(err) {
		t.Fatalf("list created %s", missing)
	}
}

// Every command takes --file-mode; a mode that would let others write, or
// is not a mode, is a usage error, and a valid one reaches the store.
func TestFileModeFlag(t *testing.T) {
	for _, cmd := range []string{"serve", "restore", "list", "verify", "prune"} {
		for _, mode := range []string{"0666", "0755", "4640", "rw-r--r--"} {
			root := newRootCmd()
			root.SetArgs([]string{cmd, "--file-mode", mode})
			root.SetOut(io.Discard)
			err := root.ExecuteContext(t.Context())
			if exitCode(err) != 2 || !strings.Contains(fmtErr(err), "invalid file mode") {
				t.Errorf("%s --file-mode %s: %v (exit %d), want a usage error", cmd, mode, err, exitCode(err))
			}
		}
	}
	dir := t.TempDir()
	var so storageOptions
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	so.register(fs)
	if got := fs.Lookup("file-mode").DefValue; got != "0640" {
		t.Errorf("--file-mode defaults to %s, want 0640", got)
	}
	if err := fs.Parse([]string{"--storage", dir, "--file-mode", "644"}); err != nil {
		t.Fatal(err)
	}
	b, err := so.open(t.Context(), true)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Put(t.Context(), "j/x/obj", bytes.NewReader(nil), 0); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{"j/x": 0o755, "j/x/obj": 0o644} {
		if fi, err := os.Stat(filepath.Join(dir, p)); err != nil || fi.Mode().Perm() != want {
			t.Errorf("%s: %v, %v; want mode %v", p, fi.Mode(), err, want)
		}
	}
}

// A mistyped subcommand is a usage error (exit 2), and --version answers.
func TestUnknownCommandAndVersion(t *testing.T) {
	root := newRootCmd()
	root.SetArgs([]string{"lsit"})
	root.SetOut(io.Discard)
	if err := root.Execute(); exitCode(err) != 2 || !strings.Contains(err.Error(), `unknown command "lsit"`) {
		t.Fatalf("mistyped command: %v (exit %d)", err, exitCode(err))
	}
	var out bytes.Buffer
	root = newRootCmd()
	root.SetArgs([]string{"--version"})
	root.SetOut(&out)
	if err := root.Execute(); err != nil || !strings.Contains(out.String(), "ckptd version ") {
		t.Fatalf("--version: %v %q", err, out.String())
	}
}

// --nice outside 0-19 is a usage error, before anything starts.
func TestNiceFlag(t *testing.T) {
	for _, n := range []string{"-1", "20", "99"} {
		root := newRootCmd()
		root.SetArgs([]string{"serve", "--nice", n, "--socket", filepath.Join(t.TempDir(), "s.sock")})
		root.SetOut(io.Discard)
		err := root.ExecuteContext(t.Context())
		if exitCode(err) != 2 || !strings.Contains(fmtErr(err), "--nice") {
			t.Errorf("serve --nice %s: %v (exit %d), want a usage error naming --nice", n, err, exitCode(err))
		}
	}
}

// --print-memory counts the datasets' terms only when datasets can be
// opened: not without --dataset-allow, nor with --dataset-arena-bytes 0,
// which with --dataset-allow is a usage error.
func TestPrintMemoryDatasets(t *testing.T) {
	needs := func(args ...string) (map[string]int64, error) {
		root := newRootCmd()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetArgs(append([]string{"serve", "--staging-bytes", "16GiB", "--print-memory"}, args...))
		if err := root.Execute(); err != nil {
			return nil, err
		}
		var n map[string]int64
		if err := json.Unmarshal(out.Bytes(), &n); err != nil {
			t.Fatalf("%v: %v\n%s", args, err, out.String())
		}
		return n, nil
	}
	off, err := needs()
	if err != nil || off["dataset_ceiling_bytes"] != 0 {
		t.Fatalf("no --dataset-allow: %v %v", off, err)
	}
	on, err := needs("--dataset-allow", "/data")
	if err != nil || on["dataset_ceiling_bytes"] == 0 || on["total_bytes"] != off["total_bytes"]+on["dataset_ceiling_bytes"] {
		t.Fatalf("with --dataset-allow: %v %v (without: %v)", on, err, off)
	}
	if zero, err := needs("--dataset-arena-bytes", "0"); err != nil || zero["dataset_ceiling_bytes"] != 0 {
		t.Fatalf("--dataset-arena-bytes 0: %v %v", zero, err)
	}
	if _, err := needs("--dataset-arena-bytes", "0", "--dataset-allow", "/data"); exitCode(err) != 2 || !strings.Contains(fmtErr(err), "turns datasets off") {
		t.Fatalf("--dataset-arena-bytes 0 with --dataset-allow: %v", err)
	}
}
