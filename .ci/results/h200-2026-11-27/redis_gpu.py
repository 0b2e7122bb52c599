"""Issue 14's Redis targets on a machine with enough cores for the servers: the tier (this commit)
against a local 3-master cluster, 3 rounds per block size, with kvoff bench tiers' bench_redis."""
import json, os, platform, subprocess, sys, time, datetime
from kvoff.tiers.redis_cluster import LocalRedisCluster
from kvoff.tools.bench_tiers import bench_redis
rows = []
with LocalRedisCluster(3) as c:
    for rep in range(3):
        for bs in (65536, 524288, 2097152):
            r = bench_redis(c.url, bs, 256 << 20, 32 << 20, 256, 100)
            r["round"] = rep
            rows.append(r)
            print(f"{bs:>8} round {rep}: put {r['put_gbps']:.2f} get {r['get_gbps']:.2f} GB/s lookup {r['lookup_us_per_key']:.1f} us/key corrupted {r['corrupted_blocks']}", flush=True)
out = {"run": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"cpu": subprocess.run(["sh", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True).stdout.strip(), "cores": os.cpu_count(), "platform": platform.platform()},
               "redis_server": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip(),
               "command": "python3 .scratch/redis_gpu.py (Debian's redis-server 7.0.15 debs unpacked with dpkg -x)", "script": open(__file__).read()},
       "rows": rows}
json.dump(out, open(sys.argv[1], "w"), indent=1)
