package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"gopkg.in/yaml.v3"
)

// applyConfig fills every flag not given on the command line from
// CKPTD_<FLAG> in the environment, else from the --config YAML file.
func applyConfig(cmd *cobra.Command) error {
	file := map[string]any{}
	path, _ := cmd.Flags().GetString("config")
	if path == "" {
		path = os.Getenv("CKPTD_CONFIG")
	}
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("config: %w", err)
		}
		if err := yaml.Unmarshal(b, &file); err != nil {
			return fmt.Errorf("config %s: %w", path, err)
		}
		if err := flattenGroups(file); err != nil {
			return fmt.Errorf("config %s: %w", path, err)
		}
		if err := checkConfigKeys(cmd, file); err != nil {
			return fmt.Errorf("config %s: %w", path, err)
		}
	}
	var err error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if err != nil || f.Changed {
			return
		}
		env := "CKPTD_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v, ok := os.LookupEnv(env); ok {
			err = setFlag(f, v, env)
		} else if v, ok := file[f.Name]; ok {
			err = setFlag(f, configValue(v), path)
		}
	})
	return err
}

// flattenGroups lets the file nest keys under the name of their flags'
// group, as `ckptd serve --help` lists them (storage:, staging:, tiers:,
// peers:, datasets:, security:, operations:): a group's keys count as
// top-level ones. A key whose value is not a mapping is a flag, even one
// named like a group (storage: s3://bucket, peers: [a:7465, b:7465]).
func flattenGroups(file map[string]any) error {
	for _, g := range flagGroups {
		nested, ok := file[g.name].(map[string]any)
		if !ok {
			continue
		}
		delete(file, g.name)
		for k, v := range nested {
			if _, dup := file[k]; dup {
				return fmt.Errorf("key %q is given twice: at the top and under %q", k, g.name)
			}
			file[k] = v
		}
	}
	return nil
}

// checkConfigKeys fails on a key that names no flag of any ckptd command
// (a key for another command is fine: one file may serve them all), and
// suggests the flag meant (keys are spelled like the flags, with dashes)
// or lists the keys this command takes.
func checkConfigKeys(cmd *cobra.Command, file map[string]any) error {
	known := map[string]bool{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		mark := func(f *pflag.Flag) { known[f.Name] = f.Name != "help" }
		c.Flags().VisitAll(mark)
		c.PersistentFlags().VisitAll(mark)
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(cmd.Root())
	var bad []string
	listValid := false
	for key := range file {
		if known[key] {
			continue
		}
		guess := strings.ToLower(strings.ReplaceAll(strings.TrimLeft(key, "-"), "_", "-"))
		if known[guess] {
			bad = append(bad, fmt.Sprintf("%q (did you mean %q? keys are spelled like the flags, with dashes)", key, guess))
		} else {
			bad = append(bad, strconv.Quote(key))
			listValid = true
		}
	}
	if len(bad) == 0 {
		return nil
	}
	slices.Sort(bad)
	msg := "unknown key " + strings.Join(bad, ", ")
	if len(bad) > 1 {
		msg = "unknown keys " + strings.Join(bad, ", ")
	}
	if listValid {
		var valid []string
		cmd.Flags().VisitAll(func(f *pflag.Flag) {
			if !f.Hidden && f.Name != "help" {
				valid = append(valid, f.Name)
			}
		})
		slices.Sort(valid)
		msg += fmt.Sprintf("; the keys of %q are: %s", cmd.CommandPath(), strings.Join(valid, ", "))
	}
	return errors.New(msg)
}

// configValue is a file value as a flag takes it: a YAML list as the
// comma-separated list a repeated flag takes (peers: [a:7465, b:7465]).
func configValue(v any) string {
	list, ok := v.([]any)
	if !ok {
		return fmt.Sprint(v)
	}
	items := make([]string, len(list))
	for i, item := range list {
		items[i] = fmt.Sprint(item)
	}
	return strings.Join(items, ",")
}

func setFlag(f *pflag.Flag, v, from string) error {
	if err := f.Value.Set(v); err != nil {
		return fmt.Errorf("--%s from %s: %w", f.Name, from, err)
	}
	return nil
}

func setupLogging(cmd *cobra.Command) error {
	lvl, _ := cmd.Flags().GetString("log-level")
	var level slog.Level
	if err := level.UnmarshalText([]byte(lvl)); err != nil {
		return usageError{fmt.Errorf("--log-level: %w", err)}
	}
	opts := &slog.HandlerOptions{Level: level}
	switch format, _ := cmd.Flags().GetString("log-format"); format {
	case "text":
		slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, opts)))
	case "json": // one object per line, for log shippers; durations in seconds, as numbers
		opts.ReplaceAttr = secondsForDurations
		slog.SetDefault(slog.New(slog.NewJSONHandler(os.Stderr, opts)))
	default:
		return usageError{fmt.Errorf("--log-format %q: want text or json", format)}
	}
	return nil
}

// secondsForDurations writes a duration as seconds (a float): slog's JSON
// handler writes nanoseconds, which a log shipper cannot tell from a
// count.
func secondsForDurations(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.Float64Value(a.Value.Duration().Seconds())
	}
	return a
}
