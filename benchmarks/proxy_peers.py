"""Issue 33: `ftctl proxy`'s CPU per request against nginx and the Rust LLM routers.

Four proxies forward to the same trivial upstream (`dynamo_ftctl.loadgen.target`): nginx
(the config of benchmarks/proxy_nginx.py: one process, upstream keep-alive, no
buffering), `vllm-router` 0.1.17 and `sglang-router` 0.3.2 (PyPI; each installed once
into a venv of its own under ~/.cache/ftctl/, default configuration but for the listen
and metrics ports, the upstream as `--worker-urls`, logs to /dev/null) and `ftctl proxy`
(an inventory of one worker, the target). Each in turn runs on CPU 0 (started under
`taskset`, so the routers' Rust runtimes see one core and every thread stays there); wrk
(one thread, 32 connections) and the upstream on the other core. A router whose install
or start fails is left out with a line saying why.

Two loads: non-streamed requests of 16 tokens, streamed requests of 64 tokens. What
decides is each proxy's CPU over a run: utime + stime of its process and every
descendant (/proc/PID/stat counts a process's threads), per 1,000 requests, so that the
client's shared core does not. Runs alternate between the proxies `--repeat` times;
medians. Goal: ftctl proxy's CPU per request <= the best Rust router's, in both rows.

`--compiled` adds a column: this tree's proxy with hatch_build.MYPYC_MODULES compiled by
mypyc (`make compiled`'s build, into a temporary copy of src/), judged against the goal
too (the goal is met when either build meets it in both rows). `--whole` adds a column
for each ftctl build with `proxy.whole_max_tokens: 256` (a non-streamed request of 16
tokens gets one whole upstream answer, docs/proxy.md; streamed requests are unchanged).

Usage: python benchmarks/proxy_peers.py [--seconds S] [--repeat N] [--only NAME ...]
[--compiled] [--baseline-src DIR] (DIR: another source tree whose ftctl proxy runs beside
this one). The verdict is printed; the exit status is 0 either way (`make bench` runs on
to the next script), non-zero only when nothing could be measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from proxy import cpu_seconds, free_port, stop  # benchmarks/proxy.py
from proxy_nginx import (
    CLIENT_CPU,
    CONNECTIONS,
    LOADS,
    PROXY_CPU,
    ROOT,
    Run,
    start_nginx,
    start_proxy,
    start_target,
    wait_http,
    wrk,
)

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftctl"
# name -> (PyPI requirement, the venv's command line before the router's options)
ROUTERS = {
    "vllm-router": ("vllm-router==0.1.17", ["bin/vllm-router"]),
    "sglang-router": ("sglang-router==0.3.2", ["bin/python", "-m", "sglang_router.launch_router"]),
}
RUST = tuple(ROUTERS)
LABEL_FTCTL = "ftctl proxy"
LABEL_COMPILED = "ftctl mypyc"
WHOLE = " whole"  # the label's suffix with whole answers on
WHOLE_MAX_TOKENS = 256


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, its threads and its live descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since the listing
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:
            continue
        todo.extend(children.get(current, ()))
    return total


def install(name: str) -> Path | str:
    """The router's venv (installed on first use), or why it is not there (one line)."""
    requirement, _ = ROUTERS[name]
    venv = CACHE / requirement.replace("==", "-")
    ready = venv / ".installed"
    if ready.exists():
        return venv
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                       capture_output=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement],
                       check=True, capture_output=True, timeout=900)
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or exc.stdout or b"").decode(errors="replace").strip().splitlines()
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        return f"pip install {requirement} failed: {errors[0] if errors else exc.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"pip install {requirement} failed: {exc}"
    ready.touch()
    return venv


