//go:build tools

// Package tools pins upstream Prometheus (and its promtool), built by e2e/tools/build.sh. (Debian's package is built
// without kubernetes_sd_configs, which the e2e tests and the operator's discovery depend on.)
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
