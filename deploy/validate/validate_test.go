package validate

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
)

// repo is the repository root, from this package's folder.
const repo = "../.."

// ckptdBin builds ckptd once for the package's tests; TestMain removes it.
var ckptdBin = sync.OnceValues(func() (string, error) {
	bin := filepath.Join(os.TempDir(), fmt.Sprintf("ckptd-validate-%d", os.Getpid()))
	build := exec.Command("go", "build", "-o", bin, "./cmd/ckptd")
	build.Dir = repo
	if out, err := build.CombinedOutput(); err != nil {
		return string(out), err
	}
	return bin, nil
})

func TestMain(m *testing.M) {
	code := m.Run()
	if bin, err := ckptdBin(); err == nil {
		os.Remove(bin)
	}
	os.Exit(code)
}

var serveHelp = sync.OnceValues(func() (string, error) {
	bin, err := ckptdBin()
	if err != nil {
		return bin, err
	}
	out, err := exec.Command(bin, "serve", "--help").CombinedOutput()
	return string(out), err
})

// memoryNeeds runs `ckptd serve ARGS --print-memory`.
func memoryNeeds(t *testing.T, args []string) (arena, total int64) {
	t.Helper()
	bin, err := ckptdBin()
	if err != nil {
		t.Fatalf("build ckptd: %v\n%s", err, bin)
	}
	out, err := exec.Command(bin, append(append([]string{"serve"}, args...), "--print-memory")...).Output()
	if err != nil {
		t.Fatalf("ckptd serve --print-memory: %v", err)
	}
	var need struct {
		Arena int64 `json:"arena_bytes"`
		Hot   int64 `json:"hot_file_bytes"`
		Total int64 `json:"total_bytes"`
	}
	if err := json.Unmarshal(out, &need); err != nil {
		t.Fatalf("ckptd serve --print-memory: %v\n%s", err, out)
	}
	return need.Arena + need.Hot, need.Total
}

// checkFlags fails for every --flag in args that `ckptd serve` lacks.
func checkFlags(t *testing.T, where string, args []string) {
	t.Helper()
	help, err := serveHelp()
	if err != nil {
		t.Fatalf("ckptd serve --help: %v\n%s", err, help)
	}
	for _, a := range args {
		if !strings.HasPrefix(a, "--") {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.Contains(help, "--"+name+" ") {
			t.Errorf("%s passes --%s, which ckptd serve does not have", where, name)
		}
	}
}

// Every Pod under deploy/kubernetes, and every Job's pod, runs ckptd as a
// native sidecar beside its trainer, sharing memory-backed /dev/shm and
// socket folders, with probes and a memory limit that covers what its
// flags need.
func TestKubernetesPod(t *testing.T) {
	var pods int
	for _, m := range kubernetesManifests(t) {
		var spec *corev1.PodSpec
		switch obj := m.obj.(type) {
		case *corev1.Pod:
			spec = &obj.Spec
		case *batchv1.Job:
			spec = &obj.Spec.Template.Spec
		default:
			continue
		}
		pods++
		t.Run(m.String(), func(t *testing.T) { checkPod(t, spec) })
	}
	if pods == 0 {
		t.Fatal("no Pod under deploy/kubernetes")
	}
}

func checkPod(t *testing.T, spec *corev1.PodSpec) {
	if len(spec.InitContainers) != 1 || len(spec.Containers) != 1 {
		t.Fatal("want one sidecar (init container) and one trainer")
	}
	side, trainer := spec.InitContainers[0], spec.Containers[0]
	if side.RestartPolicy == nil || *side.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Error("the sidecar is not a native sidecar (restartPolicy: Always)")
	}
	if len(side.Args) == 0 || side.Args[0] != "serve" {
		t.Fatalf("sidecar args %v", side.Args)
	}
	checkFlags(t, "the pod", side.Args[1:])
	for _, probe := range []*corev1.Probe{side.StartupProbe, side.LivenessProbe, side.ReadinessProbe} {
		if probe == nil {
			t.Error("the sidecar lacks a probe")
		}
	}
	mounts := func(c corev1.Container) map[string]string {
		m := map[string]string{}
		for _, v := range c.VolumeMounts {
			m[v.Name] = v.MountPath
		}
		return m
	}
	sm, tm := mounts(side), mounts(trainer)
	for _, v := range spec.Volumes {
		if v.Secret != nil { // the peers' certificates: the sidecar's alone
			if sm[v.Name] == "" || tm[v.Name] != "" {
				t.Errorf("secret volume %s is not the sidecar's alone", v.Name)
			}
			continue
		}
		if v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumMemory {
			t.Errorf("volume %s is not a memory-backed emptyDir", v.Name)
		}
		if sm[v.Name] == "" || sm[v.Name] != tm[v.Name] {
			t.Errorf("volume %s is not mounted at one place in both containers", v.Name)
		}
	}
	if sm["dshm"] != "/dev/shm" {
		t.Error("the arena's /dev/shm is not shared")
	}
	checkSidecarSecurity(t, side, sm)
	for _, e := range trainer.Env {
		if e.Name == "CKPTD_SOCKET" && !slices.Contains(side.Args, "--socket="+e.Value) {
			t.Errorf("the trainer's CKPTD_SOCKET %s is not the sidecar's --socket", e.Value)
		}
	}
	arena, total := memoryNeeds(t, side.Args[1:])
	if limit := side.Resources.Limits.Memory(); limit.Value() < total {
		t.Errorf("the sidecar's memory limit %s is less than the %d bytes its flags need (ckptd serve --print-memory)", limit, total)
	}
	for _, v := range spec.Volumes {
		if v.Name == "dshm" && (v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.Value() < arena) {
			t.Errorf("/dev/shm's sizeLimit %v is less than the %d bytes of the arena and the hot tier's file", v.EmptyDir.SizeLimit, arena)
		}
	}
}

