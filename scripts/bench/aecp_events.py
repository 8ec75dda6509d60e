#!/usr/bin/env python3
"""Write an AECP artifact index for `awcpfs export --aecp-events` (scripts/bench.sh --only aecp).

One index event per line (NDJSON): N knowledge artifacts, bound round-robin to the regular
files under ROOT (.git left out) and, one in 50, to their directories - what a workspace
with N published findings looks like to a mount's replica. The claims are fixed-size
filler; statuses alternate checked / unchecked.
"""

import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="the exported directory")
    ap.add_argument("--n", type=int, default=10000, help="artifacts (default 10000)")
    a = ap.parse_args()
    files = []
    for dirpath, dirnames, filenames in os.walk(a.root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        rel = os.path.relpath(dirpath, a.root)
        for f in sorted(filenames):
            files.append(f if rel == "." else f"{rel}/{f}")
    if not files:
        sys.exit(f"aecp_events: no files under {a.root}")
    out = sys.stdout
    for i in range(a.n):
        path = files[i % len(files)]
        if i % 50 == 49 and "/" in path:
            path = path.rsplit("/", 1)[0]
            scope = {"kind": "dir", "target": path}
        else:
            scope = {"kind": "file", "target": path}
        artifact = {
            "id": i + 1,
            "claim": f"bench finding {i + 1}: " + "x" * 120,
            "scope": scope,
            "bound": path,
            "status": "checked" if i % 2 else "unchecked",
            "producer": "bench",
            "createdMs": 1_700_000_000_000 + i,
            "revision": 1,
        }
        out.write(json.dumps({"type": "artifact", "artifact": artifact}) + "\n")


if __name__ == "__main__":
    main()
