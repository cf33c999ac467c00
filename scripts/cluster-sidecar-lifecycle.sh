#!/usr/bin/env bash
# On the real single-node cluster (../shared/k8s-cluster: bootstrap.sh, then deploy.sh from this
# checkout): injected FUSE server sidecars through a pod's whole life, as a user meets them.
#  1. PODS pods (default 6) created at once, each asking the admission webhook for its server: the
#     injected native sidecar (`fkserve serve`, uid 65534, read-only root, its startup probe) and
#     the Memory emptyDir that holds the handoff socket. The kubelet sets a pod's volumes up in
#     parallel and mounts that emptyDir's tmpfs on a directory it made first, so a NodePublish can
#     make the socket under the tmpfs: every pod must still start, and its app read.
#  2. The FUSE connection of one pod aborted (fusectl) under its reading app: the same sidecar (not
#     restarted by the kubelet, whose back-off would hold the reads) serves the fresh connection,
#     and the app reads again within 10 s.
#  3. The pods deleted: not one Warning FuseServerNotConnected (a sidecar stopped for a deletion is
#     a pod going away, not a failure).
#
#   scripts/cluster-sidecar-lifecycle.sh
#
# Last line: "cluster-sidecar-lifecycle: OK ..." or "cluster-sidecar-lifecycle: FAILED: ...".
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=cluster-sidecar-lifecycle
PODS=${PODS:-6}
. scripts/cluster-common.sh
run=$(date +%s)
names=()
for i in $(seq "$PODS"); do names+=("fk-life-$run-$i"); done
cleanup() { for p in "${names[@]}"; do k delete pod "$p" --ignore-not-found --wait=false >/dev/null 2>&1; done; }
trap cleanup EXIT
reads() { k logs "$1" -c app 2>/dev/null | grep -c '^read' || true; }
errors() { k logs "$1" -c app 2>/dev/null | grep -c '^ERROR' || true; }

[ -f "$K8S/deploy/agent-pod.yaml" ] || fail "no $K8S/deploy/agent-pod.yaml: run $KIT/deploy.sh first"
k -n "$NS" get pod "fusekeeper-webhook-$NODE" >/dev/null 2>&1 || fail "no webhook pod: run $KIT/deploy.sh (not --agent-only)"
for p in "${names[@]}"; do
  cat <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $p
  annotations: {fusekeeper.csi/inject-server: "true"}
spec:
  nodeName: $NODE
  containers:
    - name: app
      image: busybox:1.36
      imagePullPolicy: Never
      securityContext: {runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
      command:
        - sh
        - -c
        - |
          trap 'exit 0' TERM
          i=0
          while true; do
            i=\$((i+1))
            if ls /data/usr/local/bin 2>&1 | grep -q fkserve; then echo "read \$i"; else echo "ERROR read \$i"; fi
            sleep 0.1
          done
      volumeMounts: [{name: data, mountPath: /data}]
  volumes:
    - name: data
      csi:
        driver: fusekeeper.csi
        volumeAttributes: {kind: fuse, serverUid: "65534"}
---
YAML
done | k apply -f - >/dev/null || fail "kubectl apply"

# ---- 1: every pod starts and reads
start=$(date +%s)
for p in "${names[@]}"; do
  POD=$p
  for _ in $(seq 240); do [ "$(reads "$p")" -ge 5 ] && break; sleep 0.5; done
  if [ "$(reads "$p")" -lt 5 ]; then
    k describe pod "$p" | tail -15
    k logs "$p" -c fusekeeper-server-data 2>&1 | tail -5
    fail "pod $p never read through its injected server"
  fi
done
started=$(( $(date +%s) - start ))
first=${names[0]}
k get pod "$first" -o jsonpath='{.spec.initContainers[0].name}' | grep -q fusekeeper-server || fail "no injected sidecar in $first"

# ---- 2: an abort of a live connection under the reading app
uid=$(k get pod "$first" -o jsonpath='{.metadata.uid}')
target=$(awk -v u="$uid" '$5 ~ u && $5 ~ /kubernetes.io~csi\/data\/mount$/ && $9 == "fuse.fusekeeper" {print $3}' /proc/self/mountinfo | tail -1)
[ -n "$target" ] || fail "no FUSE mount of pod $first on the host"
minor=${target#*:}
restarts=$(k get pod "$first" -o jsonpath='{.status.initContainerStatuses[0].restartCount}')
before=$(reads "$first")
echo 1 > "/sys/fs/fuse/connections/$minor/abort" || fail "cannot abort connection $minor"
t0=$(date +%s.%N)
resumed=""
for _ in $(seq 200); do
  if [ "$(k logs "$first" -c app --tail=3 2>/dev/null | grep -c '^read')" -ge 3 ] && [ "$(reads "$first")" -gt $((before + 5)) ]; then
    resumed=$(echo "$(date +%s.%N) - $t0" | bc); break
  fi
  sleep 0.05
done
[ -n "$resumed" ] || { k logs "$first" -c fusekeeper-server-data | tail -5; fail "reads did not resume within 10 s of the abort"; }
now_restarts=$(k get pod "$first" -o jsonpath='{.status.initContainerStatuses[0].restartCount}')
[ "$now_restarts" = "$restarts" ] || fail "the sidecar was restarted ($restarts -> $now_restarts) instead of serving the fresh connection"
k logs "$first" -c fusekeeper-server-data | grep -q "asking the agent for the volume's next one" ||
  fail "the sidecar did not ask for the next connection: $(k logs "$first" -c fusekeeper-server-data | tail -3)"
abort_errors=$(errors "$first")

# ---- 3: deletions are no Warning
for p in "${names[@]}"; do k delete pod "$p" --grace-period=5 --wait=false >/dev/null 2>&1; done
for p in "${names[@]}"; do
  for _ in $(seq 120); do k get pod "$p" >/dev/null 2>&1 || break; sleep 0.5; done
  k get pod "$p" >/dev/null 2>&1 && fail "pod $p not gone after 60 s"
done
# (The abort's own repair is a FuseServerNotConnected Warning too, "…was aborted; mounting a fresh
# connection": only a server said to have stopped is counted.)
warnings=0
for p in "${names[@]}"; do
  n=$(k get events --field-selector "involvedObject.name=$p,reason=FuseServerNotConnected" \
        -o jsonpath='{range .items[*]}{.message}{"\n"}{end}' 2>/dev/null | grep -c 'FUSE server of volume .* stopped' || true)
  warnings=$((warnings + n))
done
[ "$warnings" = 0 ] || fail "$warnings FuseServerNotConnected Warning(s) on $PODS deleted pods"
echo "$NAME: OK $PODS injected pods created at once, all reading in ${started} s; an abort under a reader: reads again after ${resumed} s from the same sidecar (0 restarts; $abort_errors read error(s) while the connection was dead); $PODS deletions, 0 Warnings"
