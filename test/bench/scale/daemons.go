package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ckptd/ckptd/clients/go/ckptd"
)

// daemon is one `ckptd serve` process.
type daemon struct {
	socket, arena string
	cmd           *exec.Cmd
	exited        chan struct{}
	log           *os.File
}

// startDaemons starts n daemons of job on storage, with env added to
// theirs, and waits until each answers (its storage included).
func startDaemons(cfg config, work string, n int, storage, job string, env []string) ([]*daemon, error) {
	var ds []*daemon
	for i := range n {
		d, err := startDaemon(cfg, work, i, storage, job, env)
		if err != nil {
			stopDaemons(ds)
			return nil, err
		}
		ds = append(ds, d)
	}
	for _, d := range ds {
		if err := d.waitReady(time.Minute); err != nil {
			stopDaemons(ds)
			return nil, err
		}
	}
	return ds, nil
}

func startDaemon(cfg config, work string, i int, storage, job string, env []string) (*daemon, error) {
	dir := filepath.Join(work, fmt.Sprintf("%s-d%d", job, i))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	d := &daemon{
		socket: filepath.Join(dir, "ckptd.sock"),
		arena:  fmt.Sprintf("/dev/shm/ckptd-scale-%d-%s-%d", os.Getpid(), job, i),
		exited: make(chan struct{}),
	}
	log, err := os.Create(filepath.Join(dir, "serve.log"))
	if err != nil {
		return nil, err
	}
	d.log = log
	args := []string{"serve", "--socket", d.socket, "--storage", storage, "--arena-dir", d.arena, "--job", job,
		"--staging-bytes", "64MiB", "--codec", "none", "--nice", "0", "--log-level", "warn"}
	d.cmd = exec.Command(cfg.bin, append(args, cfg.serveArgs...)...)
	d.cmd.Env = append(cleanEnv(), env...)
	d.cmd.Stdout, d.cmd.Stderr = log, log
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := d.cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	go func() { _ = d.cmd.Wait(); close(d.exited) }()
	return d, nil
}

func (d *daemon) waitReady(limit time.Duration) error {
	c, err := ckptd.Dial(d.socket)
	if err != nil {
		return err
	}
	defer c.Close()
	deadline := time.Now().Add(limit)
	for {
		select {
		case <-d.exited:
			return fmt.Errorf("ckptd serve exited at start; its log: %s", d.log.Name())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := c.Health(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ckptd serve on %s not ready after %v: %w", d.socket, limit, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop ends the daemon with SIGTERM (SIGKILL after a while) and removes
// its arena.
func (d *daemon) stop() {
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(30 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.exited
	}
	d.log.Close()
	os.RemoveAll(d.arena)
}

func stopDaemons(ds []*daemon) {
	for _, d := range ds {
		d.stop()
	}
}

// rss returns the daemon's resident memory and its peak, in bytes.
func (d *daemon) rss() (cur, peak int64) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", d.cmd.Process.Pid))
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "VmRSS":
			cur = kb << 10
		case "VmHWM":
			peak = kb << 10
		}
	}
	return cur, peak
}

// fds returns how many file descriptors the daemon holds.
func (d *daemon) fds() int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	return len(ents)
}

// cleanEnv is the environment without S3 or MinIO settings, to which each
// process adds the proxy's.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "AWS_") && !strings.HasPrefix(kv, "MINIO_") && !strings.HasPrefix(kv, "CKPTD_") {
			env = append(env, kv)
		}
	}
	return env
}
