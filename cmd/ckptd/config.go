package main

import (
	"fmt"
	"log/slog"
	"os"
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
			err = setFlag(f, fmt.Sprint(v), path)
		}
	})
	return err
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
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
	return nil
}
