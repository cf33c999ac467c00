#!/usr/bin/env bash
# On the real single-node cluster (../shared/k8s-cluster: bootstrap.sh, then deploy.sh from this
# checkout): the node readiness taint (k8s/node-readiness.yaml). With the agent gone, the node is
# tainted fusekeeper.csi/agent-not-ready:NoExecute (as a node pool registers it) and a pod that
# tolerates nothing is bound to the node: the kubelet must refuse it. The agent is started again
# (it tolerates everything, as the DaemonSet does): it must take the taint off its node, and only
# that taint, after which the same pod runs. Then the admission policy must refuse the agent's
# service account what the agent never does: adding a taint, or changing a node without a token
# bound to it.
#
# The kit has no scheduler (every pod names its node), so "held back" is the kubelet's own
# admission, which refuses a pod that does not tolerate a NoExecute taint; with a scheduler the
# same taint keeps such pods Pending. The kit has no controller manager either, so NoExecute
# evicts nothing already running here.
#
#   scripts/cluster-readiness-taint.sh
#
# Last line: "cluster-readiness-taint: OK ..." or "cluster-readiness-taint: FAILED: ...".
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=cluster-readiness-taint
. scripts/cluster-common.sh
KEY=fusekeeper.csi/agent-not-ready
PROBE=fk-taint-probe
fail() { echo "$NAME: FAILED: $*"; kubectl taint node "$NODE" "$KEY-" >/dev/null 2>&1; exit 1; }
taints() { k get node "$NODE" -o jsonpath='{range .spec.taints[*]}{.key}={.effect}{" "}{end}'; }
# Waits up to $1 s for the command in the other arguments to succeed (a poll of the API server's
# state, which is what this test observes; no event stream to wait on).
until_ok() { local t=$1; shift; for _ in $(seq "$((t * 5))"); do "$@" && return 0; sleep 0.2; done; return 1; }

[ -f "$K8S/deploy/agent-pod.yaml" ] || fail "no $K8S/deploy/agent-pod.yaml: run $KIT/deploy.sh first"
k apply -f k8s/rbac.yaml -n "$NS" >/dev/null || fail "applying k8s/rbac.yaml"
k apply -f k8s/node-readiness.yaml >/dev/null || fail "applying k8s/node-readiness.yaml"
k delete pod "$PROBE" --ignore-not-found --wait=true >/dev/null

# ---- no agent; the node registered with the taint; a pod that tolerates nothing waits
k -n "$NS" delete pod "$AGENT_POD" --ignore-not-found --wait=true --timeout=120s >/dev/null || fail "deleting the agent pod"
k taint node "$NODE" "$KEY=:NoExecute" --overwrite >/dev/null || fail "tainting $NODE"
k taint node "$NODE" fk-test/other=kept:NoSchedule --overwrite >/dev/null || fail "tainting $NODE with another taint"
probe() {  # a pod bound to the node that tolerates only the other taint
  k delete pod "$PROBE" --ignore-not-found --wait=true >/dev/null
  k apply -f - >/dev/null <<YAML || fail "creating the probe pod"
apiVersion: v1
kind: Pod
metadata: {name: $PROBE, namespace: default}
spec:
  nodeName: $NODE
  tolerations: [{key: fk-test/other, operator: Exists}]
  containers: [{name: c, image: docker.io/library/busybox:1.36, command: [sleep, "3600"], imagePullPolicy: Never}]
YAML
}
phase() { k get pod "$PROBE" -o jsonpath='{.status.phase}'; }
refused() { [ "$(phase)" = Failed ]; }
running() { [ "$(phase)" = Running ]; }
probe
until_ok 60 refused || fail "the kubelet admitted a pod that does not tolerate $KEY: $(k get pod $PROBE -o wide)"
why=$(k get pod "$PROBE" -o jsonpath='{.status.reason}: {.status.message}')

# ---- the agent starts: the taint goes, the other stays, the pod runs
k apply -f "$K8S/deploy/agent-pod.yaml" >/dev/null || fail "starting the agent pod"
gone() { ! taints | grep -q "$KEY="; }
until_ok 90 gone || fail "the agent did not remove $KEY: taints $(taints); agent log: $(k -n $NS logs $AGENT_POD -c fusekeeper | grep -i taint | tail -5)"
taints | grep -q "fk-test/other=NoSchedule" || fail "another taint went too: $(taints)"
k -n "$NS" logs "$AGENT_POD" -c fusekeeper | grep -q "taint $KEY removed" || fail "the agent did not say it removed the taint"
probe
until_ok 60 running || fail "the probe pod did not run after the taint went: $(k get pod $PROBE -o wide)"

# ---- the admission policy: the agent's account may not add a taint, or act without a token bound to the node
SA=system:serviceaccount:$NS:fusekeeper-node
out=$(k taint node "$NODE" fk-test/added=x:NoSchedule --as="$SA" 2>&1) && fail "the agent's account added a taint: $out"
echo "$out" | grep -q "fusekeeper" || fail "refused, but not by the policy: $out"

# ---- clean up
k taint node "$NODE" fk-test/other- >/dev/null 2>&1
k delete pod "$PROBE" --wait=false >/dev/null
echo "cluster-readiness-taint: OK: a pod was refused while $KEY was on $NODE ($why), ran once the agent removed it; the other taint kept; the policy refused the agent's account adding a taint ($(echo "$out" | tail -1 | cut -c1-200))"
