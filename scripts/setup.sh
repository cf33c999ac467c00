#!/usr/bin/env bash
# Installs everything fusekeeper needs to build, test and run on Debian 12, from Debian packages only.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  bazel-bootstrap bazel-rules-java
  g++ pkg-config python3 python3-yaml git ca-certificates
  liburing-dev libfuse3-dev fuse3
  libgrpc++-dev libgrpc-dev protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
  libgoogle-glog-dev libgflags-dev libgtest-dev libgmock-dev libbenchmark-dev libabsl-dev
  libsimdjson-dev libcurl4-openssl-dev openssl libcpp-httplib-dev nlohmann-json3-dev
  # Other people's FUSE programs, served by the tests through fkserve launch (and what their
  # tests make images with): libfuse2, libfuse3, go-fuse and bazil programs.
  bindfs fuse-zip unionfs-fuse archivemount fuse2fs squashfuse fuse-overlayfs gocryptfs rclone sshfs s3fs encfs
  ntfs-3g zip squashfs-tools e2fsprogs tar util-linux strace openssh-server openssh-client
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
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

