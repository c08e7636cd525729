#!/usr/bin/env bash
# Builds the control-plane tools from the committed wrapper modules into the cache, keyed by version.
# A second run finds the binaries and does nothing. Usage: build.sh [k8s|etcd|kwok|helm|prometheus|promtool|lws|actionlint ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=e2e/tools/versions.env
source "$here/versions.env"
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvpilot
export GOMODCACHE=${GOMODCACHE:-$cache/go/mod} GOCACHE=${GOCACHE:-$cache/go/build}
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
bindir=$cache/bin
mkdir -p "$bindir"

built() { for b in "$@"; do [ -x "$bindir/$b" ] || return 1; done; }

build_k8s() {
  local d="$bindir/k8s-$K8S_VERSION"
  built "k8s-$K8S_VERSION/kube-apiserver" "k8s-$K8S_VERSION/kube-controller-manager" "k8s-$K8S_VERSION/kube-scheduler" && return
  local v=${K8S_VERSION#v} pkg=k8s.io/component-base/version
  local major=${v%%.*} rest=${v#*.}; local minor=${rest%%.*}
  local ld="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ld+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  mkdir -p "$d.tmp"
  # One `go build` for the three commands: they share most packages, so they compile once.
  (cd "$here/k8s" && go build -trimpath -ldflags "$ld" -o "$d.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler)
  rm -rf "$d" && mv "$d.tmp" "$d"
}

build_one() {  # module-dir version package binary [extra ldflags]
  local d="$bindir/$1-$2"
  built "$1-$2/$4" && return
  mkdir -p "$d.tmp"
  (cd "$here/$1" && go build -trimpath -ldflags "-s -w ${5:-}" -o "$d.tmp/$4" "$3")
  rm -rf "$d" && mv "$d.tmp" "$d"
}

# LeaderWorkerSet's controller and its CRDs (copied beside it: e2e/lws.py installs them), from the k8s wrapper module: its
# k8s.io packages are the control plane's, compiled once when both are built in one run (the Go build cache is trimmed after).
build_lws() {
  local d="$bindir/lws-$LWS_VERSION"
  built "lws-$LWS_VERSION/lws-controller" && return
  mkdir -p "$d.tmp"
  (cd "$here/k8s" && go build -trimpath -ldflags "-s -w" -o "$d.tmp/lws-controller" sigs.k8s.io/lws/cmd &&
    src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/lws) &&
    cp "$src/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$d.tmp/leaderworkersets.yaml" &&
    cp "$src/config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml" "$d.tmp/disaggregatedsets.yaml")
  chmod u+w "$d.tmp"/*.yaml
  rm -rf "$d" && mv "$d.tmp" "$d"
}

build_etcd() { build_one etcd "$ETCD_VERSION" go.etcd.io/etcd/server/v3 etcd; }
build_kwok() { build_one kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok kwok; }
build_actionlint() { build_one actionlint "$ACTIONLINT_VERSION" github.com/rhysd/actionlint/cmd/actionlint actionlint "-X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION"; }
build_helm() { build_one helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"; }
build_prometheus() {
  local pkg=github.com/prometheus/common/version
  build_one prometheus "$PROMETHEUS_VERSION" github.com/prometheus/prometheus/cmd/prometheus prometheus \
    "-X $pkg.Version=$PROMETHEUS_VERSION -X $pkg.Branch=release -X $pkg.Revision=$PROMETHEUS_MODULE_VERSION"
}

# promtool (the chart's alert rules are checked with it) from the same Prometheus module.
build_promtool() {
  local d="$bindir/promtool-$PROMETHEUS_VERSION"
  built "promtool-$PROMETHEUS_VERSION/promtool" && return
  mkdir -p "$d.tmp"
  (cd "$here/prometheus" && go build -trimpath -ldflags "-s -w" -o "$d.tmp/promtool" github.com/prometheus/prometheus/cmd/promtool)
  rm -rf "$d" && mv "$d.tmp" "$d"
}

targets=("$@"); [ ${#targets[@]} -gt 0 ] || targets=(etcd kwok helm prometheus promtool k8s lws actionlint)
for t in "${targets[@]}"; do
  start=$(date +%s)
  "build_$t"
  echo "built $t in $(( $(date +%s) - start ))s -> $bindir" >&2
done
# Once every binary is in place the ~5 GB Go build cache serves nothing (the binaries are the cache);
# keep the module cache so a version bump does not download everything again.
if [ -z "${KVPILOT_KEEP_GO_BUILD_CACHE:-}" ] && [ -d "$GOCACHE" ]; then
  go clean -cache && echo "trimmed the Go build cache ($GOCACHE)" >&2
fi
