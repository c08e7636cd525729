//go:build tools

// Package tools pins the Kubernetes control-plane commands and the LeaderWorkerSet controller built by e2e/tools/build.sh.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "sigs.k8s.io/lws/cmd"
)
