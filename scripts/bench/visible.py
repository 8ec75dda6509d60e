#!/usr/bin/env python3
"""close -> visible latency: write a file through a mount, close it, and poll the
Delegator's (source) directory until the same bytes appear there.

Prints one latency in seconds per line (or "fail" when a sample timed out).
"""

import argparse
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mount-dir", required=True, help="directory on the mount")
    ap.add_argument("--source-dir", required=True, help="the same directory at the source")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=10.0, help="per sample, seconds")
    ap.add_argument("--poll", type=float, default=0.0005, help="poll interval, seconds")
    ap.add_argument("--gap", type=float, default=0.05, help="pause between samples")
    a = ap.parse_args()
    tag = f"{os.getpid()}-{time.time_ns()}"
    for i in range(a.samples):
        name = f"visible-{tag}-{i:03d}.txt"
        payload = f"sample {i} {tag} {time.time_ns()}\n".encode() * 4
        src = os.path.join(a.source_dir, name)
        with open(os.path.join(a.mount_dir, name), "wb") as f:
            f.write(payload)
        t0 = time.perf_counter()  # close() returned
        deadline = t0 + a.timeout
        seen = False
        while time.perf_counter() < deadline:
            try:
                with open(src, "rb") as f:
                    if f.read() == payload:
                        seen = True
                        break
            except FileNotFoundError:
                pass
            time.sleep(a.poll)
        t1 = time.perf_counter()
        print(f"{t1 - t0:.6f}" if seen else "fail", flush=True)
        time.sleep(a.gap)


if __name__ == "__main__":
    main()
