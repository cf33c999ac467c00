#!/usr/bin/env bash
# On the real single-node cluster (../shared/k8s-cluster: bootstrap.sh, then deploy.sh from this
# checkout): FUSE passthrough brokered by the agent, across server kills and an agent restart.
# `fkserve serve` runs as a native sidecar under the runtime's default seccomp profile, unprivileged;
# the app container holds a file open for the pod's life (a passthrough file, its backing file
# registered by the agent as the server's user), opens it again at every step (the kernel takes one
# backing file per inode: a successor must name the one its predecessor registered, else EIO),
# appends to a log held open, and rewrites a file of its own (its backing file registered and
# closed at every step, through whichever agent runs). The server is killed KILLS times (kill -9
# from the host: the kubelet restarts the sidecar, which adopts the live connection and the table
# of backing ids the agent kept), then the agent pod is replaced (the server re-deposits its connection and table). Passes
# when the app saw no error, the log has every line it was told was written, and the logs say
# passthrough was on and carried over.
#
#   scripts/cluster-passthrough.sh            (KILLS=3 by default: the kubelet backs off restarting
#                                              a sidecar that keeps dying, 10, 20, 40, 80 s)
#
# Last line: "cluster-passthrough: OK ..." or "cluster-passthrough: FAILED: ...".
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=cluster-passthrough
POD=fk-passthrough
KILLS=${KILLS:-3}
SERVER='fkserve --socket=/fk/fusekeeper.sock --ready_file=/fk/ready serve'
. scripts/cluster-common.sh
agent_log() { k -n "$NS" logs "$AGENT_POD" -c fusekeeper 2>/dev/null; }

[ -f "$K8S/deploy/agent-pod.yaml" ] || fail "no $K8S/deploy/agent-pod.yaml: run $KIT/deploy.sh first"
k delete pod "$POD" --ignore-not-found --grace-period=1 >/dev/null 2>&1
cat <<YAML | k apply -f - >/dev/null || fail "kubectl apply"
apiVersion: v1
kind: Pod
metadata:
  name: $POD
spec:
  nodeName: $NODE
  initContainers:
    - name: fuse-server
      image: fusekeeper/fkserve:0.1.0
      imagePullPolicy: Never
      restartPolicy: Always
      args: ["--socket=/fk/fusekeeper.sock", "--ready_file=/fk/ready", "serve", "--root=/export"]
      startupProbe:
        exec: {command: ["/usr/local/bin/fkserve", "--ready_file=/fk/ready", "ready"]}
        periodSeconds: 1
        failureThreshold: 120
      securityContext:
        runAsUser: 65534
        runAsGroup: 65534
        allowPrivilegeEscalation: false
        seccompProfile: {type: RuntimeDefault}
      volumeMounts: [{name: fk, mountPath: /fk}, {name: export, mountPath: /export}]
  containers:
$(app_container 'exec 3</data/held.txt || echo "ERROR hold"' \
    'echo $i > /data/step.txt && [ "$(cat /data/step.txt)" = $i ] || echo "ERROR step $i"')
  volumes:
    - name: fk
      emptyDir: {}
    - name: export
      emptyDir: {}
    - name: data
      csi:
        driver: fusekeeper.csi
        volumeAttributes: {kind: fuse, serverUid: "65534", socketVolume: fk}
YAML
wait_running
wait_appended 5 || { k logs $POD -c fuse-server | tail; k logs $POD -c app | tail; fail "the app does not work"; }
k logs $POD -c fuse-server | grep -q "passthrough: asked for in the INIT reply" ||
  fail "the server did not ask for passthrough: $(k logs $POD -c fuse-server | tail -3)"
agent_log | grep "volume.*$POD\|registered its first backing file" | grep -q "registered its first backing file" ||
  fail "the agent registered no backing file"
for i in $(seq "$KILLS"); do
  kill_sidecar "$SERVER"
  wait_appended 3 || { k logs $POD -c fuse-server | tail; fail "the app stopped after server kill $i"; }
done
k logs $POD -c fuse-server | grep -q "carrying on from the table of the last server" ||
  fail "the last server did not adopt the table: $(k logs $POD -c fuse-server | tail -3)"
kept=$(agent_log | grep -c "for the next server (the state its stopped server deposited names them)")
# ---- the agent replaced: the server re-deposits its connection and its table
k -n "$NS" delete pod "$AGENT_POD" --wait=true --timeout=120s >/dev/null || fail "deleting the agent pod"
wait_appended 3 || fail "the app stopped while the agent was gone"
k apply -f "$K8S/deploy/agent-pod.yaml" >/dev/null || fail "starting the agent pod"
for _ in $(seq 300); do agent_log | grep -q "re-deposited its live FUSE connection" && break; sleep 0.2; done
agent_log | grep -q "re-deposited its live FUSE connection" || fail "the server did not re-deposit with the new agent"
wait_appended 5 || fail "the app stopped after the agent restart"
kill_sidecar "$SERVER"
wait_appended 5 || { k logs $POD -c fuse-server | tail; fail "the app stopped after the kill after the agent restart"; }
errors=$(k logs $POD -c app | grep -c ERROR)
steps=$(appended)
k logs $POD -c app | grep ERROR | head -5
registered=$(agent_log | grep -c "registered its first backing file")
[ "$registered" -ge 1 ] || fail "the new agent registered no backing file"
k delete pod $POD --grace-period=1 >/dev/null 2>&1
[ "$errors" = 0 ] || fail "$errors errors in the app ($steps steps)"
echo "cluster-passthrough: OK $KILLS server kills, an agent restart and a kill after it; $steps app steps (each reopening a file held open in passthrough), 0 errors; the agent kept the backing files for the next server $kept time(s), the new agent brokered for $registered server(s); server under RuntimeDefault seccomp"
