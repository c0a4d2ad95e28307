"""Measured KV-transfer vs re-prefill crossover on `ftctl sim`, against the model (issue #10).

1. Start two sim workers on loopback (a, b) and calibrate a → b
   (`dynamo_ftctl.migrate.calibrate.calibrate`): prefill time at several prompt
   lengths fitted to f + l·n + q·n², and export + import to first token fitted
   to s + n·c. The cost model's crossover of those two fits is the prediction.
2. Independently, move real in-flight requests from a to b at a sweep of
   context lengths, each by KV transfer and by re-prefill, interleaved
   (`migrate_request`, the code `ftctl migrate request` runs), and take the
   median move time per length and method.
3. The measured crossover is where the median re-prefill time overtakes the
   median KV move (linear interpolation between the sweep points around the
   sign change). Goal: within 20% of the prediction.

The machine is shared and noisy: the script runs the sweep `--runs` times
(default 3) and reports the median crossover. Usage: python benchmarks/crossover.py
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import uuid

import httpx

from dynamo_ftctl.engine.launcher import start_worker
from dynamo_ftctl.migrate.calibrate import calibrate, start_in_flight
from dynamo_ftctl.migrate.transfer import Endpoint, migrate_request

TOKEN = "crossover-bench"
CAL_LENGTHS = (16, 64, 128, 256, 384, 512, 768, 1024)
SWEEP = (16, 64, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512, 768)


async def move_time(client: httpx.AsyncClient, a: Endpoint, b: Endpoint, length: int,
                    method: str) -> tuple[int, float]:
    rid = f"bench-{uuid.uuid4().hex[:10]}"
    reader = await start_in_flight(client, a, "ftctl-sim-tiny", length, max_tokens=200,
                                   request_id=rid)
    try:
        result = await migrate_request(client, a, b, rid, method=method)
    finally:
        reader.cancel()
    # Stop the continuation on b: only the time to its first token is measured.
    await client.get(f"{b.admin_url}/admin/kv/{rid}", params={"abort": "true"},
                     headers=b.admin_headers())
    return result.context_tokens, result.move_s


def interpolate_crossover(points: list[tuple[float, float]]) -> float | None:
    """Where y = reprefill − kv turns positive for good: the last <= 0 → > 0 step, linear."""
    found = None
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if y0 <= 0 < y1:
            found = x0 + (x1 - x0) * (-y0) / (y1 - y0)
        elif y1 <= 0:
            found = None
    return found


async def one_run(a: Endpoint, b: Endpoint, repeats: int) -> tuple[float | None, float | None,
                                                                    list[str]]:
    lines = []
    async with httpx.AsyncClient(timeout=120) as client:
        cal = await calibrate(client, a, b, lengths=CAL_LENGTHS, repeats=repeats)
        predicted = cal.crossovers()
        lines.append(
            f"  calibration: prefill = {cal.prefill.fixed_s * 1e3:.2f} ms + "
            f"n·{cal.prefill.per_token_s * 1e6:.2f} µs + "
            f"n²·{cal.prefill.per_token2_s * 1e9:.3f} ns; "
            f"KV move = {cal.transfer.setup_s * 1e3:.2f} ms + "
            f"{cal.transfer.bandwidth_bytes_per_s / 1e6:.0f} MB/s "
            f"({cal.kv_bytes_per_token} B/token)")
        lines.extend(
            f"  calibration sample {p.tokens:5d}: prefill {p.seconds * 1e3:7.2f} ms, "
            f"KV move ({m.tokens} tokens) {m.seconds * 1e3:7.2f} ms"
            for p, m in zip(cal.prefill_samples, cal.transfer_samples, strict=True))
        points = []
        for n in SWEEP:
            kv, rp, ctx = [], [], []
            for _ in range(repeats):
                c, t = await move_time(client, a, b, n, "kv")
                kv.append(t)
                ctx.append(c)
                c, t = await move_time(client, a, b, n, "reprefill")
                rp.append(t)
                ctx.append(c)
            x = statistics.median(ctx)
            points.append((x, statistics.median(rp) - statistics.median(kv)))
            lines.append(f"  context {x:6.0f}: kv {statistics.median(kv) * 1e3:7.2f} ms, "
                         f"re-prefill {statistics.median(rp) * 1e3:7.2f} ms")
        measured = interpolate_crossover(points)
    return (predicted[0] if predicted else None), measured, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    wa = start_worker("a", admin_token=TOKEN, timeout_s=120)
    wb = start_worker("b", admin_token=TOKEN, timeout_s=120)
    try:
        a = Endpoint("a", wa.url, wa.url, TOKEN)
        b = Endpoint("b", wb.url, wb.url, TOKEN)
        results = []
        for run in range(args.runs):
            predicted, measured, lines = asyncio.run(one_run(a, b, args.repeats))
            print(f"run {run + 1}:")
            print("\n".join(lines))
            print(f"  predicted crossover {predicted and round(predicted)} tokens, "
                  f"measured {measured and round(measured)} tokens")
            if predicted and measured:
                results.append((predicted, measured))
    finally:
        wa.stop(timeout_s=3)
        wb.stop(timeout_s=3)
    if not results:
        print("no crossover found in the sweep")
        return 1
    pred = statistics.median(p for p, _ in results)
    meas = statistics.median(m for _, m in results)
    errors = [abs(m - p) / p for p, m in results]
    err = statistics.median(errors)
    print(f"\ncrossover on ftctl sim (median of {len(results)} runs): predicted {pred:.0f} tokens, "
          f"measured {meas:.0f} tokens, error {err:.1%} (per run: "
          f"{', '.join(f'{e:.1%}' for e in errors)}); goal <= 20%: "
          f"{'met' if err <= 0.2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
