#!/usr/bin/env bash
# `make demo`: the main path a user takes, end to end on the built-in local cluster.
# 1. bring up the local cluster (real control plane + 4 kwok GPU nodes), 2. install the CRD,
# 3. run the operator, 4. apply examples/trainingjob.yaml, 5. show what kubectl shows.
# With RANKWATCH_USE_KUBECONFIG=1 it uses $KUBECONFIG's cluster instead.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
NAMESPACE=rankwatch-demo
JOB=llama-70b

KUBECTL=$("$BIN/python" -c 'from rankwatch.cluster.binaries import binary_path; print(binary_path("kubectl"))')
if [ "${RANKWATCH_USE_KUBECONFIG:-0}" = 1 ] && [ -n "${KUBECONFIG:-}" ]; then
  echo "==> using the cluster of KUBECONFIG=$KUBECONFIG"
  command -v kubectl >/dev/null && KUBECTL=kubectl
else
  echo "==> local cluster"
  "$BIN/rankwatch" cluster up
  KUBECONFIG=$("$BIN/rankwatch" cluster kubeconfig)
  export KUBECONFIG
fi
k() { "$KUBECTL" "$@"; }
k get nodes -L nvidia.com/gpu.product,rankwatch.io/node-pool

echo "==> CRD"
k apply --server-side --force-conflicts -f crds/trainingjobs.rankwatch.io.yaml
k wait --for=condition=Established --timeout=60s crd/trainingjobs.rankwatch.io

echo "==> operator (log: $PWD/.demo-operator.log)"
"$BIN/rankwatch" operator --standalone --namespace "$NAMESPACE" >.demo-operator.log 2>&1 &
OPERATOR=$!
trap 'kill $OPERATOR 2>/dev/null; wait $OPERATOR 2>/dev/null || true' EXIT

echo "==> kubectl apply -f examples/trainingjob.yaml"
k create namespace "$NAMESPACE" --dry-run=client -o yaml | k apply -f -
if k get tj "$JOB" -n "$NAMESPACE" >/dev/null 2>&1; then
  k delete tj "$JOB" -n "$NAMESPACE" --wait=true
  k wait --for=delete pod -l "rankwatch.io/job-name=$JOB" -n "$NAMESPACE" --timeout=60s || true
fi
k apply -n "$NAMESPACE" -f examples/trainingjob.yaml
if ! k wait --for=jsonpath='{.status.phase}'=Running "tj/$JOB" -n "$NAMESPACE" --timeout=90s; then
  echo "job did not reach Running; operator log:" >&2
  tail -40 .demo-operator.log >&2
  exit 1
fi

echo; echo "==> kubectl get tj,svc,pods -n $NAMESPACE -o wide"
k get tj,svc,pods -n "$NAMESPACE" -o wide
echo; echo "==> kubectl describe tj $JOB -n $NAMESPACE"
k describe tj "$JOB" -n "$NAMESPACE"
echo; echo "==> what rankwatch injected into worker 0"
k get pod "$JOB-worker-0" -n "$NAMESPACE" \
  -o jsonpath='{range .spec.initContainers[*]}init container: {.name} (restartPolicy={.restartPolicy}){"\n"}{end}{range .spec.containers[0].env[*]}  env {.name}={.value}{"\n"}{end}'
echo
echo "The cluster keeps running: export KUBECONFIG=$KUBECONFIG; 'make cluster-down' removes it."
