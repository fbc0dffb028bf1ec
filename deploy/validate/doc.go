// Package validate checks the deployment examples under deploy/ without a
// cluster: the Kubernetes manifests decode strictly into the API's types,
// every ckptd flag they pass exists, the Grafana dashboard queries only
// metrics the daemon exports, and the shell scripts parse. It is a module
// of its own so that the Kubernetes API types never become a dependency
// of ckptd itself.
package validate
