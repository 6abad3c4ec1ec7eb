#!/usr/bin/env bash
# Regenerate kubernetes/go.mod for a Kubernetes release: one `replace k8s.io/<m> => k8s.io/<m> v0.X.Y`
# per staging module, derived from that release's own go.mod (replace lines of a dependency are
# ignored, so the wrapper must repeat them). Usage: cluster/gomod/update-kubernetes.sh v1.36.3
# Then update KUBERNETES_VERSION in cluster/versions.py.
set -euo pipefail
version=${1:?usage: $0 v1.X.Y}
staging="v0.${version#v1.}"
cd "$(dirname "$0")/kubernetes"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
gomod=$(go mod download -json "k8s.io/kubernetes@${version}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
{
  echo "// Wrapper module: builds the Kubernetes control plane from its Go modules (cluster/gomod/update-kubernetes.sh)."
  echo "module rankwatch.local/cluster/kubernetes"
  echo
  echo "go $(awk '$1 == "go" {print $2; exit}' "$gomod")"
  echo
  echo "require k8s.io/kubernetes ${version}"
  echo
  echo "replace ("
  sed -n '/^replace (/,/^)/p' "$gomod" | awk -v v="$staging" '$2 == "=>" {print "\t" $1 " => " $1 " " v}'
  echo ")"
  echo
  echo "tool ("
  for command in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    echo "	k8s.io/kubernetes/cmd/${command}"
  done
  echo ")"
} > go.mod
go mod tidy
