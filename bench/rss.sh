#!/usr/bin/env bash
# The agent's resident memory, idle and with N staged-and-published volumes (default 1000).
# hostPath volumes: their state (what the agent holds per volume) is the same shape as a FUSE
# volume's minus the handoff endpoint. Runs in a private mount namespace; nothing on the host
# is mounted. Usage: bash bench/rss.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-1000}"
bazel build -c opt //agent:fusekeeper //agent:fkctl >/dev/null 2>&1
exec unshare -m --propagation private bash -s "$n" <<'INNER'
set -euo pipefail
n=$1
root=$(mktemp -d /tmp/fk-rss.XXXXXX)
mount -t tmpfs tmpfs "$root"
mkdir -p "$root/kubelet/pods" "$root/state" "$root/data"
bazel-bin/agent/fusekeeper --endpoint="unix://$root/csi.sock" --node_id=n --kubelet_dir="$root/kubelet" \
  --state_dir="$root/state" 2>"$root/agent.log" &
agent=$!
fk() { bazel-bin/agent/fkctl --endpoint="unix://$root/csi.sock" "$@" >/dev/null; }
until bazel-bin/agent/fkctl --endpoint="unix://$root/csi.sock" --timeout_ms=200 Probe 2>/dev/null | grep -q '"ready": true'; do :; done
rss() { awk '/VmRSS/{printf "%.1f", $2/1024}' /proc/$agent/status; }
echo "idle: $(rss) MiB"
for i in $(seq 1 "$n"); do
  mkdir -p "$root/data/v$i" "$root/kubelet/plugins/s$i" "$root/kubelet/pods/p$i/volumes/kubernetes.io~csi/v$i"
  fk NodeStageVolume --volume_id="v$i" --staging_target_path="$root/kubelet/plugins/s$i" \
    --volume_context="kind=hostPath,path=$root/data/v$i,type=Directory"
  fk NodePublishVolume --volume_id="v$i" --staging_target_path="$root/kubelet/plugins/s$i" \
    --target_path="$root/kubelet/pods/p$i/volumes/kubernetes.io~csi/v$i/mount"
done
echo "$n volumes: $(rss) MiB ($(grep -c " $root/kubelet" /proc/self/mountinfo) mounts)"
kill -TERM $agent; wait $agent || true
umount -l "$root"
INNER
