#!/usr/bin/env python3
"""Prints one closing line, 'N passed, N failed, N skipped', from the gtest XML reports Bazel
left under bazel-testlogs/ (cached results included). A test target that crashed or timed out
has a Bazel-written report with a failure, so it counts as failed."""
import pathlib
import sys
import xml.etree.ElementTree as ET

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bazel-testlogs")
passed = failed = skipped = 0
for report in sorted(root.glob("tests/**/test.xml")):
    try:
        tree = ET.parse(report)
    except ET.ParseError:
        failed += 1
        continue
    for case in tree.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
