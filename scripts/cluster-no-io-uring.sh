#!/usr/bin/env bash
# On the real single-node cluster (../shared/k8s-cluster: bootstrap.sh, then deploy.sh from this
# checkout): an unmodified program (bindfs) served from a native sidecar by `fkserve launch`,
# under a seccomp profile that refuses io_uring as containerd 2.0's, Docker 25's and CRI-O's
# default profiles do (the kit's Localhost profile profiles/fusekeeper-no-io-uring.json), while
# the app container holds a file open, reads it and appends to a log. The program is killed
# KILLS times (kill -9 inside the sidecar) and the sidecar's launcher LAUNCHER_KILLS times (kill
# -9 from the host: kubelet restarts the container). Passes when the app saw no error, the log
# has every line it was told was written, and the launcher relayed with epoll.
#
#   scripts/cluster-no-io-uring.sh            (KILLS=10 LAUNCHER_KILLS=2 by default)
#
# Last line: "cluster-no-io-uring: OK ..." or "cluster-no-io-uring: FAILED: ...".
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=cluster-no-io-uring
KILLS=${KILLS:-10}
LAUNCHER_KILLS=${LAUNCHER_KILLS:-2}
POD=fk-no-io-uring
IMG=fusekeeper/fkserve-bindfs:test
. scripts/cluster-common.sh

[ -x "$K8S/deploy/bin/fkserve" ] || fail "no $K8S/deploy/bin/fkserve: run $KIT/deploy.sh first"
[ -f /var/lib/kubelet/seccomp/profiles/fusekeeper-no-io-uring.json ] || fail "no seccomp profile: run $KIT/deploy.sh"
command -v bindfs >/dev/null || fail "bindfs is not installed (scripts/setup.sh installs it)"

# ---- an image: busybox, fkserve with its fusermount and preload library, bindfs and its libraries
ROOT=$K8S/images/fkserve-bindfs-root
rm -rf "$ROOT" && mkdir -p "$ROOT"/{bin,usr/local/bin,usr/bin,etc,tmp,proc,dev,sys}
chmod 1777 "$ROOT/tmp"
cp /bin/busybox "$ROOT/bin/busybox"
for l in $("$ROOT/bin/busybox" --list); do [ -e "$ROOT/bin/$l" ] || ln -s busybox "$ROOT/bin/$l"; done
cp "$K8S"/deploy/bin/{fkserve,fkserve-fusermount,libfkserve_preload.so} "$ROOT/usr/local/bin/"
cp "$(command -v bindfs)" "$ROOT/usr/bin/bindfs"
for b in "$ROOT/usr/local/bin/fkserve" "$ROOT/usr/bin/bindfs"; do
  for l in $(ldd "$b" | awk '$2=="=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
    mkdir -p "$ROOT$(dirname "$l")" && cp -L "$l" "$ROOT$l"
  done
done
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$ROOT/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$ROOT/etc/group"
python3 "$KIT/mkimage.py" "$K8S/images/fkserve-bindfs.tar" "$ROOT" \
  "$IMG={\"Entrypoint\":[\"/usr/local/bin/fkserve\"],\"Env\":[\"PATH=/usr/local/bin:/usr/bin:/bin\"]}" >/dev/null ||
  fail "image build"
ctr -n k8s.io images import "$K8S/images/fkserve-bindfs.tar" >/dev/null || fail "image import"

# ---- the pod
k delete pod "$POD" --ignore-not-found --grace-period=1 >/dev/null 2>&1
cat <<YAML | k apply -f - >/dev/null || fail "kubectl apply"
apiVersion: v1
kind: Pod
metadata:
  name: $POD
spec:
  nodeName: vm
  initContainers:
    - name: fuse-server
      image: $IMG
      imagePullPolicy: Never
      restartPolicy: Always
      args: ["--socket=/fk/fusekeeper.sock", "--ready_file=/fk/ready", "launch", "--",
             "bindfs", "-f", "/export", "{mountpoint}"]
      startupProbe:
        exec: {command: ["/usr/local/bin/fkserve", "--ready_file=/fk/ready", "ready"]}
        periodSeconds: 1
        failureThreshold: 120
      securityContext:
        runAsUser: 65534
        runAsGroup: 65534
        allowPrivilegeEscalation: false
        seccompProfile: {type: Localhost, localhostProfile: profiles/fusekeeper-no-io-uring.json}
      volumeMounts: [{name: fk, mountPath: /fk}, {name: export, mountPath: /export}]
  containers:
$(app_container "")
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
for i in $(seq "$KILLS"); do
  k exec $POD -c fuse-server -- sh -c 'kill -9 $(pidof bindfs)' || fail "kill $i"
  wait_appended 3 || { k logs $POD -c fuse-server | tail; fail "the app stopped after kill $i"; }
done
# What the first launcher said of its program's restarts, before it is killed itself.
FIRST=$(k logs $POD -c fuse-server)
restarts=$(echo "$FIRST" | grep -c "restart(s) so far")
in_program=$(echo "$FIRST" | grep -c "reads the kernel's connection itself")
echo "$FIRST" | grep -q "waiting with epoll" || fail "the launcher did not say it waits with epoll"
for i in $(seq "$LAUNCHER_KILLS"); do
  kill_sidecar 'fkserve --socket=/fk/fusekeeper.sock'
  wait_appended 3 || { k logs $POD -c fuse-server | tail; fail "the app stopped after launcher kill $i"; }
done
LOGS=$(k logs $POD -c fuse-server)
EPOLL=$(k logs $POD -c fuse-server --previous 2>/dev/null; echo "$LOGS")
errors=$(k logs $POD -c app | grep -c ERROR)
steps=$(appended)
k logs $POD -c app | grep ERROR | head -5
echo "$EPOLL" | grep -q "waiting with epoll" || fail "the launcher did not say it waits with epoll"
echo "$LOGS" | grep -q "reads the kernel's connection itself" || fail "bindfs did not run the relay's core"
k delete pod $POD --grace-period=1 >/dev/null 2>&1
[ "$errors" = 0 ] || fail "$errors errors in the app ($steps steps)"
echo "cluster-no-io-uring: OK $KILLS program kills, $LAUNCHER_KILLS launcher kills (the first launcher reported $restarts restarts, $in_program instances with the relay's core in them), $steps app steps, 0 errors, under a seccomp profile refusing io_uring"
