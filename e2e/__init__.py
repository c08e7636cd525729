"""End-to-end infrastructure: a real Kubernetes control plane (no Docker), Prometheus, and the tests on them."""
