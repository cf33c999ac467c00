#!/usr/bin/env bash
# Installs the FUSE programs the tests serve through `fkserve launch` (libfuse2, libfuse3, go-fuse
# and bazil programs, from Debian's packages), what their tests make images and servers with, and
# s3rver (npm) as s3fs's local S3 endpoint. Called by setup.sh.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  bindfs fuse-zip unionfs-fuse archivemount fuse2fs squashfuse fuse-overlayfs gocryptfs rclone sshfs s3fs encfs
  ntfs-3g zip squashfs-tools e2fsprogs tar util-linux strace openssh-server openssh-client
)
bash "$(dirname "$0")/apt-install-missing.sh" "${pkgs[@]}"
# s3fs's tests talk to a local S3 endpoint: s3rver, from the npm registry (not a Debian package).
tools=/opt/fusekeeper-test-tools
if [ ! -x "$tools/node_modules/.bin/s3rver" ]; then
  # Debian's nodejs and npm, unless a Node.js with its own npm is there already (NodeSource's
  # nodejs package conflicts with Debian's npm).
  command -v npm >/dev/null || apt-get install -y -qq --no-install-recommends nodejs npm
  mkdir -p "$tools"
  npm install --prefix "$tools" --no-audit --no-fund --silent s3rver@3.7.1 ||
    echo "setup: could not install s3rver from npm; the s3fs tests will be skipped (they say why)" >&2
fi
# S3's PUT is atomic; s3rver's writes the object in place (scripts/s3rver-atomic-put.py says why).
if [ -f "$tools/node_modules/s3rver/lib/stores/filesystem.js" ]; then
  python3 "$(dirname "$0")/s3rver-atomic-put.py" "$tools/node_modules/s3rver/lib/stores/filesystem.js"
fi

