# Sourced by the scripts/cluster-*.sh tests (the real single-node cluster of ../shared/k8s-cluster).
# Expects NAME (the test's name, for messages) and, for the app helpers, POD.
K8S=${K8S_HOME:-/opt/k8s}
KIT=${KIT:-../shared/k8s-cluster}
export KUBECONFIG=$K8S/admin.kubeconfig
PATH=$K8S/bin:$PATH
NODE=${NODE:-vm}
NS=fusekeeper
AGENT_POD=fusekeeper-node-$NODE
fail() { echo "$NAME: FAILED: $*"; exit 1; }
k() { kubectl --request-timeout=30s "$@"; }

# The app container of a test pod (YAML, indented for `containers:`): as uid 65534, it writes
# /data/held.txt, runs $1 (e.g. holding a file open), keeps /data/log.txt open for the pod's life,
# and every 0.1 s reads held.txt (a new open), runs $2, appends a line through the held log and
# checks the count; each problem is a line starting ERROR, each append a line "appended N".
app_container() {  # app_container HOLD STEP (either may be "")
  cat <<YAML
    - name: app
      image: busybox:1.36
      securityContext: {runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
      command:
        - sh
        - -c
        - |
          trap 'exit 0' TERM
          echo hello > /data/held.txt || echo "ERROR create"
          ${1:-}
          exec 4>>/data/log.txt || echo "ERROR open"
          i=0
          while true; do
            i=\$((i+1))
            got=\$(cat /data/held.txt) || echo "ERROR read \$i"
            [ "\$got" = hello ] || echo "ERROR content \$i: '\$got'"
            ${2:-}
            echo "line \$i" >&4 && echo "appended \$i" || echo "ERROR append \$i"
            n=\$(wc -l < /data/log.txt) || echo "ERROR count \$i"
            [ "\$n" = "\$i" ] || echo "ERROR lines \$i: \$n"
            sleep 0.1
          done
      volumeMounts: [{name: data, mountPath: /data, mountPropagation: HostToContainer}]
YAML
}

# Until $POD is Running (120 s), else fails.
wait_running() {
  for _ in $(seq 120); do
    [ "$(k get pod "$POD" -o jsonpath='{.status.phase}' 2>/dev/null)" = Running ] && return 0
    sleep 1
  done
  k describe pod "$POD" | tail -20
  fail "pod not Running"
}
appended() { k logs "$POD" -c app 2>/dev/null | grep -c '^appended'; }
# wait_appended N: until the app has appended N more lines (60 s).
wait_appended() {
  local want=$(( $(appended) + $1 ))
  for _ in $(seq 600); do [ "$(appended)" -ge $want ] && return 0; sleep 0.1; done
  return 1
}
# The restarts of the pod's first init container (the server sidecar).
sidecar_restarts() { k get pod "$POD" -o jsonpath='{.status.initContainerStatuses[0].restartCount}'; }
# kill_sidecar PATTERN: kill -9 of the host process matching PATTERN, then until the kubelet has
# restarted the sidecar (150 s: a container that keeps dying is restarted after a back-off of 10,
# 20, 40, 80 s...), else fails.
kill_sidecar() {
  local before pid
  before=$(sidecar_restarts)
  pid=$(pgrep -f "$1" | head -1)
  [ -n "$pid" ] || fail "no process matching '$1' on the host"
  kill -9 "$pid"
  for _ in $(seq 1500); do [ "$(sidecar_restarts)" -gt "$before" ] && return 0; sleep 0.1; done
  fail "the kubelet did not restart the sidecar after a kill (restarts: $(sidecar_restarts))"
}
