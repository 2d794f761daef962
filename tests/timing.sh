#!/usr/bin/env bash
# Where the suite's time goes, from ctest's own record of its last run:
#
#   tests/timing.sh [BUILD_DIR]        (default: build)
#
# Prints the run's wall time against the sum of its cases' times (how much ran side by side),
# the time per label, the 20 slowest cases, and the critical path: with no case depending on
# another, no -j can finish the run sooner than its longest case, nor sooner than the busy
# time spread over the CPUs. The sanitizer runs (sanitize.address, sanitize.thread) are cases
# of their own here; their inner runs are broken down the same way below them, from the
# sanitizer trees' own logs.
set -euo pipefail
build=${1:-build}
[[ -f $build/Testing/Temporary/LastTest.log ]] ||
    { echo "timing.sh: $build/Testing/Temporary/LastTest.log not found: run ctest in $build first" >&2; exit 2; }
# `ctest -N` starts a new LastTest.log: keep the run's, and put it back after listing.
saved=$(mktemp -d)
trap 'rm -rf "$saved"' EXIT
cp "$build/Testing/Temporary/LastTest.log" "$saved/"
ctest --test-dir "$build" --show-only=json-v1 >"$saved/tests.json"
cp "$saved/LastTest.log" "$build/Testing/Temporary/LastTest.log"
python3 - "$build" "$saved" <<'EOF'
import json, os, re, shutil, subprocess, sys
from collections import defaultdict

build, saved = sys.argv[1], sys.argv[2]

def last_run(testing_dir, path=None):
    """({case: seconds}, {case: status}) of the last ctest run there."""
    path = path or os.path.join(testing_dir, "Temporary", "LastTest.log")
    if not os.path.exists(path):
        return {}, {}
    times, status, current = {}, {}, None
    for line in open(path, errors="replace"):
        m = re.match(r"^\d+/\d+ Test: (.*)$", line)
        if m:
            current = m.group(1).strip()
            continue
        m = re.match(r"^Test time =\s+([\d.]+) sec", line)
        if m and current:
            times[current] = float(m.group(1))
            continue
        # The case's own output may print "Test project ..." (a sanitizer run's ctest).
        m = re.match(r"^Test (Passed|Failed|Skipped|Not Run|Timeout)", line)
        if m and current and current not in status:
            status[current] = m.group(1)
    return times, status

def labels_of(path):
    out = {}
    return labels_of_json(open(path).read()) if os.path.exists(path) else out

def labels_of_json(text):
    out = {}
    for t in json.loads(text or "{}").get("tests", []):
        for p in t.get("properties", []):
            if p["name"] == "LABELS":
                out[t["name"]] = p["value"]
    return out

def report(title, testing_dir, labels, indent="", log=None):
    times, status = last_run(testing_dir, log)
    if not times:
        return
    total = sum(times.values())
    print(f"{indent}{title}: {len(times)} cases, {total:.0f} s of case time")
    per_label = defaultdict(lambda: [0, 0.0])
    for name, secs in times.items():
        for label in labels.get(name, ["(none)"]):
            per_label[label][0] += 1
            per_label[label][1] += secs
    print(f"{indent}  per label (a case counts under each of its labels):")
    for label, (n, secs) in sorted(per_label.items(), key=lambda kv: -kv[1][1]):
        print(f"{indent}    {label:<24} {n:>5} cases {secs:>8.1f} s")
    longest = max(times.items(), key=lambda kv: kv[1])
    print(f"{indent}  critical path: {longest[1]:.1f} s, the longest case ({longest[0]}); "
          f"busy time over 2 CPUs would be {total / 2:.0f} s if every case were CPU-bound")
    print(f"{indent}  the 20 slowest:")
    for name, secs in sorted(times.items(), key=lambda kv: -kv[1])[:20]:
        labs = ",".join(labels.get(name, []))
        print(f"{indent}    {secs:>8.1f} s  {name}  [{labs}]")
    failed = [n for n, s in status.items() if s not in ("Passed", "Skipped")]
    if failed:
        print(f"{indent}  not passed: {', '.join(sorted(failed))}")

labels = labels_of(os.path.join(saved, "tests.json"))
report("ctest", None, labels, log=os.path.join(saved, "LastTest.log"))
for kind in ("address", "thread"):
    tree = os.path.join(build, f"sanitize-{kind}")
    if not os.path.isdir(tree):
        continue
    print()
    # The sanitizer tree's own cases, then the main tree's relay cases against its relay.
    for sub, title in ((tree, f"sanitize.{kind}: in-process cases"),
                       (os.path.join(tree, "relay-cases"), f"sanitize.{kind}: relay cases")):
        # The relay cases are the main tree's, with its labels; the tree's own carry theirs,
        # which its ctest knows.
        if sub.endswith("relay-cases"):
            own = labels
            log = None
        else:
            # Kept before listing: `ctest -N` starts a new LastTest.log there too.
            log = os.path.join(saved, f"{kind}-LastTest.log")
            src = os.path.join(sub, "Testing", "Temporary", "LastTest.log")
            if not os.path.exists(src):
                continue
            shutil.copy(src, log)
            listing = subprocess.run(["ctest", "--test-dir", tree, "--show-only=json-v1"],
                                     capture_output=True, text=True).stdout
            shutil.copy(log, src)
            own = labels_of_json(listing)
        report(title, os.path.join(sub, "Testing"), own, "  ", log)
EOF
