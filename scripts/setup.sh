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
bash "$(dirname "$0")/apt-install-missing.sh" "${pkgs[@]}"
# Other people's FUSE programs for the tests (not needed to build: the image build skips them).
[ "${FUSEKEEPER_BUILD_ONLY:-}" = 1 ] || bash "$(dirname "$0")/setup-test-programs.sh"
