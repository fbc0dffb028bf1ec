package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/ckptd/ckptd/clients/go/ckptd"
)

type healthOptions struct {
	Socket  string
	Timeout time.Duration
}

func newHealthCmd() *cobra.Command {
	o := &healthOptions{}
	cmd := &cobra.Command{
		Use:   "health",
		Short: "Exit 0 when the daemon on the socket serves and its storage answers (a Docker HEALTHCHECK, a Kubernetes exec probe)",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runHealth(cmd.Context(), o, cmd.OutOrStdout()) },
	}
	cmd.Flags().StringVar(&o.Socket, "socket", "", "the daemon's socket (default as for serve)")
	cmd.Flags().DurationVar(&o.Timeout, "timeout", 5*time.Second, "how long to wait for an answer")
	return cmd
}

// dialDaemon connects to the daemon on socket ("" for the default) and
// returns the client and the socket it used.
func dialDaemon(socket string) (*ckptd.Client, string, error) {
	if socket == "" {
		socket = ckptd.DefaultSocket()
	}
	c, err := ckptd.Dial(socket)
	return c, socket, err
}

// runHealth prints one line and fails unless the daemon is ready.
func runHealth(ctx context.Context, o *healthOptions, out io.Writer) error {
	c, socket, err := dialDaemon(o.Socket)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	if err := c.Health(ctx); err != nil {
		return err
	}
	fmt.Fprintf(out, "ckptd at %s: serving\n", socket)
	return nil
}
