"""Block-copier bandwidth against one contiguous copy_ of the same bytes (issue #10).

CPU: 4 KiB vLLM-shaped blocks ([2, 16 tokens, 1 head, 64] fp16, one layer),
random source and destination ids, 1k / 10k / 100k blocks; the copier and the
baseline alternate inside each measurement (median of 5), and the whole
measurement runs `--runs` times (default 3) to report the median ratio.
Goal: copier bandwidth / contiguous bandwidth >= 0.8. Then a chunk-size sweep.
With a CUDA device, the same for D2D, D2H and H2D (`--device cuda`).
Usage: python benchmarks/kv.py [--device cuda] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from dynamo_ftctl.kv.bench import run_kv_bench
from dynamo_ftctl.output import emit

GOAL = 0.8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--blocks", default="1000,10000,100000")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    ratios: dict[tuple[str, int], list[float]] = {}
    for run in range(args.runs):
        result = run_kv_bench(device=args.device, blocks=blocks, repeats=5,
                              sweep_chunks=() if run else (64 << 10, 256 << 10, 1 << 20,
                                                           4 << 20, 16 << 20))
        if run == 0:
            emit(result, json_mode=False)
        for row in result.rows:
            ratios.setdefault((row.route, row.blocks), []).append(row.ratio)
    print(f"\ncopier / contiguous bandwidth, median of {args.runs} runs (goal >= {GOAL}):")
    for (route, n), values in ratios.items():
        med = statistics.median(values)
        print(f"  {route} {n:>7} blocks: {med:.3f}  (runs: {', '.join(f'{v:.3f}' for v in values)})"
              f"  {'met' if med >= GOAL else 'below goal'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
