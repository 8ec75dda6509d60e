#!/usr/bin/env python3
"""Generate the synthetic workspace that scripts/bench.sh measures.

Layout below --root (each part is a separate directory so each can be exported on its own):

  repo/      a git repository of --files files, log-normal sizes around 3 KiB
             (median 3 KiB, sigma 1.0, capped at 1 MiB), in a nested tree
             (about 24 files per directory, fan-out 8), committed and packed
  repo-1k/   the same kind of repository with 1,000 files (delegate-time baseline)
  big/       big.bin, --big-mib MiB of incompressible data
  cproj/     a C project of --c-units units; every unit includes 30 headers found
             through three -I directories (include/core, include/util, include/net);
             a Makefile with header dependency tracking (-MMD)
  scratch/   an empty directory (close -> visible latency)

Deterministic for a given --seed. Needs only python3 and git.
"""

import argparse
import math
import os
import random
import subprocess
import sys

WORDS = (
    "static const int void return struct if else for while unsigned size_t buffer "
    "index value count error result handle config manifest block cache inode entry "
    "lease token commit journal export mount fetch sync delegate executor workspace"
).split()


def text_pool(rng: random.Random, size: int) -> bytes:
    """A pool of code-like text to cut file contents from (compresses like source)."""
    out = []
    n = 0
    while n < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        line = "    " * rng.randint(0, 3) + line + ";\n"
        out.append(line)
        n += len(line)
    return "".join(out).encode()[:size]


def lognormal_size(rng: random.Random) -> int:
    # median 3 KiB; mean about 5 KiB; capped at 1 MiB, at least 1 byte
    s = int(rng.lognormvariate(math.log(3072), 1.0))
    return max(1, min(s, 1 << 20))


def dir_paths(n_dirs: int, fanout: int):
    """Breadth-first nested directory names: d00, d00/d00, ... (n_dirs of them)."""
    paths = []
    frontier = [""]
    while len(paths) < n_dirs:
        nxt = []
        for parent in frontier:
            for i in range(fanout):
                p = f"{parent}d{i:02d}" if not parent else f"{parent}/d{i:02d}"
                paths.append(p)
                nxt.append(p)
                if len(paths) >= n_dirs:
                    return paths
        frontier = nxt
    return paths


def git(cwd, *args):
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@example.invalid",
        GIT_COMMITTER_NAME="bench", GIT_COMMITTER_EMAIL="bench@example.invalid",
        GIT_AUTHOR_DATE="2024-01-01T00:00:00Z", GIT_COMMITTER_DATE="2024-01-01T00:00:00Z",
    )
    # no automatic (detached) gc or maintenance: it would race with the explicit gc below
    subprocess.run(["git", "-c", "gc.auto=0", "-c", "maintenance.auto=false", *args],
                   cwd=cwd, check=True, env=env,
                   stdout=subprocess.DEVNULL)


