package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Flag groups: `ckptd serve --help` lists its flags under these headings,
// in this order, and the --config file may nest a group's keys under its
// name (see applyConfig).
var flagGroups = []struct{ name, title string }{
	{"storage", "Storage (where checkpoints go)"},
	{"staging", "Staging (the shared-memory arena saves are copied into)"},
	{"tiers", "Memory tiers (steps kept in memory after they drain, or instead)"},
	{"peers", "Peers (replicas on other nodes' sidecars)"},
	{"datasets", "Datasets (read-ahead, cache and delivery)"},
	{"security", "Security (who may reach the daemon)"},
	{"operations", "Operations"},
}

// groupAnnotation is the pflag annotation that names a flag's group.
const groupAnnotation = "ckptd_group"

// helpColumns is the width help text is wrapped to.
const helpColumns = 100

// inGroup puts the named flags of fs in group.
func inGroup(fs *pflag.FlagSet, group string, names ...string) {
	for _, n := range names {
		f := fs.Lookup(n)
		if f == nil {
			panic("inGroup: no flag --" + n) // a typo here must fail every test
		}
		_ = fs.SetAnnotation(n, groupAnnotation, []string{group})
	}
}

// groupOf is the group of a flag, "" for none.
func groupOf(f *pflag.Flag) string {
	if g := f.Annotations[groupAnnotation]; len(g) == 1 {
		return g[0]
	}
	return ""
}

// groupedUsage prints a command's usage with its flags under their
// groups' headings, wrapped to helpColumns; flags of no group, and the
// inherited ones, come last.
func groupedUsage(cmd *cobra.Command) error {
	w := cmd.OutOrStderr()
	fmt.Fprintf(w, "Usage:\n  %s\n", cmd.UseLine())
	byGroup := map[string]*pflag.FlagSet{}
	grouped := false
	cmd.LocalFlags().VisitAll(func(f *pflag.Flag) { grouped = grouped || groupOf(f) != "" })
	cmd.LocalFlags().VisitAll(func(f *pflag.Flag) {
		g := groupOf(f)
		if f.Name == "help" && grouped {
			g = "operations"
		}
		if byGroup[g] == nil {
			byGroup[g] = pflag.NewFlagSet(g, pflag.ContinueOnError)
			byGroup[g].SortFlags = false
		}
		byGroup[g].AddFlag(f)
	})
	for _, g := range flagGroups {
		printFlags(w, g.title, byGroup[g.name])
	}
	other := "Other flags"
	if len(byGroup) == 1 {
		other = "Flags" // a command whose flags have no groups
	}
	printFlags(w, other, byGroup[""])
	printFlags(w, "Global flags", cmd.InheritedFlags())
	if cmd.HasAvailableSubCommands() {
		fmt.Fprintf(w, "\nCommands:\n")
		for _, c := range cmd.Commands() {
			if c.IsAvailableCommand() {
				fmt.Fprintf(w, "  %-*s %s\n", cmd.NamePadding(), c.Name(), c.Short)
			}
		}
		fmt.Fprintf(w, "\nRun \"%s [command] --help\" for a command's flags.\n", cmd.CommandPath())
	}
	return nil
}

func printFlags(w io.Writer, title string, fs *pflag.FlagSet) {
	if fs == nil || !fs.HasAvailableFlags() {
		return
	}
	fmt.Fprintf(w, "\n%s:\n%s", title, strings.TrimRight(fs.FlagUsagesWrapped(helpColumns), "\n")+"\n")
}
