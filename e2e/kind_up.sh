#!/usr/bin/env bash
# `make kind-up`: for users with Docker and kind. Creates a kind cluster, builds both images and loads
# them into it, installs the chart, applies the CPU example, waits for Ready and sends a completion
# through a port-forward. Re-running reuses the cluster. It cannot run on kvpilot's CI machines (no
# Docker daemon; kind's node image can't be pulled offline): `make cluster-up` is the local path there.
# Without Prometheus in the cluster the autoscaler holds replicas (MetricsUnavailable); add
# `--set prometheusUrl=...` to the helm line for yours.
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=${KIND_CLUSTER:-kvpilot}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
local_port=${LOCAL_PORT:-18000}

for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null || { echo "kind-up needs $tool on PATH" >&2; exit 1; }
done
kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
kubectl config use-context "kind-$cluster" >/dev/null

docker build -f Dockerfile.operator -t "kvpilot/operator:$version" .
docker build -f Dockerfile.engine -t "kvpilot/engine:$version" .
kind load docker-image --name "$cluster" "kvpilot/operator:$version" "kvpilot/engine:$version"

helm upgrade --install kvpilot charts/kvpilot -n kvpilot-system --create-namespace \
  --set image.pullPolicy=Never --wait --timeout 5m
kubectl apply -f crds/examples/smollm2-cpu.yaml
kubectl wait --for=condition=Ready inferenceservice/smollm2 --timeout=10m

kubectl port-forward service/smollm2 "$local_port:8000" >/dev/null &
forward=$!
trap 'kill "$forward"' EXIT
for _ in $(seq 30); do curl -sf "http://127.0.0.1:$local_port/health" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$local_port/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
echo
kubectl get inferenceservices
