"""Helpers shared by the benchmark scripts: memory probes, forked ranks, tables and output files.

The scripts run from the repository root or anywhere else: `REPO` is this file's repository, and
relative paths in the configs (data/demo/...) are resolved by running from it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORES = os.cpu_count() or 1
# libgomp reads OMP_WAIT_POLICY once, when torch loads it: forked ranks inherit the parent's choice, so it
# is set here, before any torch import. Spinning threads would steal the other ranks' cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ---------------------------------------------------------------------------------- memory


def maxrss_mb() -> float:
    """Peak resident set of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def vm_hwm_mb() -> float:
    """VmHWM from /proc/self/status (the kernel's RSS high-water mark), or ru_maxrss elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return maxrss_mb()


def vm_rss_mb() -> float:
    """Current resident set (VmRSS), 0.0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# ---------------------------------------------------------------------------------- environment


def thread_env(ranks: int) -> dict[str, str]:
    """OpenMP settings so that ranks x threads = the machine's cores, with sleeping (not spinning) waits."""
    threads = max(1, CORES // ranks)
    return {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}


def load_average() -> float:
    """1-minute load average: other work on this machine skews every number a benchmark reports."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def load_note(start: float, end: float) -> str:
    """A warning for the report when the machine was not idle before the benchmark started."""
    busy = start > 0.5 * CORES
    state = "BUSY: other processes competed for the cores, treat the numbers as noisy" if busy else "idle"
    return f"Machine load (1-min avg) {start:.1f} before / {end:.1f} after on {CORES} cores of {cpu_name()}: {state}."


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family/model and widest vector unit: the same
    "AMD EPYC" name covers generations whose memory and vector speeds differ by 2x."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        return "an unknown CPU"
    info = {k.strip(): v.strip() for k, v in info.items()}
    vector = "AVX-512" if "avx512f" in info.get("flags", "").split() else "AVX2" if "avx2" in info.get("flags", "") else "no AVX2"
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, {vector})"


def ensure_demo_data() -> None:
    """The demo corpus and tokenizer are prepared by `zeroband data`; say so instead of failing deep inside."""
    if not (REPO / "data/demo/train.jsonl").is_file() or not (REPO / "data/demo/tokenizer").is_dir():
        raise SystemExit(f"demo corpus missing: run `cd {REPO} && {sys.executable} -m zeroband data` first")


# ---------------------------------------------------------------------------------- forked ranks


def prewarm() -> None:
    """Pay the trainer's lazy imports once in the parent, so forked ranks do not each pay them."""
    import datasets  # noqa: F401  (zeroband.data.loader imports it on first use)
    import torch

    import zeroband.train  # noqa: F401

    with torch.device("meta"):  # the first meta-device init pulls in torch's decompositions
        torch.empty(2).normal_()


def _child(fn: Callable[..., Any], env: dict[str, str], results: Any, key: tuple[int, int], args: tuple) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        results.put((key, "ok", pickle.dumps(fn(*args))))
    except BaseException as e:  # the parent must hear about every failure, SystemExit included
        results.put((key, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _rank_env(site: int, sites: int, rank: int, ranks: int, master_port: int, store: str) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
        "ZEROBAND_SITE_RANK": str(site), "ZEROBAND_SITE_COUNT": str(sites), "ZEROBAND_BENCH_STORE": store,
    }


def run_forked(
    fn: Callable[..., Any], sites: int, ranks: int, args: tuple = (), env: dict[str, str] | None = None,
    timeout: float = 600,
) -> dict[tuple[int, int], Any]:
    """fn(*args) on sites x ranks forked processes (torchrun's environment per rank); {(site, rank): result}.

    Each process finds the DiLoCo coordination store address in ZEROBAND_BENCH_STORE. Raises if any
    rank raised, died or is still running after `timeout` seconds.
    """
    from zeroband.tools.launch import free_port

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    store = f"tcp://127.0.0.1:{free_port()}"
    procs: dict[tuple[int, int], Any] = {}
    for site in range(sites):
        master_port = free_port()
        for rank in range(ranks):
            child_env = {**_rank_env(site, sites, rank, ranks, master_port, store), **(env or {})}
            proc = ctx.Process(target=_child, args=(fn, child_env, results, (site, rank), args), daemon=True)
            proc.start()
            procs[(site, rank)] = proc
    return _collect(procs, results, timeout)


def _collect(procs: dict[tuple[int, int], Any], results: Any, timeout: float) -> dict[tuple[int, int], Any]:
    out: dict[tuple[int, int], Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(out) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            key, status, value = results.get(timeout=0.2)
        except queue_module.Empty:
            if not any(p.is_alive() for p in procs.values()) and results.empty():
                break
            continue
        if status == "ok":
            out[key] = pickle.loads(value)
        else:
            errors.append(f"site {key[0]} rank {key[1]}: {value}")
    for key, proc in procs.items():
        proc.join(timeout=5 if time.monotonic() < deadline else 0)
        if proc.is_alive():
            proc.kill()
            proc.join()
            errors.append(f"site {key[0]} rank {key[1]} still running after {timeout:.0f} s (killed)")
        elif key not in out and not any(e.startswith(f"site {key[0]} rank {key[1]}:") for e in errors):
            errors.append(f"site {key[0]} rank {key[1]} died with exit code {proc.exitcode}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return out


# ---------------------------------------------------------------------------------- output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# Where the results on record live: a script writes there only when its command names the place.
COMMITTED = (REPO / "benchmarks", REPO / "docs" / "results")


def add_out_argument(p: Any, committed: str, what: str) -> None:
    """The one --out every benchmark script takes (`p` an argparse parser): default None, i.e. a
    fresh temporary directory (`output_dir`), so trying a script never overwrites the results on
    record; `--out <committed>` (e.g. benchmarks) updates them."""
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help=f"where {what} go (default: a new temporary directory, printed at the end; "
                        f"--out {committed} updates the committed results)")


def out_refusal(out: Path | None, quick: bool) -> str | None:
    """Why `out` may not be written by this run, or None: a smoke run (--quick) measures nothing
    worth keeping, so it never writes into the committed results."""
    if not quick or out is None:
        return None
    where = out.resolve()
    for committed in COMMITTED:
        if where == committed or committed in where.parents:
            return (f"--out {out}: --quick is a smoke test and never writes to {committed.relative_to(REPO)}/ "
                    "(the results on record); drop --quick, or give --out a directory elsewhere")
    return None


def output_dir(out: Path | None, name: str, quick: bool = False) -> Path:
    """The directory a run writes to: `out`, or a new temporary one. Exits with one line if a
    smoke run names the committed results. Call it before measuring, so a refusal costs nothing."""
    refusal = out_refusal(out, quick)
    if refusal is not None:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {refusal}")
    return out if out is not None else Path(tempfile.mkdtemp(prefix=f"zeroband-{name}-"))


def say_written(*paths: Path) -> None:
    """The last line of every benchmark: where its files are (a temporary directory is not obvious)."""
    print(f"wrote {', '.join(str(p) for p in paths)}", flush=True)


def write_outputs(out_dir: Path, name: str, data: dict[str, Any], markdown: str) -> None:
    """out_dir/name.json and out_dir/name.md; prints the markdown, then where the files are."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    (out_dir / f"{name}.md").write_text(markdown + "\n")
    print(markdown, flush=True)
    say_written(out_dir / f"{name}.json", out_dir / f"{name}.md")


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/bench_*.py --help\n(scripts/bench_common.py is the helpers the benchmark scripts share (memory probes, forked ranks, tables, output files); it does nothing on its own)")
