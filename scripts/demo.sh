#!/usr/bin/env bash
# fusekeeper's main job on a machine without a cluster: install, build, start the node agent on a
# local CSI socket, and drive it the way kubelet, node-driver-registrar and livenessprobe do, with
# fkctl: a host-path volume is staged, published into two "pods", read and written through the
# targets, unpublished and unstaged; then a FUSE volume is published (the agent mounts /dev/fuse),
# the reference server takes the connection unprivileged, and the pod reads through it. Everything runs in a private mount namespace, so nothing it
# mounts touches the host. Ends with an orderly SIGTERM shutdown; exits non-zero on any surprise.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${FUSEKEEPER_DEMO_NS:-}" ]; then
  bash scripts/setup.sh
  bazel build //agent:fusekeeper //agent:fkctl //agent/fkserve
  FUSEKEEPER_DEMO_NS=1 exec unshare --mount --propagation private bash "$0" "$@"
fi

work=$(mktemp -d /tmp/fusekeeper-demo.XXXXXX)
mount -t tmpfs demo "$work"   # private to this namespace
sock="$work/csi.sock"
kubelet="$work/kubelet"
agent=bazel-bin/agent/fusekeeper
fkctl() { bazel-bin/agent/fkctl --endpoint="unix://$sock" "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
fail() { echo "DEMO FAILED: $*" >&2; exit 1; }
mkdir -p "$kubelet/pods" "$kubelet/plugins" "$work/host/data"

"$agent" --endpoint="unix://$sock" --node_id="$(hostname)" --kubelet_dir="$kubelet" \
  --state_dir="$work/state" --ephemeral_host_path_prefixes="$work/host" 2>"$work/agent.log" &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; cp "$work/agent.log" /tmp/fusekeeper-demo-agent.log 2>/dev/null || true; }
trap cleanup EXIT

step "Start the agent on unix://$sock (kubelet dir $kubelet)"
for _ in $(seq 100); do
  fkctl --timeout_ms=200 Probe 2>/dev/null | grep -q '"ready": true' && break
  kill -0 "$pid" 2>/dev/null || { cat "$work/agent.log"; fail "agent exited"; }
  sleep 0.1
done
ls -l "$sock"
[ "$(stat -c %a "$sock")" = 660 ] || fail "socket mode is not 0660"

step "GetPluginInfo and Probe (what node-driver-registrar and livenessprobe ask)"
fkctl GetPluginInfo
fkctl Probe
step "NodeGetInfo and NodeGetCapabilities (what kubelet asks at registration)"
fkctl NodeGetInfo
fkctl NodeGetCapabilities

step "NodeStageVolume: a hostPath volume (type Directory) mounted at the staging path"
echo "hello from the node" > "$work/host/data/hello.txt"
staging="$kubelet/plugins/kubernetes.io/csi/fusekeeper.csi/demo/globalmount"
mkdir -p "$staging"   # kubelet creates it
fkctl NodeStageVolume --volume_id=demo-vol --staging_target_path="$staging" \
  --volume_context="kind=hostPath,path=$work/host/data,type=Directory"
grep " $staging " /proc/self/mountinfo

step "NodePublishVolume into two pods (pod-b read-only); a repeat is idempotent"
t1="$kubelet/pods/pod-a/volumes/kubernetes.io~csi/demo/mount"
t2="$kubelet/pods/pod-b/volumes/kubernetes.io~csi/demo/mount"
mkdir -p "$(dirname "$t1")" "$(dirname "$t2")"   # kubelet creates the parents
fkctl NodePublishVolume --volume_id=demo-vol --staging_target_path="$staging" --target_path="$t1"
fkctl NodePublishVolume --volume_id=demo-vol --staging_target_path="$staging" --target_path="$t1"
fkctl NodePublishVolume --volume_id=demo-vol --staging_target_path="$staging" --target_path="$t2" --readonly
[ "$(grep -c " $t1 " /proc/self/mountinfo)" = 1 ] || fail "publish mounted twice"

step "Read and write through the targets"
echo "pod-a reads: $(cat "$t1/hello.txt")"
echo "written by pod-a" > "$t1/from-pod-a.txt"
echo "pod-b reads: $(cat "$t2/from-pod-a.txt")"
echo "host sees:   $(cat "$work/host/data/from-pod-a.txt")"
if echo x 2>/dev/null > "$t2/nope.txt"; then fail "read-only target accepted a write"; fi
echo "pod-b's read-only target refuses writes"

