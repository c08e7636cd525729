//go:build tools

// Package tools pins actionlint, which checks .github/workflows/ in `make lint`, built by e2e/tools/build.sh.
package tools

import _ "github.com/rhysd/actionlint/cmd/actionlint"
