#!/usr/bin/env bash
# fusekeeper's main job on a machine without a cluster: install, build, start the node agent on a
# local CSI socket, and drive it the way kubelet, node-driver-registrar and livenessprobe do,
# with fkctl. Ends with an orderly SIGTERM shutdown. Exits non-zero if anything misbehaves.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel build //agent:fusekeeper //agent:fkctl

work=$(mktemp -d /tmp/fusekeeper-demo.XXXXXX)
sock="$work/csi.sock"
agent=bazel-bin/agent/fusekeeper
fkctl() { bazel-bin/agent/fkctl --endpoint="unix://$sock" "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() { echo "DEMO FAILED: $*" >&2; exit 1; }

"$agent" --endpoint="unix://$sock" --node_id="$(hostname)" 2>"$work/agent.log" &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

step "Start the agent on unix://$sock"
for _ in $(seq 100); do
  fkctl --timeout_ms=200 Probe >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/agent.log"; fail "agent exited"; }
  sleep 0.1
done
ls -l "$sock"
[ "$(stat -c %a "$sock")" = 660 ] || fail "socket mode is not 0660"

step "GetPluginInfo (what node-driver-registrar asks)"
fkctl GetPluginInfo
step "Probe (what livenessprobe asks)"
fkctl Probe | grep -q '"ready": true' || fail "Probe not ready"
fkctl Probe
step "NodeGetInfo and NodeGetCapabilities (what kubelet asks at registration)"
fkctl NodeGetInfo
fkctl NodeGetCapabilities

step "NodePublishVolume without a volume id: the spec's INVALID_ARGUMENT"
set +e
fkctl NodePublishVolume --target_path=/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/v/mount
code=$?
set -e
[ "$code" = 3 ] || fail "expected INVALID_ARGUMENT (3), got $code"

step "NodePublishVolume carrying a secret: the request is logged, the secret is not"
set +e
fkctl NodePublishVolume --volume_id=demo-vol --target_path=/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/v/mount \
  --secrets=password=demo-hunter2 --mount_flags=token=demo-flag-secret
set -e
grep 'NodePublishVolume volume_id: "demo-vol"' "$work/agent.log"
if grep -q -e demo-hunter2 -e demo-flag-secret "$work/agent.log"; then fail "secret in the log"; fi
echo "(no secret value in the agent log)"

step "SIGTERM: orderly shutdown"
kill -TERM "$pid"
wait "$pid" || fail "agent exited non-zero on SIGTERM"
[ ! -e "$sock" ] || fail "socket left behind"
echo "socket removed; agent exited 0"

step "Agent log"
cat "$work/agent.log"
echo
echo "demo OK"
