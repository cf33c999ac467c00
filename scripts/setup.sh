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
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Other people's FUSE programs for the tests (not needed to build: the image build skips them).
[ "${FUSEKEEPER_BUILD_ONLY:-}" = 1 ] || bash "$(dirname "$0")/setup-test-programs.sh"