def start_router(name: str, venv: Path, upstream: int) -> tuple[subprocess.Popen[bytes], str]:
    """The router on CPU 0 with its defaults, one worker: the upstream."""
    _, command = ROUTERS[name]
    port = free_port()
    args = ["taskset", "-c", str(PROXY_CPU), str(venv / command[0]), *command[1:],
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", f"http://127.0.0.1:{upstream}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc, deadline_s=60)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    return proc, url


def compiled_tree(directory: Path) -> Path:
    """A copy of this tree's src/ under `directory` with MYPYC_MODULES compiled (the
    root of a tree: `start_proxy` runs its src/)."""
    spec = importlib.util.spec_from_file_location("_ftctl_hatch_build", ROOT / "hatch_build.py")
    assert spec is not None
    assert spec.loader is not None
    hatch_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hatch_build)
    tree = directory / "compiled"
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    built = hatch_build.compile_modules(ROOT, tree / "src")
    if isinstance(built, str):
        raise SystemExit(built)
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="each wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each proxy per load")
    parser.add_argument("--only", nargs="+", choices=RUST, default=list(RUST),
                        help="the Rust routers to run")
    parser.add_argument("--compiled", action="store_true",
                        help="also this tree's proxy with its hot modules compiled by mypyc")
    parser.add_argument("--whole", action="store_true",
                        help="also each ftctl build with proxy.whole_max_tokens: "
                             f"{WHOLE_MAX_TOKENS}")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="another source tree whose ftctl proxy runs beside this one")
    args = parser.parse_args()
    if shutil.which("wrk") is None or not (shutil.which("nginx") or
                                           Path("/usr/sbin/nginx").exists()):
        msg = "needs wrk and nginx (make debs)"
        raise SystemExit(msg)
    if len(os.sched_getaffinity(0)) < 2:
        print("note: one CPU: proxy and client share it")
    venvs: dict[str, Path] = {}
    for name in args.only:
        found = install(name)
        if isinstance(found, str):
            print(f"{name}: skipped ({found})")
        else:
            venvs[name] = found
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ftctl-peers-") as tmp, \
            contextlib.ExitStack() as started:
        directory = Path(tmp)
        target, upstream = start_target()
        started.callback(stop, target)
        labels = ["nginx"]
        procs = [start_nginx(directory, upstream)]
        started.callback(stop, procs[-1][0])
        for name, venv in venvs.items():
            try:
                procs.append(start_router(name, venv, upstream))
            except SystemExit as exc:
                print(f"{name}: skipped (did not start: {exc})")
                continue
            started.callback(stop, procs[-1][0])
            labels.append(name)
        trees = [(LABEL_FTCTL, ROOT)]
        if args.compiled:
            trees.append((LABEL_COMPILED, compiled_tree(directory)))
        if args.baseline_src is not None:
            trees.append(("baseline ftctl", args.baseline_src.resolve()))
        if args.whole:
            trees += [(label + WHOLE, src) for label, src in trees
                      if label in (LABEL_FTCTL, LABEL_COMPILED)]
        for label, src in trees:
            procs.append(start_proxy(directory, upstream, src,
                                     WHOLE_MAX_TOKENS if label.endswith(WHOLE) else 0))
            started.callback(stop, procs[-1][0])
            labels.append(label)
        results = measure(labels, procs, directory, args)
    return report(labels, results, args, load_before)


def measure(labels: list[str], procs: list[tuple[subprocess.Popen[bytes], str]],
            directory: Path, args: argparse.Namespace) -> dict[tuple[str, str], list[Run]]:
    results: dict[tuple[str, str], list[Run]] = {}
    for load, (tokens, stream) in LOADS.items():
        for proc, url in procs:  # warm-up: connections, caches, the first requests
            wrk(url, proc.pid, directory, 1, tokens=tokens, stream=stream,
                cpu_of=tree_cpu_seconds)
        for _ in range(args.repeat):
            for label, (proc, url) in zip(labels, procs, strict=True):
                results.setdefault((label, load), []).append(
                    wrk(url, proc.pid, directory, args.seconds, tokens=tokens,
                        stream=stream, cpu_of=tree_cpu_seconds))
    return results


def report(labels: list[str], results: dict[tuple[str, str], list[Run]],
           args: argparse.Namespace, load_before: tuple[float, float, float]) -> int:
    """Print the table and the verdict; the exit status (0)."""
    print(f"CPU-s per 1,000 requests (proxy on CPU {PROXY_CPU}, wrk + target on CPU "
          f"{CLIENT_CPU}, {CONNECTIONS} connections; median of {args.repeat} runs of "
          f"{args.seconds:g} s, alternating)")
    rows = {"non-streamed": "non-streamed 16 tokens", "streamed": "streamed 64 tokens"}
    rust = [label for label in labels if label in RUST]
    ours = [label for label in (LABEL_FTCTL, LABEL_COMPILED, LABEL_FTCTL + WHOLE,
                                LABEL_COMPILED + WHOLE) if label in labels]
    print(f"{'':<24}" + "".join(f"{label:>18}" for label in labels)
          + (f"  ftctl / best Rust ({', '.join(ours)})" if rust else ""))
    row_met: dict[str, set[str]] = {}
    for load, title in rows.items():
        median = {label: statistics.median(r.cpu_s / max(r.requests, 1) * 1000
                                           for r in results[label, load])
                  for label in labels}
        line = f"{title:<24}" + "".join(f"{median[label]:>18.3f}" for label in labels)
        if rust:
            best = min(rust, key=median.__getitem__)
            ratios = [median[label] / median[best] for label in ours]
            row_met[load] = {label for label, r in zip(ours, ratios, strict=True) if r <= 1.0}
            line += "  " + ", ".join(f"{r:.2f}x" for r in ratios) + f" ({best})"
        print(line)
        rps = "  ".join(f"{label} {statistics.median(r.rps for r in results[label, load]):,.0f}"
                        for label in labels)
        print(f"{'':<24}req/s: {rps}")
        late = {label: sum(r.timeouts for r in results[label, load]) for label in labels}
        if any(late.values()):
            print(f"{'':<24}wrk timeouts (> 2 s, a starved machine): " + "  ".join(
                f"{label} {n}" for label, n in late.items() if n))
    after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {after[0]:.2f} (1 min)")
    if not rust:
        print("goal not judged: no Rust router ran")
        return 0
    met = set.intersection(*row_met.values())
    print(f"goal (ftctl proxy CPU per request <= the best Rust router's, both rows): "
          f"{'MET by ' + ', '.join(sorted(met)) if met else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
