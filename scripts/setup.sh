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
  ntfs-3g zip squashfs-tools e2fsprogs tar util-linux strace
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
