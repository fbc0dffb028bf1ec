package validate

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// kubernetesDir holds the Kubernetes examples: every YAML file below it,
// and every document in each, is checked.
const kubernetesDir = "../kubernetes"

// kubernetesVersion is the release the manifests are validated against:
// native sidecars (init containers with restartPolicy Always) need 1.29,
// and 1.30 is the newest whose schemas kubectl-validate v0.0.4 embeds (a
// newer one would be fetched from GitHub).
const kubernetesVersion = "1.30"

// kinds are the API types a manifest may be; a document of another kind
// fails the test until its type is added here, so that none goes unchecked.
var kinds = map[schema.GroupVersionKind]func() any{
	corev1.SchemeGroupVersion.WithKind("Pod"):            func() any { return &corev1.Pod{} },
	corev1.SchemeGroupVersion.WithKind("ConfigMap"):      func() any { return &corev1.ConfigMap{} },
	corev1.SchemeGroupVersion.WithKind("Service"):        func() any { return &corev1.Service{} },
	corev1.SchemeGroupVersion.WithKind("ServiceAccount"): func() any { return &corev1.ServiceAccount{} },
	batchv1.SchemeGroupVersion.WithKind("Job"):           func() any { return &batchv1.Job{} },
}

// manifest is one YAML document of a file under deploy/kubernetes,
// decoded strictly into its API type.
type manifest struct {
	file  string
	index int // of the document in its file, from 0
	obj   any
}

func (m manifest) String() string { return fmt.Sprintf("%s#%d", filepath.Base(m.file), m.index) }

// kubernetesManifests reads every document of every YAML file under
// deploy/kubernetes. Each must decode strictly (no unknown or misspelled
// field, no value of the wrong type, quantities that parse) into the type
// its apiVersion and kind name.
func kubernetesManifests(t *testing.T) []manifest {
	t.Helper()
	var out []manifest
	for _, file := range kubernetesFiles(t) {
		docs, err := yamlDocuments(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docs {
			m := manifest{file: file, index: i}
			obj, err := decodeStrict(doc)
			if err != nil {
				t.Fatalf("%s: %v", m, err)
			}
			m.obj = obj
			out = append(out, m)
		}
	}
	return out
}

// kubernetesFiles lists the YAML files under deploy/kubernetes.
func kubernetesFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(kubernetesDir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && (strings.HasSuffix(p, ".yaml") || strings.HasSuffix(p, ".yml")) {
			files = append(files, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no YAML files under %s", kubernetesDir)
	}
	return files
}

// yamlDocuments splits a file into its YAML documents, leaving out those
// that hold nothing but comments.
func yamlDocuments(file string) ([][]byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := k8syaml.NewYAMLReader(bufio.NewReader(f))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, fmt.Errorf("%s: document %d: %w", file, len(docs), err)
		}
		if !bytes.Equal(bytes.TrimSpace(j), []byte("null")) {
			docs = append(docs, doc)
		}
	}
}

// decodeStrict decodes a document into the API type it names.
func decodeStrict(doc []byte) (any, error) {
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	gv, err := schema.ParseGroupVersion(tm.APIVersion)
	if err != nil {
		return nil, err
	}
	newObj, ok := kinds[gv.WithKind(tm.Kind)]
	if !ok {
		return nil, fmt.Errorf("apiVersion %q kind %q: not a type this test knows; add it to kinds", tm.APIVersion, tm.Kind)
	}
	obj := newObj()
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return nil, fmt.Errorf("not a valid %s: %w", tm.Kind, err)
	}
	return obj, nil
}

// Every document is of a known type and decodes strictly (see
// kubernetesManifests).
func TestKubernetesManifestsDecode(t *testing.T) {
	if len(kubernetesManifests(t)) == 0 {
		t.Fatal("no manifests under deploy/kubernetes")
	}
}

// kubectlValidate is the schema validator: $KUBECTL_VALIDATE, else the
// one scripts/tools.sh installs.
func kubectlValidate(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("KUBECTL_VALIDATE")
	if bin == "" {
		bin = filepath.Join(repo, ".tools/bin/kubectl-validate")
	}
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("kubectl-validate: %v (make test-deploy installs it)", err)
		}
		t.Skipf("kubectl-validate: %v; run scripts/tools.sh go, or make test-deploy", err)
	}
	return bin
}

// validationResult is kubectl-validate's JSON answer for one document: a
// Kubernetes Status.
type validationResult struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

// runValidator validates files against the Kubernetes API's OpenAPI
// schemas (required fields, types, unknown fields), offline, and
// returns the results by file.
func runValidator(t *testing.T, files ...string) (map[string][]validationResult, error) {
	t.Helper()
	cmd := exec.Command(kubectlValidate(t), append([]string{"--version", kubernetesVersion, "--output", "json"}, files...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	runErr := cmd.Run()
	results := map[string][]validationResult{}
	if err := json.Unmarshal(stdout.Bytes(), &results); err != nil {
		t.Fatalf("kubectl-validate: %v; its output is not JSON: %v\n%s%s", runErr, err, stdout.String(), stderr.String())
	}
	return results, runErr
}

// Every document of every file under deploy/kubernetes passes a schema
// validator for a release with native sidecars.
func TestKubernetesSchemas(t *testing.T) {
	files := kubernetesFiles(t)
	results, err := runValidator(t, files...)
	for _, file := range files {
		docs, derr := yamlDocuments(file)
		if derr != nil {
			t.Fatal(derr)
		}
		got := results[file]
		if len(got) < len(docs) {
			t.Errorf("%s: kubectl-validate checked %d documents of %d", file, len(got), len(docs))
		}
		for i, r := range got {
			if r.Status != "Success" {
				t.Errorf("%s#%d: %s", file, i, r.Message)
			}
		}
	}
	if err != nil && !t.Failed() {
		t.Fatalf("kubectl-validate failed: %v (%v)", err, results)
	}
}

// The validator is not a formality: it refuses what the strict decoding
// into API types lets through, in any document of a file.
func TestKubernetesSchemasRefuse(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	// A second document, a Pod without containers: every field it has is
	// right, so it decodes, but the schema requires spec.containers.
	doc := "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: empty\nspec:\n  restartPolicy: Never\n"
	good, err := os.ReadFile(filepath.Join(kubernetesDir, "ckptd-pod.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, append(good, doc...), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := decodeStrict([]byte(doc)); err != nil {
		t.Fatalf("the bad document does not even decode: %v", err)
	}
	results, err := runValidator(t, bad)
	got := results[bad]
	if err == nil || len(got) != 2 || got[0].Status != "Success" || got[1].Status != "Failure" ||
		!strings.Contains(got[1].Message, "spec.containers") {
		t.Fatalf("kubectl-validate on a Pod without containers after a good one: %v %+v", err, got)
	}
}
