#!/bin/sh
# Runs the manifest check against the binaries built from this tree.
set -eu
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
MANIFEST_ROOT=k8s exec /usr/bin/python3 tests/k8s/check_manifests.py agent/fusekeeper agent/fkserve/fkserve \
    agent/webhook/fusekeeper-webhook
