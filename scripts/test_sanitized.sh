#!/usr/bin/env bash
# The whole test suite built with AddressSanitizer + UndefinedBehaviorSanitizer (.bazelrc
# config "asan"): the agent, fkserve and the tests themselves. Any report fails its test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bazel test --config=asan //tests/...
