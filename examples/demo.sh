#!/usr/bin/env bash
# `make demo`: the main path a user takes, end to end on the built-in local cluster.
# 1. bring up the local cluster (real control plane + 4 kwok GPU nodes), 2. install the CRD,
# 3. run the operator and the pod runner (the workers and sidecars run here, on the stand-in NCCL),
# 4. apply examples/straggler-job.yaml (4 nodes, one slow rank), 5. show the diagnosis kubectl shows
# and the suspect node cordoned and tainted, 6. the same diagnosis in the local Prometheus (which
# scrapes the operator and the sidecars and evaluates the chart's rules), 7. apply
# examples/hang-job.yaml (a rank hangs): the hang diagnosed, its node cordoned, the attempt ended and
# the job running again on healthy nodes. 8. on the local cluster, a job of another kind: a plain
# Indexed Job (examples/indexed-job.yaml) opted in by annotation, injected by the operator's admission
# webhook, its straggler diagnosed on the Job and shown by `rankwatch describe job/...`.
# 9. `rankwatch nodes`, then the demo's cordons are undone (RANKWATCH_DEMO_KEEP_CORDONS=1 keeps them).
# With RANKWATCH_USE_KUBECONFIG=1 it uses $KUBECONFIG's cluster instead.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
MONITORING=0
NAMESPACE=rankwatch-demo
JOB=llama-straggler
HANG_JOB=llama-hang
KIND_JOB=bert-straggler

KUBECTL=$("$BIN/python" -c 'from rankwatch.cluster.binaries import binary_path; print(binary_path("kubectl"))')
if [ "${RANKWATCH_USE_KUBECONFIG:-0}" = 1 ] && [ -n "${KUBECONFIG:-}" ]; then
  echo "==> using the cluster of KUBECONFIG=$KUBECONFIG"
  command -v kubectl >/dev/null && KUBECTL=kubectl
else
  echo "==> local cluster, with Prometheus and Alertmanager beside it"
  "$BIN/rankwatch" cluster up --monitoring
  MONITORING=1
  KUBECONFIG=$("$BIN/rankwatch" cluster kubeconfig)
  export KUBECONFIG
fi
k() { "$KUBECTL" "$@"; }
k get nodes -L nvidia.com/gpu.product,rankwatch.io/node-pool

echo "==> CRD"
k apply --server-side --force-conflicts -f crds/trainingjobs.rankwatch.io.yaml
# kubectl wait fails at once while the new CRD has no status.conditions yet: look again until it has.
for _ in $(seq 30); do k get crd/trainingjobs.rankwatch.io -o jsonpath='{.status.conditions}' | grep -q . && break; sleep 1; done
k wait --for=condition=Established --timeout=60s crd/trainingjobs.rankwatch.io

