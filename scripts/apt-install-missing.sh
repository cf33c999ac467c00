#!/usr/bin/env bash
# Installs those of the given Debian packages that are not installed yet (apt-get update only if
# any are missing). Used by setup.sh and setup-test-programs.sh.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
