//go:build tools

// Package tools pins helm, in its own module so its k8s.io versions stay its own.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