free_port() { "$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
WEBHOOK_ENV=()
if [ "$MONITORING" = 1 ]; then
  # The admission webhook for jobs of other kinds, served by the operator on loopback (the local API
  # server runs on this machine) with a certificate of a local CA; its configuration is the chart's.
  WEBHOOK_PORT=$(free_port)
  CERTS="$PWD/.demo-webhook-tls"
  "$BIN/python" -c 'import sys; from pathlib import Path; from rankwatch.cluster import pki; pki.issue_serving(Path(sys.argv[1]), ["127.0.0.1"])' "$CERTS"
  HELM=$("$BIN/python" -c 'from rankwatch.cluster.binaries import binary_path; print(binary_path("helm"))')
  "$HELM" template rankwatch-demo helm/rankwatch --namespace rankwatch-system --set webhook.enabled=true \
    --set "webhook.url=https://127.0.0.1:$WEBHOOK_PORT" --set "webhook.caBundle=$(base64 -w0 <"$CERTS/ca.crt")" \
    --show-only templates/webhook.yaml >.demo-webhook.yaml
  k apply -f .demo-webhook.yaml
  WEBHOOK_ENV=("RANKWATCH_WEBHOOK_LISTEN=127.0.0.1:$WEBHOOK_PORT" "RANKWATCH_WEBHOOK_CERT_DIR=$CERTS")
fi
echo "==> operator (collector on 127.0.0.1:$PORT; log: $PWD/.demo-operator.log)"
# The cooldown after an undo is off so that the demo can be run again at once; the circuit breaker
# allows 3 of the 4 nodes, one per job (the default 10% would stop at the straggler's node). The pod runner's sidecars listen on 127.0.0.1 (kwok pod
# IPs are not real): the operator trusts their endpoint annotation for that host only.
env "${WEBHOOK_ENV[@]}" RANKWATCH_SIDECAR_ENDPOINT_HOSTS=127.0.0.1 RANKWATCH_CORDON_COOLDOWN_SECONDS=0 RANKWATCH_BREAKER_MAX_SHARE=0.75 RANKWATCH_COLLECTOR_LISTEN="127.0.0.1:$PORT" "$BIN/rankwatch" operator --standalone --namespace "$NAMESPACE" \
  >.demo-operator.log 2>&1 &
OPERATOR=$!
echo "==> pod runner: runs each worker pod's ranks and sidecar here (log: $PWD/.demo-pods/pod-runner.log)"
mkdir -p .demo-pods
"$BIN/rankwatch" cluster run-pods --collector-url "http://127.0.0.1:$PORT" --namespace "$NAMESPACE" \
  --work-dir "$PWD/.demo-pods" >.demo-pods/pod-runner.log 2>&1 &
RUNNER=$!
if [ "$MONITORING" = 1 ]; then
  "$BIN/rankwatch" cluster scrape --job rankwatch-operator --target "127.0.0.1:$PORT" >/dev/null
fi
# At the end (or on an error) the cluster is left as the demo found it: its jobs deleted and the nodes
# it cordoned uncordoned with rankwatch's own undo (after the operator stopped, so nothing cordons
# again). RANKWATCH_DEMO_KEEP_CORDONS=1 keeps them to look at, and says so and how to undo it.
cleanup() {
  k delete tj "$JOB" "$HANG_JOB" -n "$NAMESPACE" --wait=false >/dev/null 2>&1 || true
  k delete job "$KIND_JOB" -n "$NAMESPACE" --wait=false >/dev/null 2>&1 || true
  if [ -f .demo-webhook.yaml ]; then k delete -f .demo-webhook.yaml --ignore-not-found >/dev/null 2>&1 || true; fi
  kill "$RUNNER" "$OPERATOR" 2>/dev/null
  wait "$RUNNER" "$OPERATOR" 2>/dev/null || true
  if [ "$MONITORING" = 1 ]; then "$BIN/rankwatch" cluster scrape --job rankwatch-operator >/dev/null 2>&1 || true; fi
  echo
  if [ "${RANKWATCH_DEMO_KEEP_CORDONS:-0}" = 1 ]; then
    echo "==> LEFT CORDONED by the demo (RANKWATCH_DEMO_KEEP_CORDONS=1):"
    "$BIN/rankwatch" nodes || true
    echo "    undo: for job in $JOB $HANG_JOB $KIND_JOB; do $BIN/rankwatch uncordon --all-from-job $NAMESPACE/\$job; done"
    return
  fi
  echo "==> leaving the cluster as the demo found it: uncordoning the nodes it cordoned"
  for job in "$JOB" "$HANG_JOB" "$KIND_JOB"; do
    "$BIN/rankwatch" uncordon --all-from-job "$NAMESPACE/$job" | grep -v "^no node carries" || true
  done
  "$BIN/rankwatch" nodes || true
}
trap cleanup EXIT

echo "==> kubectl apply -f examples/straggler-job.yaml  (rank 9 computes 30% slower)"
k create namespace "$NAMESPACE" --dry-run=client -o yaml | k apply -f -
if [ "$MONITORING" = 1 ]; then
  k label namespace "$NAMESPACE" rankwatch.io/inject=enabled --overwrite  # opts its pods in to the webhook
  if k get job "$KIND_JOB" -n "$NAMESPACE" >/dev/null 2>&1; then k delete job "$KIND_JOB" -n "$NAMESPACE" --wait=true; fi
fi
for old in "$JOB" "$HANG_JOB" "$KIND_JOB"; do
  "$BIN/rankwatch" uncordon --all-from-job "$NAMESPACE/$old" >/dev/null 2>&1 || true  # a previous run's cordons
  if k get tj "$old" -n "$NAMESPACE" >/dev/null 2>&1; then
    k delete tj "$old" -n "$NAMESPACE" --wait=true
    k wait --for=delete pod -l "rankwatch.io/job-name=$old" -n "$NAMESPACE" --timeout=60s || true
  fi
done
k apply -n "$NAMESPACE" -f examples/straggler-job.yaml
if ! k wait --for=jsonpath='{.status.phase}'=Running "tj/$JOB" -n "$NAMESPACE" --timeout=90s; then
  echo "job did not reach Running; operator log:" >&2
  tail -40 .demo-operator.log >&2
  exit 1
fi
echo "==> waiting for the diagnosis (Degraded=True)"
if ! k wait --for=condition=Degraded "tj/$JOB" -n "$NAMESPACE" --timeout=120s; then
  echo "no diagnosis; operator log:" >&2
  tail -40 .demo-operator.log >&2
  exit 1
fi
sleep 2  # the Event follows the status by a moment

echo; echo "==> kubectl get tj,pods -n $NAMESPACE -o wide"
k get tj,pods -n "$NAMESPACE" -o wide
echo; echo "==> kubectl describe tj $JOB -n $NAMESPACE"
k describe tj "$JOB" -n "$NAMESPACE"
echo; echo "==> the diagnosis"
k get tj "$JOB" -n "$NAMESPACE" -o jsonpath='{.status.diagnosis}' | "$BIN/python" -m json.tool
echo; echo "==> the full report (ConfigMap $JOB-rankwatch-report)"
k get configmap "$JOB-rankwatch-report" -n "$NAMESPACE" -o jsonpath='{.data.report\.txt}'; echo
NODE=$(k get tj "$JOB" -n "$NAMESPACE" -o jsonpath='{.status.diagnosis.nodes[0]}')
echo; echo "==> the suspect node $NODE: cordoned and tainted"
k wait --for=jsonpath='{.spec.unschedulable}'=true "node/$NODE" --timeout=30s >/dev/null || true
k get nodes -o custom-columns='NAME:.metadata.name,UNSCHEDULABLE:.spec.unschedulable,TAINTS:.spec.taints[*].key,CORDONED-BY:.metadata.annotations.rankwatch\.io/cordoned-by,JOB:.metadata.annotations.rankwatch\.io/cordon-job'
k get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$NODE" -o custom-columns='TYPE:.type,REASON:.reason,MESSAGE:.message'
if [ "$MONITORING" = 1 ]; then
  STATUS=$("$BIN/rankwatch" cluster status || true)
  PROMETHEUS=$(echo "$STATUS" | "$BIN/python" -c 'import json, sys; print(json.load(sys.stdin)["prometheus"])')
  ALERTMANAGER=$(echo "$STATUS" | "$BIN/python" -c 'import json, sys; print(json.load(sys.stdin)["alertmanager"])')
  QUERY="rankwatch_job_health{namespace=\"$NAMESPACE\", trainingjob=\"$JOB\"} == 1"
  echo; echo "==> Prometheus at $PROMETHEUS (Alertmanager at $ALERTMANAGER); the diagnosed job there:"
  echo "    curl -s $PROMETHEUS/api/v1/query --data-urlencode 'query=$QUERY'"
  "$BIN/python" - "$PROMETHEUS" "$QUERY" <<'PY'
import json, sys, time, urllib.parse, urllib.request
prometheus, query = sys.argv[1:]
def get(path, **params):
    with urllib.request.urlopen(f"{prometheus}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
        return json.load(r)["data"]
for _ in range(30):  # the next scrape (every 5 s) carries the new health
    result = get("query", query=query)["result"]
    if any(series["metric"].get("health") == "Degraded" for series in result):
        break
    time.sleep(1)
for series in result:
    print("   ", series["metric"], "=", series["value"][1])
firing = sorted({a["labels"]["alertname"] for a in get("alerts")["alerts"] if a["state"] == "firing"})
print("    firing rules:", ", ".join(firing) or "none yet")
PY
fi

echo; echo "==> kubectl apply -f examples/hang-job.yaml  (rank 2 stops before its 300th NCCL call; recovery on)"
k delete tj "$JOB" -n "$NAMESPACE" --wait=false  # its node stays cordoned
k apply -n "$NAMESPACE" -f examples/hang-job.yaml
k wait --for=jsonpath='{.status.phase}'=Running "tj/$HANG_JOB" -n "$NAMESPACE" --timeout=90s
echo "==> waiting for the hang to be diagnosed (Hung=True), then for the restart"
k wait --for=condition=Hung "tj/$HANG_JOB" -n "$NAMESPACE" --timeout=120s
HUNG_NODE=$(k get tj "$HANG_JOB" -n "$NAMESPACE" -o jsonpath='{.status.diagnosis.nodes[0]}')
k get tj "$HANG_JOB" -n "$NAMESPACE" -o jsonpath='{.status.diagnosis.summary}'; echo
if ! k wait --for=jsonpath='{.status.restarts}'=1 "tj/$HANG_JOB" -n "$NAMESPACE" --timeout=60s ||
   ! k wait --for=jsonpath='{.status.phase}'=Running "tj/$HANG_JOB" -n "$NAMESPACE" --timeout=90s; then
  echo "the job did not run again; operator log:" >&2
  tail -40 .demo-operator.log >&2
  exit 1
fi
echo; echo "==> attempt 1 runs on healthy nodes (the hung rank's node $HUNG_NODE is cordoned)"
k get tj "$HANG_JOB" -n "$NAMESPACE" -o wide
k get pods -n "$NAMESPACE" -l "rankwatch.io/job-name=$HANG_JOB" -L rankwatch.io/attempt -o wide
echo; echo "==> status.attempts (why attempt 0 ended, whom it blamed)"
k get tj "$HANG_JOB" -n "$NAMESPACE" -o jsonpath='{.status.attempts}' | "$BIN/python" -m json.tool
k get events -n "$NAMESPACE" --field-selector "involvedObject.name=$HANG_JOB" -o custom-columns='TYPE:.type,REASON:.reason,MESSAGE:.message' | cut -c1-220
k get nodes -o custom-columns='NAME:.metadata.name,UNSCHEDULABLE:.spec.unschedulable,JOB:.metadata.annotations.rankwatch\.io/cordon-job'
if [ "$MONITORING" = 1 ]; then
  echo; echo "==> a job of another kind: kubectl apply -f examples/indexed-job.yaml  (an Indexed Job; rank 5 computes 30% slower)"
  k delete tj "$HANG_JOB" -n "$NAMESPACE" --wait=false  # its GPUs for the Job; its node stays cordoned
  k apply -n "$NAMESPACE" -f examples/indexed-job.yaml
  echo "==> waiting for the diagnosis on the Job (annotation rankwatch.io/diagnosis)"
  diagnosed=0
  for _ in $(seq 1 120); do
    if k get job "$KIND_JOB" -n "$NAMESPACE" -o jsonpath='{.metadata.annotations.rankwatch\.io/diagnosis}' 2>/dev/null |
      "$BIN/python" -c 'import json, sys; text = sys.stdin.read(); sys.exit(0 if text and json.loads(text).get("active") else 1)'; then
      diagnosed=1
      break
    fi
    sleep 2
  done
  if [ "$diagnosed" != 1 ]; then
    echo "no diagnosis on the Job; operator log:" >&2
    tail -40 .demo-operator.log >&2
    exit 1
  fi
  k get pods -n "$NAMESPACE" -l "batch.kubernetes.io/job-name=$KIND_JOB" -o wide
  echo; echo "==> rankwatch describe job/$KIND_JOB -n $NAMESPACE  (also: kubectl rankwatch describe ...)"
  "$BIN/rankwatch" describe "job/$KIND_JOB" -n "$NAMESPACE"
fi
echo; echo "==> rankwatch nodes: what rankwatch cordoned, for which job, since when"
"$BIN/rankwatch" nodes
echo
echo "The cluster keeps running: export KUBECONFIG=$KUBECONFIG; 'make cluster-down' removes it."