step "NodeGetVolumeStats"
fkctl NodeGetVolumeStats --volume_id=demo-vol --volume_path="$t1"

step "Errors say what was wrong"
set +e
fkctl NodePublishVolume --volume_id=demo-vol --staging_target_path="$staging" --target_path=/etc/evil
[ $? = 3 ] || fail "a target outside the kubelet dir was not INVALID_ARGUMENT"
fkctl NodePublishVolume --volume_id=x --target_path="$kubelet/pods/p/volumes/kubernetes.io~csi/x/mount" \
  --volume_context="kind=hostPath,path=$work/host/data/hello.txt,type=Directory"
[ $? = 9 ] || fail "a wrong hostPath type was not FAILED_PRECONDITION"
fkctl NodePublishVolume --volume_id=demo-vol --target_path="$t1" --secrets=password=demo-hunter2 \
  --mount_flags=token=demo-flag-secret
set -e
if grep -q -e demo-hunter2 -e demo-flag-secret "$work/agent.log"; then fail "secret in the log"; fi
echo "(no secret value in the agent log)"

step "NodeUnpublishVolume and NodeUnstageVolume"
fkctl NodeUnpublishVolume --volume_id=demo-vol --target_path="$t1"
fkctl NodeUnpublishVolume --volume_id=demo-vol --target_path="$t2"
fkctl NodeUnstageVolume --volume_id=demo-vol --staging_target_path="$staging"
[ ! -e "$t1" ] || fail "target path left behind"
if grep -q -e " $staging " -e " $t1 " /proc/self/mountinfo; then fail "mount left behind"; fi
echo "no mounts left; the data stays on the host: $(ls "$work/host/data" | tr '\n' ' ')"

step "FUSE: NodePublishVolume of an inline FUSE volume (the agent mounts /dev/fuse itself)"
pod="$kubelet/pods/pod-f"
mkdir -p "$pod/volumes/kubernetes.io~empty-dir/fk" "$pod/volumes/kubernetes.io~csi/fuse"
chmod 777 "$pod/volumes/kubernetes.io~empty-dir/fk"      # the emptyDir shared with the sidecar
tf="$pod/volumes/kubernetes.io~csi/fuse/mount"
mkdir -p "$work/export" && echo "served through FUSE by an unprivileged server" > "$work/export/readme.txt"
chown -R 65534:65534 "$work/export"
fkctl NodePublishVolume --volume_id=fuse-vol --target_path="$tf" \
  --volume_context="kind=fuse,serverUid=65534,socketVolume=fk,csi.storage.k8s.io/pod.uid=pod-f"
grep " $tf " /proc/self/mountinfo
fkctl NodeGetVolumeStats --volume_id=fuse-vol --volume_path="$tf" | grep -A2 volumeCondition

step "The reference server starts as uid 65534 and takes the fd from the pod's emptyDir socket"
install -m 0755 bazel-bin/agent/fkserve/fkserve "$work/fkserve"   # outside /root, which it cannot read
ls -l "$pod/volumes/kubernetes.io~empty-dir/fk/"
setpriv --reuid=65534 --regid=65534 --clear-groups "$work/fkserve" \
  --socket="$pod/volumes/kubernetes.io~empty-dir/fk/fusekeeper.sock" serve --root="$work/export" \
  2>"$work/fkserve.log" &
server=$!
echo "pod reads: $(timeout 20 cat "$tf/readme.txt")" || fail "read through FUSE failed"
echo "written by the pod through FUSE" > "$tf/from-pod.txt"
echo "export holds: $(cat "$work/export/from-pod.txt") (owner $(stat -c %u "$work/export/from-pod.txt"))"
fkctl NodeGetVolumeStats --volume_id=fuse-vol --volume_path="$tf" | grep -A2 volumeCondition

step "NodeUnpublishVolume: abort the connection, unmount; the server ends"
fkctl NodeUnpublishVolume --volume_id=fuse-vol --target_path="$tf"
wait "$server" || true
cat "$work/fkserve.log"
if grep -q " $tf " /proc/self/mountinfo; then fail "FUSE mount left behind"; fi
echo "FUSE mount gone"

step "SIGTERM: orderly shutdown"
kill -TERM "$pid"
wait "$pid" || fail "agent exited non-zero on SIGTERM"
[ ! -e "$sock" ] || fail "socket left behind"
echo "socket removed; agent exited 0"

step "Agent log"
cat "$work/agent.log"
echo
echo "demo OK"
