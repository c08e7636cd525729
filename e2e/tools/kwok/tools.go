//go:build tools

// Package tools pins kwok, which fakes nodes and pod lifecycles, built by e2e/tools/build.sh.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
