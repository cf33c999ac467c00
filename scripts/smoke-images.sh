#!/usr/bin/env bash
# Smoke test of the built images (scripts/build-images.sh), as root:
#
#   bash scripts/smoke-images.sh
#
# The agent image runs the way the DaemonSet runs it: privileged, host network, /dev/fuse, the
# kubelet dir bound with rshared (Bidirectional) propagation at the same path, its state dir, the
# node's / at /host (--host_root). fkctl (copied out of the agent image) drives it from the host
# like kubelet: an inline FUSE volume is published into a "pod". The fkserve image runs as uid
# 65534 with the pod's socket emptyDir and serves an export; the host reads through the pod's
# target. Then everything is stopped and nothing may be left mounted.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^#define FUSEKEEPER_VERSION_STRING "\(.*\)"/\1/p' agent/version.h)
for image in agent fkserve; do
  podman image exists "fusekeeper/$image:$version" || { echo "fusekeeper/$image:$version is not built: bash scripts/build-images.sh"; exit 2; }
done
command -v runc >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc >/dev/null; }

root=$(mktemp -d /tmp/fk-smoke.XXXXXX)
# This machine's cgroups are a v1/v2 hybrid that crun refuses, and its hard rlimits are below
# podman's default container ulimits: runc with cgroupfs and the inherited limits work.
cat > "$root/containers.conf" <<'EOF'
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
export CONTAINERS_CONF="$root/containers.conf"
agent=fk-smoke-agent-$$ server=fk-smoke-server-$$
cleanup() {
  podman rm -f -t 5 "$server" "$agent" >/dev/null 2>&1 || true
  umount -R "$root/kubelet" 2>/dev/null || true
  rm -rf "$root"
}
trap cleanup EXIT
fail() { echo "SMOKE FAILED: $*"; podman logs "$agent" 2>&1 | tail -20; podman logs "$server" 2>&1 | tail -20; exit 1; }

kubelet="$root/kubelet"
mkdir -p "$kubelet" "$root/state" "$root/csi" "$root/export"
mount --bind "$kubelet" "$kubelet" && mount --make-rshared "$kubelet"   # as a node's kubelet dir is
echo "served through FUSE by the fkserve image" > "$root/export/hello.txt"
chown -R 65534:65534 "$root/export"

podman run -d --name "$agent" --privileged --network host \
  --device /dev/fuse -v "$kubelet:$kubelet:rshared" -v "$root/state:/var/lib/fusekeeper" -v "$root/csi:/csi" \
  -v /:/host:rslave \
  "fusekeeper/agent:$version" --endpoint=unix:///csi/csi.sock --node_id=smoke --kubelet_dir="$kubelet" \
  --state_dir=/var/lib/fusekeeper --host_root=/host --kubelet_url= >/dev/null
podman cp "$agent:/usr/local/bin/fkctl" "$root/fkctl"
fkctl() { "$root/fkctl" --endpoint="unix://$root/csi/csi.sock" "$@"; }
for _ in $(seq 1 100); do
  fkctl --timeout_ms=200 Probe 2>/dev/null | grep -q '"ready": true' && break
done
fkctl Probe | grep -q '"ready": true' || fail "the agent container never became ready"
echo "agent image: ready ($(fkctl GetPluginInfo | grep -o '"vendorVersion": "[^"]*"'))"

pod="$kubelet/pods/smoke-pod"
mkdir -p "$pod/volumes/kubernetes.io~empty-dir/fk" "$pod/volumes/kubernetes.io~csi/data"
chmod 777 "$pod/volumes/kubernetes.io~empty-dir/fk"
target="$pod/volumes/kubernetes.io~csi/data/mount"
fkctl NodePublishVolume --volume_id=smoke-1 --target_path="$target" \
  --volume_context="kind=fuse,serverUid=65534,socketVolume=fk,csi.storage.k8s.io/pod.uid=smoke-pod" >/dev/null \
  || fail "NodePublishVolume"
grep -q " $target " /proc/self/mountinfo || fail "the FUSE mount did not propagate to the host"

podman run -d --name "$server" --user 65534:65534 --read-only --cap-drop=ALL --security-opt=no-new-privileges \
  -v "$pod/volumes/kubernetes.io~empty-dir/fk:/fk" -v "$root/export:/export" \
  "fusekeeper/fkserve:$version" --socket=/fk/fusekeeper.sock --ready_file=/fk/ready serve --root=/export >/dev/null
read=$(timeout 30 cat "$target/hello.txt") || fail "reading through the FUSE mount"
[ "$read" = "served through FUSE by the fkserve image" ] || fail "read '$read'"
echo "fkserve image (uid 65534, read-only root, no capabilities): served '$read'"
podman exec "$server" /usr/local/bin/fkserve --ready_file=/fk/ready ready || fail "the startupProbe command fails"

fkctl NodeUnpublishVolume --volume_id=smoke-1 --target_path="$target" >/dev/null || fail "NodeUnpublishVolume"
podman stop -t 10 "$server" >/dev/null
podman stop -t 10 "$agent" >/dev/null
[ "$(podman inspect -f '{{.State.ExitCode}}' "$agent")" = 0 ] || fail "the agent did not exit 0 on SIGTERM"
if grep -q " $root/kubelet/" /proc/self/mountinfo; then
  grep " $root/kubelet/" /proc/self/mountinfo
  fail "mounts left behind"
fi
echo "stopped: nothing left mounted"
echo "smoke test OK"
