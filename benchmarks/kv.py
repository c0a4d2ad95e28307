"""Block-copier bandwidth against one contiguous copy_ of the same bytes (issue #10).

CPU, one layer, vLLM-shaped blocks: 4 KiB ([2, 16 tokens, 1 head, 64] fp16) for
1k / 10k / 100k blocks, and 64 KiB ([2, 16, 8, 128] fp16) for 1k / 10k / 40k
blocks (40k: two caches of 50k blocks, 6.1 GiB, the baseline copying inside
them; 100k would need 2 x 7.6 GiB, over the 8 GiB this shared host allows).
Three id patterns (see `dynamo_ftctl.kv.bench`): gather (random -> a run: an
export into a buffer), scatter (a run -> random: an import) and random
(random -> random). Two host kernels (`--kernels`): the native row-copy kernel
(one pass for every pattern, threaded on torch's own OpenMP threads) and
torch's index_select/index_copy_ (the fallback without a C compiler at install;
random then takes two passes through a staging slot). The copier
and the baseline run with the same torch thread count (1, and torch's default)
and the same cache state (`--cache`: warm, back to back; cold, the host caches
evicted before every timed run), alternate inside each measurement (median of 5), and
the whole measurement runs `--runs` times (default 3) to report the median
ratio, from wall time and from the process's CPU time (which the other users of
a shared host do not inflate by descheduling us; with one thread it is the
fairer figure). Goal: copier bandwidth / contiguous bandwidth >= 0.8. The first
run also prints the chunk-size sweep of torch's random pattern.
With a CUDA device, the same for D2D, D2H and H2D (`--device cuda`).
Usage: python benchmarks/kv.py [--device cuda] [--runs 3] [--threads 1,2]
       [--kernels native,torch] [--cache warm,cold]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

os.environ.setdefault("COLUMNS", "160")  # the tables are wide; keep them whole in a log

from dynamo_ftctl.kv.bench import PATTERNS, run_kv_bench
from dynamo_ftctl.output import emit

GOAL = 0.8
# (label, kv_heads, head_dim, block counts): 4 KiB and 64 KiB blocks of 16 fp16 tokens.
SHAPES = (("4 KiB", 1, 64, (1000, 10_000, 100_000)), ("64 KiB", 8, 128, (1000, 10_000, 40_000)))
# (cache, kernel, threads, block label, route, pattern, blocks)
RowKey = tuple[str, str, int, str, str, str, int]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}",
                        help="torch thread counts, comma-separated (default: 1 and torch's)")
    parser.add_argument("--kernels", default="native,torch",
                        help="host kernels, comma-separated: native, torch")
    parser.add_argument("--cache", default="warm",
                        help="cache states, comma-separated: warm, cold")
    args = parser.parse_args()
    threads = sorted({int(t) for t in args.threads.split(",")})
    kernels = [k for k in args.kernels.split(",") if k]
    caches = [c for c in args.cache.split(",") if c]
    start_load = os.getloadavg()
    print(f"load average at start {start_load[0]:.2f} {start_load[1]:.2f} {start_load[2]:.2f}")
    ratios: dict[RowKey, list[tuple[float, float]]] = {}
    for run in range(args.runs):
        for cache, kernel, count, (label, heads, dim, blocks) in itertools.product(
                caches, kernels, threads, SHAPES):
            sweep = run == 0 and cache == caches[0] and kernel == kernels[0] \
                and count == threads[0] and label == SHAPES[0][0]  # (torch's kernels)
            result = run_kv_bench(
                device=args.device, blocks=blocks, kv_heads=heads, head_dim=dim,
                repeats=5, threads=count, kernel=kernel, cache=cache,
                sweep_chunks=(64 << 10, 256 << 10, 1 << 20, 4 << 20) if sweep else (),
            )
            if run == 0:
                emit(result, json_mode=False)
            for row in result.rows:
                key = (cache, kernel, count, label, row.route, row.pattern, row.blocks)
                ratios.setdefault(key, []).append((row.ratio, row.cpu_ratio))
    load = os.getloadavg()
    print(f"\ncopier / contiguous bandwidth, median of {args.runs} runs (goal >= {GOAL}), "
          f"from wall time and from CPU time; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} on {os.cpu_count()} CPUs:")
    order = {p: i for i, p in enumerate(PATTERNS)}
    for key in sorted(ratios, key=lambda k: (caches.index(k[0]), kernels.index(k[1]), k[2],
                                             k[3], k[4], order[k[5]], k[6])):
        cache, kernel, count, label, route, pattern, n = key
        wall = [w for w, _ in ratios[key]]
        cpu = [c for _, c in ratios[key]]
        med, med_cpu = statistics.median(wall), statistics.median(cpu)
        print(f"  {cache} {kernel:<6} {count} thr  {label:>6} {route} {pattern:<7} {n:>7} blocks: "
              f"wall {med:.3f} "
              f"(runs {', '.join(f'{v:.2f}' for v in wall)})  cpu {med_cpu:.3f} "
              f"(runs {', '.join(f'{v:.2f}' for v in cpu)})  "
              f"goal (wall/cpu): {'met' if med >= GOAL else 'below'}/"
              f"{'met' if med_cpu >= GOAL else 'below'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