// checkSidecarSecurity checks what lets the sidecar lock its arena and
// the trainer trust its socket: IPC_LOCK as the only capability (effective
// only for uid 0: Kubernetes sets no ambient capabilities), the socket in
// a folder the daemon makes inside a volume (clients refuse a socket in a
// folder every user may write, as an emptyDir is), and a startup probe
// that does not wait on storage.
func checkSidecarSecurity(t *testing.T, side corev1.Container, mounts map[string]string) {
	t.Helper()
	sc := side.SecurityContext
	if sc == nil || sc.Capabilities == nil || sc.RunAsUser == nil {
		t.Fatal("the sidecar sets no user and capabilities")
	}
	if fmt.Sprint(sc.Capabilities.Add) != "[IPC_LOCK]" || fmt.Sprint(sc.Capabilities.Drop) != "[ALL]" || *sc.RunAsUser != 0 {
		t.Errorf("the sidecar adds %v, drops %v as uid %d; want only IPC_LOCK, as uid 0, to lock the arena",
			sc.Capabilities.Add, sc.Capabilities.Drop, *sc.RunAsUser)
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("the sidecar may escalate privileges or write its root file system")
	}
	socket := ""
	for _, a := range side.Args {
		if v, ok := strings.CutPrefix(a, "--socket="); ok {
			socket = v
		}
	}
	if socket == "" {
		t.Error("the sidecar passes no --socket")
	}
	for _, path := range mounts {
		if filepath.Dir(socket) == path {
			t.Errorf("the socket %s sits in the volume's own folder %s, which every user may write", socket, path)
		}
	}
	if p := side.StartupProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" {
		t.Error("the startup probe is not /healthz, which answers whether or not storage does")
	}
}

func TestSystemdAndSlurmFlags(t *testing.T) {
	unit, err := os.ReadFile("../systemd/ckptd.service")
	if err != nil {
		t.Fatal(err)
	}
	exec := regexp.MustCompile(`(?m)^ExecStart=((?:.*\\\n)*.*)$`).FindStringSubmatch(string(unit))
	if exec == nil {
		t.Fatal("no ExecStart")
	}
	args := strings.Fields(strings.ReplaceAll(exec[1], "\\\n", " "))
	if len(args) < 2 || args[1] != "serve" {
		t.Fatalf("ExecStart %v", args)
	}
	checkFlags(t, "the systemd unit", args[2:])
	checkSystemdUnit(t, string(unit), args[2:])

	script, err := os.ReadFile("../slurm/ckptd-sbatch.sh")
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`ckptd serve((?:.*\\\n)*.*)`).FindStringSubmatch(string(script))
	if line == nil {
		t.Fatal("the sbatch script starts no ckptd serve")
	}
	checkFlags(t, "the sbatch script", strings.Fields(strings.ReplaceAll(line[1], "\\\n", " ")))
}

