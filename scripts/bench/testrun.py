#!/usr/bin/env python3
"""A test run's file accesses, without a test framework: walk DIR, stat and read every file
(as pytest collecting a package and importing its modules would), print how many files and
bytes it read. Used by scripts/bench.sh's cold workload as the agent's first test run."""

import os
import sys


def main():
    files = nbytes = 0
    for root, dirs, names in os.walk(sys.argv[1]):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            os.stat(path)
            with open(path, "rb") as f:
                nbytes += len(f.read())
            files += 1
    print(f"{files} files, {nbytes} bytes")


if __name__ == "__main__":
    main()
