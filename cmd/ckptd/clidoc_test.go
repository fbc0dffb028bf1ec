package main

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// cliDoc is docs/cli.md: the command tree's own usage of every command,
// so that the reference cannot drift from the binary.
const cliDoc = "../../docs/cli.md"

// TestCLIReference fails when docs/cli.md is not what the command tree
// prints; `make docs` (CKPTD_UPDATE_DOCS=1) writes it anew.
func TestCLIReference(t *testing.T) {
	// Defaults that come from the environment read as their variables.
	t.Setenv("XDG_DATA_HOME", "$XDG_DATA_HOME")
	got := cliReference(newRootCmd())
	if os.Getenv("CKPTD_UPDATE_DOCS") != "" {
		if err := os.WriteFile(cliDoc, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(cliDoc)
	if err != nil || string(want) != got {
		t.Fatalf("docs/cli.md is not the command tree's usage (%v): run `make docs`", err)
	}
}

func cliReference(root *cobra.Command) string {
	var b strings.Builder
	b.WriteString(`# Command reference

Generated from the command tree by ` + "`make docs`" + ` (a test fails when it is
stale). Every flag can also be set as ` + "`CKPTD_<FLAG>`" + ` in the environment
(` + "`CKPTD_STAGING_BYTES=8GiB`" + `) or in the YAML file given with ` + "`--config`" + `
(keys named like the flags, with dashes, and for serve optionally nested
under the group names below); the command line wins over the environment,
which wins over the file. Exit codes: 0 success, 1 failure, 2 bad usage.
What the commands do is in [checkpoints.md](checkpoints.md) and
[operations.md](operations.md).
`)
	for _, c := range root.Commands() {
		if !c.IsAvailableCommand() {
			continue
		}
		fmt.Fprintf(&b, "\n## ckptd %s\n\n%s\n\n```\n%s```\n", c.Name(), c.Short, c.UsageString())
	}
	return b.String()
}
