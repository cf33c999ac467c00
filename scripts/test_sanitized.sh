#!/usr/bin/env bash
# The whole test suite built with AddressSanitizer + UndefinedBehaviorSanitizer (.bazelrc
# config "asan"): the agent, fkserve and the tests themselves. Any report fails its test.
# A failure ends with the failed cases named (test_summary.py), so a CI log's tail says what broke.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rc=0
bazel test --config=asan //tests/... || rc=$?
if [ "$rc" != 0 ]; then
  echo "sanitized suite failed (bazel exit $rc):"
  python3 scripts/test_summary.py bazel-testlogs || true
fi
exit "$rc"