def gen_repo(path: str, files: int, rng: random.Random, pool: bytes):
    os.makedirs(path)
    per_dir = 24
    dirs = dir_paths(max(1, math.ceil(files / per_dir)), 8)
    exts = [".c", ".h", ".py", ".rs", ".md", ".txt", ".json"]
    total = 0
    for i in range(files):
        d = dirs[i % len(dirs)]
        os.makedirs(os.path.join(path, d), exist_ok=True)
        size = lognormal_size(rng)
        off = rng.randrange(0, len(pool) - size) if size < len(pool) else 0
        data = pool[off:off + size]
        if len(data) < size:  # larger than the pool: repeat it
            data = (pool * (size // len(pool) + 1))[:size]
        name = f"f{i:06d}{exts[i % len(exts)]}"
        with open(os.path.join(path, d, name), "wb") as f:
            f.write(data)
        total += size
    with open(os.path.join(path, ".gitignore"), "w") as f:
        f.write("*.o\n")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "synthetic repository")
    git(path, "gc", "-q")
    # leave the index refreshed with native stat data, as a Delegator's would be
    subprocess.run(["git", "status", "--porcelain"], cwd=path, check=True,
                   stdout=subprocess.DEVNULL)
    return total


def gen_big(path: str, mib: int):
    os.makedirs(path)
    with open(os.path.join(path, "big.bin"), "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))


def gen_cproj(path: str, units: int, rng: random.Random):
    inc_dirs = ["include/core", "include/util", "include/net"]
    headers = []
    for d in inc_dirs:
        os.makedirs(os.path.join(path, d))
        short = d.split("/")[1]
        for j in range(10):
            name = f"{short}_{j:02d}.h"
            guard = f"{short.upper()}_{j:02d}_H"
            body = [f"#ifndef {guard}", f"#define {guard}", "#include <stddef.h>",
                    "#include <stdint.h>", "#include <string.h>", ""]
            body.append(f"struct {short}_{j:02d}_state {{ uint64_t a, b, c; "
                        f"unsigned char buf[64]; }};")
            for k in range(6):
                body.append(
                    f"static inline uint64_t {short}_{j:02d}_f{k}(uint64_t x) "
                    f"{{ x ^= x << {(k % 7) + 3}; x ^= x >> {(k % 5) + 7}; "
                    f"return x * {rng.randrange(3, 1 << 30) | 1}ULL; }}")
            body.append(f"uint64_t {short}_{j:02d}_api(const struct {short}_{j:02d}_state *s);")
            body += ["", f"#endif /* {guard} */", ""]
            with open(os.path.join(path, d, name), "w") as f:
                f.write("\n".join(body))
            headers.append(name)
    os.makedirs(os.path.join(path, "src"))
    for u in range(units):
        lines = [f'#include "{h}"' for h in headers]
        lines.append("")
        for k in range(4):
            h1, h2 = rng.sample(headers, 2)
            p1, p2 = h1[:-2], h2[:-2]
            lines.append(f"uint64_t unit{u:03d}_fn{k}(uint64_t seed) {{")
            lines.append("    uint64_t acc = seed;")
            lines.append(f"    for (int i = 0; i < {rng.randint(8, 64)}; i++) {{")
            lines.append(f"        acc = {p1}_f{k}(acc) + {p2}_f{(k + 1) % 6}(acc ^ i);")
            lines.append("    }")
            lines.append("    return acc;")
            lines.append("}")
            lines.append("")
        with open(os.path.join(path, "src", f"unit{u:03d}.c"), "w") as f:
            f.write("\n".join(lines))
    main = ["#include <stdio.h>", "#include <stdint.h>"]
    main += [f"uint64_t unit{u:03d}_fn0(uint64_t);" for u in range(units)]
    main += ["int main(void) {", "    uint64_t acc = 1;"]
    main += [f"    acc += unit{u:03d}_fn0(acc);" for u in range(units)]
    main += ['    printf("%llu\\n", (unsigned long long)acc);', "    return 0;", "}", ""]
    with open(os.path.join(path, "src", "main.c"), "w") as f:
        f.write("\n".join(main))
    makefile = """\
CC ?= gcc
CFLAGS ?= -O1 -g
CPPFLAGS := -Iinclude/core -Iinclude/util -Iinclude/net
SRCS := $(wildcard src/*.c)
OBJS := $(patsubst src/%.c,build/%.o,$(SRCS))

app: $(OBJS)
\t$(CC) -o $@ $^

build/%.o: src/%.c | build
\t$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c -o $@ $<

build:
\tmkdir -p build

clean:
\trm -rf build app

.PHONY: clean
-include $(OBJS:.o=.d)
"""
    with open(os.path.join(path, "Makefile"), "w") as f:
        f.write(makefile)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--big-mib", type=int, default=512)
    ap.add_argument("--c-units", type=int, default=300)
    ap.add_argument("--seed", type=int, default=20240101)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    pool = text_pool(rng, 2 << 20)
    os.makedirs(a.root, exist_ok=True)
    total = gen_repo(os.path.join(a.root, "repo"), a.files, rng, pool)
    gen_repo(os.path.join(a.root, "repo-1k"), 1000, rng, pool)
    gen_big(os.path.join(a.root, "big"), a.big_mib)
    gen_cproj(os.path.join(a.root, "cproj"), a.c_units, rng)
    os.makedirs(os.path.join(a.root, "scratch"))
    print(f"generated: repo {a.files} files ({total / 1048576:.1f} MiB), "
          f"repo-1k 1000 files, big.bin {a.big_mib} MiB, cproj {a.c_units} units",
          file=sys.stderr)


if __name__ == "__main__":
    main()
