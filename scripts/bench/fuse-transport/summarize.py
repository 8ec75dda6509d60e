import csv, statistics, sys, collections
rows = list(csv.DictReader(open(sys.argv[1] if len(sys.argv) > 1 else 'results.csv')))
g = collections.defaultdict(list)
for r in rows:
    g[(r['test'], r['variant'])].append(r)
REQS = {'lstat1': 20200, 'lstat20': 20200, 'write4k': 5000}   # FUSE requests per test (LOOKUPs / WRITEs)
order = ['ext4', 'legacy1', 'legacy2', 'uring1', 'uring2', 'uring8', 'legacy1p', 'uring2p', 'awcpfs', 'awcpfs-uring', 'awcpfs-uring-b']
for test in ['lstat1', 'lstat20', 'write4k']:
    print(f"\n{test}:  n | median wall ms (min-max) | us/request median (min-max) | bad | load1 median")
    for v in order:
        rs = g.get((test, v))
        if not rs: continue
        w = sorted(float(x['wall_us']) for x in rs)
        per = [x / REQS[test] for x in w]
        bad = sum(int(x['bad'] or 0) for x in rs)
        load = statistics.median(float(x['load1']) for x in rs)
        print(f"  {v:12s} {len(w):2d} | {statistics.median(w)/1000:8.1f} ({w[0]/1000:.1f}-{w[-1]/1000:.1f}) | "
              f"{statistics.median(per):6.2f} ({per[0]:.2f}-{per[-1]:.2f}) | {bad} | {load:.2f}")
