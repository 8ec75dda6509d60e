#!/usr/bin/env python3
"""How a file's cached pages are held by the kernel: order-0 pages or large folios.

Maps the file (up to --max-mib), touches every page (from the page cache when the file is
cached: read it once first), then looks each page up in /proc/self/pagemap and
/proc/kpageflags. Needs root (kpageflags and page frame numbers are root-only).

    python3 scripts/bench/folios.py /mnt/awcpfs/big/big.bin /native/big/big.bin

prints, per file, how many pages are the head or a tail of a large folio and how many
are order-0. A FUSE mount's page cache on Linux 6.18 holds order-0 pages only; ext4
holds large folios: the kernel's per-page work on a warm sequential read differs
accordingly (see docs/BENCHMARKS.md, "Against the targets").
"""

import argparse
import mmap
import os
import struct

PAGE = os.sysconf("SC_PAGE_SIZE")
KPF_COMPOUND_HEAD = 15
KPF_COMPOUND_TAIL = 16


def census(path, max_bytes):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = min(os.fstat(fd).st_size, max_bytes) // PAGE * PAGE
        if size == 0:
            return None
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    # mmap objects do not expose their address: find the mapping in /proc/self/maps.
    base = None
    name = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == name:
                base = int(fields[0].split("-")[0], 16)
                break
    if base is None:
        m.close()
        raise SystemExit(f"{path}: mapping not found in /proc/self/maps")
    for off in range(0, size, PAGE):
        _ = m[off]
    counts = {"head": 0, "tail": 0, "order0": 0, "absent": 0}
    with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
        for i in range(size // PAGE):
            pm.seek((base // PAGE + i) * 8)
            entry = struct.unpack("Q", pm.read(8))[0]
            if not entry >> 63:
                counts["absent"] += 1
                continue
            pfn = entry & ((1 << 55) - 1)
            kf.seek(pfn * 8)
            flags = struct.unpack("Q", kf.read(8))[0]
            if flags >> KPF_COMPOUND_HEAD & 1:
                counts["head"] += 1
            elif flags >> KPF_COMPOUND_TAIL & 1:
                counts["tail"] += 1
            else:
                counts["order0"] += 1
    m.close()
    return size // PAGE, counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--max-mib", type=int, default=64, help="look at the first N MiB")
    args = ap.parse_args()
    for path in args.files:
        result = census(path, args.max_mib << 20)
        if result is None:
            print(f"{path}: empty")
            continue
        pages, c = result
        large = c["head"] + c["tail"]
        print(
            f"{path}: {pages} pages, {large} in large folios ({c['head']} folios), "
            f"{c['order0']} order-0, {c['absent']} not mapped"
        )


if __name__ == "__main__":
    main()
