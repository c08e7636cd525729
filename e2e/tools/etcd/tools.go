//go:build tools

// Package tools pins the etcd server built by e2e/tools/build.sh.
package tools

import _ "go.etcd.io/etcd/server/v3"
