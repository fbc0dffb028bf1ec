// Package validate checks the deployment examples under deploy/ without a
// cluster: every document of every Kubernetes manifest decodes strictly
// into the API's types and passes kubectl-validate against the API's
// OpenAPI schemas for Kubernetes 1.30, offline (required fields, types,
// unknown fields; not the API server's own checks such as enum values);
// every ckptd flag they pass exists, the Grafana dashboard queries only
// metrics the daemon exports, and the shell scripts parse. It is a module
// of its own so that the Kubernetes API types never become a dependency
// of ckptd itself.
package validate