// checkSystemdUnit checks what the unit promises beside its flags: the
// settings file it names (deploy/systemd/ckptd.yaml, installed as
// /etc/ckptd/ckptd.yaml) is one serve starts with, MemoryMax covers what
// those settings need, credentials come from an EnvironmentFile, and the
// arena outlives a stop (RemoveIPC=no) locked in memory.
func checkSystemdUnit(t *testing.T, unit string, args []string) {
	t.Helper()
	for i, a := range args {
		if a == "--config" && i+1 < len(args) && args[i+1] == "/etc/ckptd/ckptd.yaml" {
			args[i+1] = "../systemd/ckptd.yaml"
		}
	}
	// The group ckpt exists on the node, not here: the settings' memory
	// does not depend on it.
	_, total := memoryNeeds(t, append(args, "--socket-group="))
	setting := func(key string) string {
		m := regexp.MustCompile(`(?m)^` + key + `=(.*)$`).FindStringSubmatch(unit)
		if m == nil {
			t.Errorf("the unit sets no %s", key)
			return ""
		}
		return m[1]
	}
	maxMem := setting("MemoryMax")
	if gib, err := strconv.ParseInt(strings.TrimSuffix(maxMem, "G"), 10, 64); err != nil || !strings.HasSuffix(maxMem, "G") {
		t.Errorf("MemoryMax=%s: want whole GiB (NG)", maxMem)
	} else if gib<<30 < total {
		t.Errorf("MemoryMax=%s is less than the %d bytes (%.1f GiB) its settings need (ckptd serve --print-memory)",
			maxMem, total, float64(total)/(1<<30))
	}
	for key, want := range map[string]string{"RemoveIPC": "no", "LimitMEMLOCK": "infinity", "NoNewPrivileges": "yes"} {
		if got := setting(key); got != want {
			t.Errorf("%s=%s, want %s", key, got, want)
		}
	}
	if env := setting("EnvironmentFile"); !strings.HasPrefix(strings.TrimPrefix(env, "-"), "/etc/ckptd/") {
		t.Errorf("EnvironmentFile=%s: the credentials' file should sit beside the settings in /etc/ckptd", env)
	}
}

// The image's default command passes only flags serve has, its health
// check runs `ckptd health`, and both find the socket through
// CKPTD_SOCKET (so that moving it moves both).
func TestDockerfile(t *testing.T) {
	df, err := os.ReadFile(repo + "/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.ReplaceAll(string(df), "\\\n", " ")
	final := text[strings.LastIndex(text, "\nFROM "):] // the image's own stage
	cmd := regexp.MustCompile(`(?m)^CMD (\[.*\])$`).FindStringSubmatch(final)
	health := regexp.MustCompile(`(?m)^HEALTHCHECK .* CMD (\[.*\])$`).FindStringSubmatch(final)
	if cmd == nil || health == nil || !strings.Contains(final, "\nENV CKPTD_SOCKET=") {
		t.Fatalf("the final stage lacks a CMD, a HEALTHCHECK or ENV CKPTD_SOCKET:\n%s", final)
	}
	var args, probe []string
	if err := json.Unmarshal([]byte(cmd[1]), &args); err != nil || len(args) == 0 || args[0] != "serve" {
		t.Fatalf("CMD %s: %v", cmd[1], err)
	}
	checkFlags(t, "the Dockerfile's CMD", args[1:])
	if err := json.Unmarshal([]byte(health[1]), &probe); err != nil || len(probe) < 2 || probe[1] != "health" {
		t.Fatalf("HEALTHCHECK %s: %v", health[1], err)
	}
}

func TestScriptsParse(t *testing.T) {
	if out, err := exec.Command("bash", "-n", "../slurm/ckptd-sbatch.sh").CombinedOutput(); err != nil {
		t.Fatalf("bash -n: %v\n%s", err, out)
	}
}

// The dashboard queries only metrics the daemon defines.
func TestGrafanaDashboard(t *testing.T) {
	data, err := os.ReadFile("../grafana/ckptd-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(data, &dash); err != nil || len(dash.Panels) == 0 {
		t.Fatalf("not a dashboard: %v", err)
	}
	defined := map[string]bool{}
	names := regexp.MustCompile(`Name: +"(ckptd_[a-z_]+)"`)
	err = filepath.WalkDir(repo, func(p string, d os.DirEntry, err error) error {
		switch {
		case err != nil:
			return err
		case d.IsDir() && strings.HasPrefix(d.Name(), ".") && p != repo:
			return filepath.SkipDir
		case d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go"):
			return nil
		}
		src, err := os.ReadFile(p)
		for _, m := range names.FindAllStringSubmatch(string(src), -1) {
			for _, suffix := range []string{"", "_bucket", "_sum", "_count"} {
				defined[m[1]+suffix] = true
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(defined) == 0 {
		t.Fatal("found no metric definitions")
	}
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			for _, name := range regexp.MustCompile(`ckptd_[a-z_]+`).FindAllString(tg.Expr, -1) {
				if !defined[name] {
					t.Errorf("panel %q queries %s, which ckptd does not export", p.Title, name)
				}
			}
		}
	}
}
