#!/usr/bin/env bash
# Installs what is missing, builds everything (agent, CLI, benchmarks) and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel build //agent/... //bench/...
rc=0
bazel test //tests/... || rc=$?
python3 scripts/test_summary.py bazel-testlogs || rc=1
# The layout rules (file and function lengths) of issue 29.
python3 scripts/check_layout.py || rc=1
exit "$rc"
