#!/usr/bin/env python3
"""Prints one closing line, 'N passed, N failed, N skipped', from the gtest XML reports Bazel
left under bazel-testlogs/ (cached results included). A test target that crashed or timed out
has a Bazel-written report with a failure, so it counts as failed. Each failed case is named, with
the first lines of its failure, just above the closing line: the tail of a CI log says what broke."""
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bazel-testlogs")
passed = failed = skipped = 0
failures = []
for report in sorted(root.glob("tests/**/test.xml")):
    # A target's run_N_of_M reports are from an earlier `--runs_per_test` invocation when the
    # target has a report of its own (the output base outlives checkouts at the same path).
    if re.fullmatch(r"run_\d+_of_\d+", report.parent.name) and (report.parent.parent / "test.xml").exists():
        continue
    try:
        tree = ET.parse(report)
    except ET.ParseError:
        failed += 1
        failures.append(f"{report.parent}: unreadable report")
        continue
    for case in tree.iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            failed += 1
            text = (problem.get("message") or problem.text or "").strip().splitlines()
            failures.append(f"{case.get('classname')}.{case.get('name')} ({report.parent.name}): "
                            + " | ".join(text[:4]))
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
for line in failures:
    print("FAILED " + line[:600])
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
