package layering

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/ckptd/ckptd/"

// core are the trees that must stay free of transport and internal code.
var core = []string{"checkpoint", "prefetch", "storage"}

// forbidden reports why a core package may not import path, or "".
func forbidden(path string) string {
	switch {
	case strings.HasPrefix(path, "google.golang.org/grpc"),
		strings.HasPrefix(path, "google.golang.org/protobuf"),
		strings.HasPrefix(path, "google.golang.org/genproto"),
		strings.HasPrefix(path, "github.com/golang/protobuf"),
		strings.HasPrefix(path, module+"proto"):
		return "gRPC or protobuf"
	case strings.HasPrefix(path, module+"internal/"):
		return "an internal/ package"
	}
	return ""
}

type pkg struct {
	ImportPath string
	Imports    []string
	Module     *struct{ Path string }
}

// TestCoreImportsNoTransport fails when a package of the module that a
// core package depends on (the core packages themselves included) imports
// gRPC, protobuf or internal/ directly. Third-party dependencies may use
// protobuf inside (the Prometheus client does); the core's own code may not.
func TestCoreImportsNoTransport(t *testing.T) {
	args := []string{"list", "-deps", "-json=ImportPath,Imports,Module"}
	for _, c := range core {
		args = append(args, module+c+"/...")
	}
	out, err := exec.Command("go", args...).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	seen := 0
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if p.Module == nil || p.Module.Path+"/" != module {
			continue
		}
		seen++
		for _, imp := range p.Imports {
			if why := forbidden(imp); why != "" {
				t.Errorf("%s imports %s (%s): the core must not", p.ImportPath, imp, why)
			}
		}
	}
	if seen < len(core) {
		t.Fatalf("go list found %d packages of the module; expected the core trees", seen)
	}
}
