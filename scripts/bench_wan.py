"""Per-step data parallel vs DiLoCo (blocking fp32/fp16/int8/int4, overlapped fp16) over an emulated WAN.

    flock /tmp/zeroband-bench.lock python scripts/bench_wan.py --out benchmarks  # full run, ~19 min
    python scripts/bench_wan.py --quick --out /tmp/wan                      # CI smoke test, < 60 s
    flock /tmp/zeroband-bench.lock python scripts/bench_wan.py --ceiling --out benchmarks  # emulator ceiling, ~1 min
    flock /tmp/zeroband-test.lock python scripts/bench_wan.py --streams --out benchmarks  # streams, idle, TCP, ~10 min

Every row is a real multi-site run: S torchrun jobs (`zeroband.tools.launch.launch_sites`), each site in
its own network namespace behind a fresh emulated link (`WanLink`: per-site uplink rate, one-way
delay, jitter, loss). Needs root. Definitions (also written into the markdown):

- round k = inner steps (k-1)H+1 .. kH, from the train record of step (k-1)H to that of step kH
  (W_k seconds); its outer record gives O_k = outer_step_s (main-thread seconds of the outer step:
  communication wait + pseudo-gradient/optimizer CPU work; for data parallel the H per-step
  gradient syncs) and A_k = allreduce_s (seconds the main thread waited for the network).
  Steady rounds: k >= 2 (round 1 carries the first-step warm-up), and for overlapped rows not the
  last round (the run's end is a blocking sync point, a once-per-run cost).
- utilisation (wall) = the trainer's own compute_utilisation at the last train record: inner
  compute seconds / wall seconds since the trainer started (startup broadcast included).
- utilisation (steady) = sum_k (W_k - O_k) / sum_k W_k over steady rounds: inner compute (incl. data
  loading and logging) over compute + communication.
- wire bytes per rank per outer step: tx bytes of each site's `wan0` (read every 20 ms from inside
  the namespace) between the round's boundaries, minus the idle chatter rate x W_k (chatter rate
  measured in blocking rows between the end of one outer step and the start of the next), / W.
- bytes per parameter = wire bytes per rank per sync / (shard parameters x 2(S-1)/S); shard
  parameters = payload_bytes / (bytes per value of the dtype), as the trainer logs it.
- achieved bandwidth = wire bytes per site / A_k / link rate; "on the wire" = the same bytes over
  the time the interface counter was actually rising during the outer step (latency excluded).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    REPO,
    add_out_argument,
    ensure_demo_data,
    load_average,
    load_note,
    markdown_table,
    output_dir,
    say_written,
    write_outputs,
)

from zeroband.comm import codecs
from zeroband.comm.link import Link, kernel_window, streams_for, throughput
from zeroband.tools.launch import WanLink, launch_sites
from zeroband.tools.plan import DTYPE_BYTES, largest_fragment, wan_prediction

CONFIG = str(REPO / "configs/demo_diloco.toml")
# Inside a namespace without DNS, c10d warns that it cannot resolve a hostname; launch's store process
# reads its first output line expecting "listening", so the warning would stop (or hang) the launch.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
CLONE_NEWNET = 0x40000000
SAMPLE_S = 0.02
VALUE_BYTES = DTYPE_BYTES  # payload_bytes per value, as each codec counts them (zeroband/comm/codecs/)
TARGETS = {"fp16": 2.0, "int8": 1.05, "int4": 0.55}


@dataclass(frozen=True)
class Row:
    name: str
    mode: str  # diloco | data_parallel
    dtype: str
    overlap: bool = False
    fragments: int = 1  # diloco.fragments (Streaming DiLoCo)

    @property
    def is_dp(self) -> bool:
        return self.mode == "data_parallel"


ROWS = [
    Row("DP fp32 (per step)", "data_parallel", "fp32"),
    Row("DiLoCo fp32", "diloco", "fp32"),
    Row("DiLoCo fp16", "diloco", "fp16"),
    Row("DiLoCo int8", "diloco", "int8"),
    Row("DiLoCo int4", "diloco", "int4"),
    Row("DiLoCo fp16 overlapped", "diloco", "fp16", True),
]
SWEEP_ROWS = ("DP fp32 (per step)", "DiLoCo fp16", "DiLoCo fp16 overlapped")
# --fragments: fragments x wire format, blocking, at H = FRAGMENTS_H (a multiple of every P)
FRAGMENT_ROWS = [Row(f"{dtype} P={p}", "diloco", dtype, False, p) for dtype in ("fp16", "int4", "sparse") for p in (1, 4, 16)]
FRAGMENT_ROWS += [Row(f"fp16 P={p} overlapped", "diloco", "fp16", True, p) for p in (1, 4, 16)]  # each lands H later
FRAGMENTS_H = 320  # at P = 16 one sync every 20 steps (~1.2 s here): each 1 s window sees at most one
# A model whose whole tensors the split can balance at P = 16 (largest fragment within 6% of 1 / 16):
# the demo preset with 8 layers and a 512-token vocabulary (its own tokenizer, trained on the demo
# corpus). The demo preset's 4096 x 128 tables are 29% of it each and bound its peak (rows kept).
FRAGMENTS_MODEL = {"n_layers": 8, "vocab_size": 512}
QUICK_ROWS = ("DP fp32 (per step)", "DiLoCo fp16")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default=None, help="model preset (default demo; debug with --quick)")
    p.add_argument("--sites", type=int, default=2, help="S")
    p.add_argument("--nproc", type=int, default=1, help="W: FSDP ranks per site")
    p.add_argument("--rate-mbit", type=float, default=None, help="per-site uplink (default 20; 200 with --quick)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way delay (default 50; 5 with --quick)")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss-pct", type=float, default=0.0)
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--inner-steps", type=int, default=None, help="H for DiLoCo rows (default 500, the configs' default; 4 with --quick)")
    p.add_argument("--outer-steps", type=int, default=None, help="rounds per row (default 3; overlapped +1)")
    p.add_argument("--sweep-outer-steps", type=int, default=2, help="rounds per sweep row (overlapped +1)")
    p.add_argument("--dp-steps", type=int, default=4, help="data-parallel steps per reported round")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step per site")
    p.add_argument("--sweep-rates", default=None, help="Mbit/s list for the sweep rows (default 10,100; --ceiling shows what the TUN forwarder carries)")
    p.add_argument("--rows", default=None, help="comma-separated row names to run (default all)")
    p.add_argument("--quick", action="store_true", help="debug model, tiny steps, 2 rows (CI smoke test)")
    p.add_argument("--no-pin-cpus", dest="pin_cpus", action="store_false",
                   help="let the sites share all CPUs (default: each site its own, when there are enough)")
    add_out_argument(p, "benchmarks", "wan.{json,md,png}")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--raw", type=Path, default=None, help="also dump every run's records and counter samples here")
    p.add_argument("--from-raw", type=Path, default=None, help="re-analyse a --raw dump instead of running")
    p.add_argument("--ceiling", action="store_true",
                   help="only measure what the emulator carries (link probes, no training); other rows kept")
    p.add_argument("--ceiling-seconds", type=float, default=3.0, help="timed transfer per --ceiling probe")
    p.add_argument("--fragments", dest="fragments_check", action="store_true",
                   help=f"fragments x wire format rows (P = 1, 4, 16 x fp16, int4, sparse; H = {FRAGMENTS_H}), "
                        "kept beside the rows: bytes per parameter, peak per-second uplink, utilisation")
    p.add_argument("--streams", dest="streams_check", action="store_true",
                   help="the outer all-reduce alone (scripts/wan/link_allreduce.py, STREAMS_RUNS): sites.streams auto and 1 at "
                        "500 Mbit/s / 200 ms (a 300 MB fp16 step) and 20 Mbit/s / 100 ms (the demo model's), idle "
                        "between rounds with slow start after idle on and off, a small payload; kept beside the rows")
    args, extra = p.parse_known_args(argv)
    return _defaults(args), extra


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    q = args.quick
    args.out = output_dir(args.out, "wan", q)
    args.preset = args.preset or ("debug" if q else "demo")
    args.rate_mbit = args.rate_mbit or (200.0 if q else 20.0)
    args.delay_ms = args.delay_ms if args.delay_ms is not None else (5.0 if q else 50.0)
    args.inner_steps = args.inner_steps or (4 if q else 500)
    args.outer_steps = args.outer_steps or 3
    args.dp_steps = 2 if q else args.dp_steps
    args.seq_len = args.seq_len or 64
    sweep = "" if q else (args.sweep_rates if args.sweep_rates is not None else "10,100")
    args.sweep_rates = [float(r) for r in sweep.split(",") if r]
    args.pin_cpus = args.pin_cpus and len(os.sched_getaffinity(0)) >= args.sites * args.nproc
    names = QUICK_ROWS if q else tuple(r.name for r in ROWS)
    args.rows = [r for r in ROWS if r.name in (args.rows.split(",") if args.rows else names)]
    return args


# ---------------------------------------------------------------------------------- interface counters


class IfaceSampler:
    """tx/rx bytes of each site's wan0, sampled from threads that joined the sites' namespaces."""

    def __init__(self, ifname: str = "wan0") -> None:
        self.ifname = ifname
        self.samples: dict[int, list[tuple[float, int, int]]] = {}
        self.threads: list[threading.Thread] = []

    def start(self, procs: list[Any]) -> None:
        for site, proc in enumerate(procs):
            ns = proc.args[3]  # launch wraps every site command as `ip netns exec <ns> ...`
            self.samples[site] = []
            t = threading.Thread(target=self._run, args=(ns, procs, self.samples[site]), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(5)

    def _run(self, ns: str, procs: list[Any], out: list[tuple[float, int, int]]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/run/netns/{ns}") as f:
            if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {ns}")
        while any(p.poll() is None for p in procs):
            self._sample(out)
            time.sleep(SAMPLE_S)
        self._sample(out)

    def _sample(self, out: list[tuple[float, int, int]]) -> None:
        try:
            lines = Path("/proc/thread-self/net/dev").read_text().splitlines()
        except OSError:
            return
        for line in lines:
            name, _, rest = line.partition(":")
            if name.strip() == self.ifname:
                f = rest.split()
                out.append((time.time(), int(f[8]), int(f[0])))


def counter_at(samples: list[tuple[float, int, int]], t: float) -> float:
    """tx bytes at wall time t, linearly interpolated between samples (in time order: a binary search,
    as peak_tx asks once per sample)."""
    i = bisect_left(samples, t, key=lambda s: s[0])  # the first sample at or after t
    if i == len(samples):
        return float(samples[-1][1])
    prev, s = samples[max(i - 1, 0)], samples[i]
    span = s[0] - prev[0]
    return prev[1] + (s[1] - prev[1]) * ((t - prev[0]) / span if span > 0 else 1.0)


def rising_window(samples: list[tuple[float, int, int]], t0: float, t1: float, min_step: int = 4096) -> tuple[float, float]:
    """(bytes, seconds) while the tx counter was rising by > min_step per sample inside [t0, t1]."""
    inside = [i for i, s in enumerate(samples) if t0 <= s[0] <= t1 and i > 0]
    rising = [i for i in inside if samples[i][1] - samples[i - 1][1] > min_step]
    if not rising:
        return 0.0, 0.0
    a, b = samples[rising[0] - 1], samples[rising[-1]]
    return float(b[1] - a[1]), b[0] - a[0]


# ---------------------------------------------------------------------------------- one run


def train_overrides(args: argparse.Namespace, row: Row, rounds: int, name: str, out_dir: Path, extra: list[str]) -> list[str]:
    from zeroband.config import MODEL_PRESETS
    from zeroband.data.tokenizer import TextTokenizer

    tokenizer = getattr(args, "tokenizer", None) or REPO / "data/demo/tokenizer"
    shape = {"vocab_size": max(MODEL_PRESETS[args.preset]["vocab_size"], TextTokenizer.load(tokenizer).vocab_size),
             **getattr(args, "model", {})}  # given shapes (the fragments model's vocabulary) win
    model = [x for k, v in shape.items() for x in (f"--model.{k}", str(v))]
    h = args.dp_steps if row.is_dp else args.inner_steps
    steps = h * (rounds + (1 if drops_last(row) else 0))
    return [
        "--name", name, "--output_dir", str(out_dir), "--model.preset", args.preset,
        *model, "--data.path", str(REPO / "data/demo/train.jsonl"), "--data.tokenizer", str(tokenizer),
        "--data.seq_len", str(args.seq_len), "--train.global_batch", str(args.batch),
        "--train.micro_batch", str(max(1, args.batch // args.nproc)),
        "--train.steps", str(steps), "--optim.warmup_steps", str(max(1, min(20, steps // 10))),
        "--diloco.inner_steps", str(h), "--diloco.mode", row.mode, "--diloco.comm_dtype", row.dtype,
        "--diloco.overlap", str(row.overlap).lower(), "--diloco.fragments", str(row.fragments),
        "--sites.timeout_s", "600", "--sites.insecure", "true",
        "--log.interval", "1", "--log.progress_bar", "false", "--eval.interval", "0", "--eval.batches", "2",
        "--checkpoint.interval", "0", "--checkpoint.save_at_end", "false", "--checkpoint.resume", "none", *extra,
    ]


def run_row(args: argparse.Namespace, row: Row, rate: float, rounds: int, work: Path, extra: list[str]) -> dict[str, Any]:
    name = f"{row.mode}-{row.dtype}{'-overlap' if row.overlap else ''}-p{row.fragments}-{rate:g}mbit"
    wan = WanLink(rate, args.delay_ms, args.jitter_ms, args.loss_pct, args.mtu)
    sampler = IfaceSampler()
    t0 = time.perf_counter()
    codes = launch_sites(CONFIG, args.sites, args.nproc, train_overrides(args, row, rounds, name, work, extra),
                         work / name / "logs", args.timeout, wan, sampler.start, pin_cpus=args.pin_cpus)
    sampler.join()
    if any(codes):
        log = (work / name / "logs" / f"site{codes.index(next(c for c in codes if c))}.log").read_text()
        raise RuntimeError(f"{name}: exit codes {codes}\n{log[-3000:]}")
    records = {s: read_records(work / name / f"site{s}" / "metrics.jsonl") for s in range(args.sites)}
    print(f"[bench_wan] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"row": row.name, "mode": row.mode, "dtype": row.dtype, "overlap": row.overlap, "fragments": row.fragments,
            "rate_mbit": rate, "records": records, "samples": sampler.samples}


def drops_last(row: Row) -> bool:
    """Rows whose last round is not a steady one: overlapped (its final sync is blocking) and fragments
    (the end syncs every fragment at once): they run one round more, left out of the analysis."""
    return row.overlap or row.fragments > 1


def read_records(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------- analysis


def site_rounds(records: list[dict[str, Any]], h: int, overlap: bool) -> list[dict[str, Any]]:
    """Steady rounds of one site: wall W, outer O, comm A, boundaries (t0, t1). O, A and the payload
    add up every outer record of the round (fragments: one per fragment sync)."""
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    outer = [r for r in records if r["kind"] == "outer"]
    last = max(train)
    ks = range(2, last // h + (0 if overlap else 1))
    rounds = []
    for k in ks:
        t0, t1 = train[(k - 1) * h]["time"], train[k * h]["time"]
        mine = [o for o in outer if (k - 1) * h < o["step"] <= k * h]
        if not any(o["step"] == k * h for o in mine):
            continue
        rounds.append({"t0": t0, "t1": t1, "W": t1 - t0, "O": sum(o["outer_step_s"] for o in mine),
                       "A": sum(o["allreduce_s"] for o in mine), "payload": sum(o["payload_bytes"] for o in mine)})
    return rounds


def sync_wire(samples: list[tuple[float, int, int]], records: list[dict[str, Any]], rnd: dict[str, Any],
              chatter: float) -> float:
    """tx bytes inside the round's outer steps only (each from its start to 0.1 s after its record, the
    last ACKs), less idle chatter over those windows: a payload far smaller than the chatter of a whole
    round (sparse) still shows."""
    total = 0.0
    for o in records:
        if o["kind"] == "outer" and rnd["t0"] < o["time"] <= rnd["t1"]:  # (logged before step kH's train record)
            a, b = o["time"] - o["outer_step_s"] - 0.05, o["time"] + 0.1
            total += counter_at(samples, b) - counter_at(samples, a) - chatter * (b - a)
    return total


def peak_tx(samples: list[tuple[float, int, int]], rounds: list[dict[str, Any]], window_s: float = 1.0) -> float:
    """The most tx bytes/s in any `window_s` window inside the steady rounds (counter interpolated)."""
    if not rounds:
        return 0.0
    t_first, t_last = rounds[0]["t0"], rounds[-1]["t1"] - window_s
    starts = [t for t, _, _ in samples if t_first <= t <= t_last]
    return max((counter_at(samples, t + window_s) - counter_at(samples, t) for t in starts), default=0.0) / window_s


def quiet_rate(samples: list[tuple[float, int, int]], rounds: list[dict[str, Any]]) -> float | None:
    """Idle chatter (tx bytes/s) between the end of one blocking outer step and the start of the next."""
    total_b = total_s = 0.0
    for r in rounds:
        a, b = r["t0"] + 0.3, r["t1"] - r["O"] - 0.3
        if b - a > 1.0:
            total_b += counter_at(samples, b) - counter_at(samples, a)
            total_s += b - a
    return total_b / total_s if total_s else None


def analyse(args: argparse.Namespace, run: dict[str, Any], chatter: float) -> dict[str, Any]:
    row = Row(run["row"], run["mode"], run["dtype"], run["overlap"], run.get("fragments", 1))
    h = args.dp_steps if row.is_dp else args.inner_steps
    per_site = [site_rounds(run["records"][s], h, drops_last(row)) for s in range(args.sites)]
    rounds = [r for site in per_site for r in site]
    wire_site, transfer_bw = site_wire(run, per_site, chatter)
    wall_w, comp_w = sum(r["W"] for r in rounds), sum(r["W"] - r["O"] for r in rounds)
    last = last_arrivals(per_site)
    allreduce_s = statistics.fmean(r["A"] for r in rounds)
    numel = shard_numel(rounds[0]["payload"], row, h)
    wire_rank = wire_site / args.nproc
    per_sync = wire_rank / h if row.is_dp else wire_rank
    rate_bytes = run["rate_mbit"] * 1e6 / 8
    train0 = [r for r in run["records"][0] if r["kind"] == "train"]
    val0 = [r for r in run["records"][0] if r["kind"] == "val"]
    tokens_step = args.batch * args.seq_len
    return {
        "row": row.name, "mode": row.mode, "dtype": row.dtype, "overlap": row.overlap, "rate_mbit": run["rate_mbit"],
        "inner_steps": h, "steps": train0[-1]["step"], "steady_rounds_per_site": len(per_site[0]),
        "utilisation_wall": statistics.fmean(last_train(run, s)["compute_utilisation"] for s in range(args.sites)),
        "utilisation_steady": comp_w / wall_w,
        "utilisation_steady_last_arrival": sum(r["W"] - r["O"] for r in last) / sum(r["W"] for r in last),
        "allreduce_s_last_arrival": statistics.fmean(r["A"] for r in last),
        "compute_s_per_step": comp_w / len(rounds) / h,
        "allreduce_s_mean": allreduce_s, "outer_step_s_mean": statistics.fmean(r["O"] for r in rounds),
        "allreduce_s_per_step": allreduce_s / h if row.is_dp else None,
        "wire_bytes_per_site_per_round": wire_site, "wire_bytes_per_rank_per_outer_step": wire_rank,
        "shard_params": numel, "bytes_per_param_per_sync": per_sync / (numel * codecs.spec(row.dtype).wire_factor(args.sites)),
        "achieved_bw_over_rate": None if row.overlap else wire_site / statistics.fmean(r["A"] for r in last) / rate_bytes,
        "wire_throughput_over_rate": transfer_bw / rate_bytes if transfer_bw else None,
        "tokens_per_s_all_sites": args.sites * tokens_step * h * len(rounds) / wall_w,
        "final_train_loss": train0[-1]["loss"], "final_val_loss": val0[-1]["val_loss"] if val0 else None,
        "fragments": row.fragments, "peak_tx_mbit_1s": max(peak_tx(run["samples"][s], per_site[s]) for s in
                                                            range(args.sites)) * 8 / 1e6,
        "sync_wire_bytes_per_site_per_round": statistics.fmean(
            sync_wire(run["samples"][s], run["records"][s], r, chatter) for s in range(args.sites) for r in per_site[s]),
    }


def last_arrivals(per_site: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per round, the site that reached the outer step last: it waited only for the network, not for a
    slower site's compute (sites share this machine's cores with each other and other jobs)."""
    return [min(group, key=lambda r: r["A"]) for group in zip(*per_site)]


def last_train(run: dict[str, Any], site: int) -> dict[str, Any]:
    return [r for r in run["records"][site] if r["kind"] == "train"][-1]


def shard_numel(payload: int, row: Row, h: int) -> float:
    if row.is_dp:
        return payload / h / 4.0
    return payload / VALUE_BYTES[row.dtype]


def site_wire(run: dict[str, Any], per_site: list[list[dict[str, Any]]], chatter: float) -> tuple[float, float]:
    """(mean tx bytes per site per steady round minus chatter, mean bytes/s while the counter rose)."""
    wire, speeds = [], []
    for site, rounds in enumerate(per_site):
        samples = run["samples"][site]
        for r in rounds:
            wire.append(counter_at(samples, r["t1"]) - counter_at(samples, r["t0"]) - chatter * r["W"])
            if not run["overlap"] and run["mode"] == "diloco" and run.get("fragments", 1) == 1:
                b, s = rising_window(samples, r["t1"] - r["O"] - 0.05, r["t1"] + 0.05)
                if s > 0:
                    speeds.append(b / s)
    return statistics.fmean(wire), (statistics.fmean(speeds) if speeds else 0.0)


def chatter_rate(args: argparse.Namespace, runs: list[dict[str, Any]]) -> float:
    rates = []
    for run in runs:
        if run["mode"] == "diloco" and not run["overlap"] and run.get("fragments", 1) == 1:
            for s in range(args.sites):
                q = quiet_rate(run["samples"][s], site_rounds(run["records"][s], args.inner_steps, False))
                if q is not None:
                    rates.append(q)
    return statistics.median(rates) if rates else 0.0


def predicted(meta: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """zeroband.tools.plan's prediction for this row (its link model with the run's streams and
    window), from the measured compute per step."""
    pred = wan_prediction(meta, m)
    comm, util = pred["comm_s"], pred["utilisation"]
    measured_comm, measured_util = m["allreduce_s_last_arrival"], m["utilisation_steady_last_arrival"]
    return {"comm_s": comm, "utilisation": util, "transfer_s": None if m["overlap"] else comm,
            "comm_err": (comm - measured_comm) / measured_comm if measured_comm > 0.05 else None,
            "utilisation_err": (util - measured_util) / measured_util}


# ---------------------------------------------------------------------------------- report


def measured_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for m in results:
        bw = m["achieved_bw_over_rate"]
        wire_bw = m["wire_throughput_over_rate"]
        rows.append([m["row"], f"{m['rate_mbit']:g}", m["inner_steps"], m["steps"], f"{100 * m['utilisation_wall']:.1f}%",
                     f"{100 * m['utilisation_steady']:.1f}%", f"{100 * m['utilisation_steady_last_arrival']:.1f}%",
                     f"{m['allreduce_s_mean']:.3f}", f"{m['allreduce_s_last_arrival']:.3f}",
                     f"{m['wire_bytes_per_rank_per_outer_step'] / 1e6:.3f}", f"{m['bytes_per_param_per_sync']:.3f}",
                     f"{100 * bw:.0f}%" if bw else "-", f"{100 * wire_bw:.0f}%" if wire_bw else "-",
                     f"{m['tokens_per_s_all_sites']:,.0f}", f"{m['final_train_loss']:.3f}",
                     f"{m['final_val_loss']:.3f}" if m["final_val_loss"] is not None else "-"])
    return rows


MEASURED_HEADERS = ["row", "Mbit/s", "H", "steps", "util (wall)", "util (steady)", "util (steady, last arrival)",
                    "comm s / outer step", "comm s (last arrival)",
                    "wire MB / rank / outer step", "B/param/sync", "all-reduce BW / rate", "on-wire BW / rate",
                    "tokens/s (all sites)", "train loss", "val loss"]


def predicted_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    return [[m["row"], f"{m['rate_mbit']:g}", f"{m['allreduce_s_last_arrival']:.3f}", f"{m['predicted']['comm_s']:.3f}",
             _err(m["predicted"]["comm_err"]), f"{100 * m['utilisation_steady_last_arrival']:.1f}%",
             f"{100 * m['predicted']['utilisation']:.1f}%", f"{100 * m['predicted']['utilisation_err']:+.1f}%"]
            for m in results]


PREDICTED_HEADERS = ["row", "Mbit/s", "comm s measured (last arrival)", "comm s predicted", "error",
                     "util measured (steady, last arrival)",
                     "util predicted", "error"]


def targets(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[list[Any]]:
    main = {m["row"]: m for m in results if m["rate_mbit"] == args.rate_mbit}
    out = []
    for rate in sorted({m["rate_mbit"] for m in results}):
        at = {m["row"]: m for m in results if m["rate_mbit"] == rate}
        dp, fp16, ovl = (at.get(n) for n in ("DP fp32 (per step)", "DiLoCo fp16", "DiLoCo fp16 overlapped"))
        if dp and fp16 and dp["utilisation_steady"] < 0.10:
            out.append([f"blocking fp16 >= 95% where DP < 10% ({rate:g} Mbit/s)", f"DP {_pct(dp)}, fp16 {_pct(fp16)}",
                        _ok_steady(fp16, 0.95)])
        if ovl:
            out.append([f"overlapped >= 99% ({rate:g} Mbit/s)", _pct(ovl), _ok_steady(ovl, 0.99)])
    for m in main.values():
        if m["mode"] == "diloco" and not m["overlap"] and m["achieved_bw_over_rate"]:
            out.append([f"all-reduce BW >= 90% of rate at {2 * args.delay_ms:g} ms RTT ({m['row']})",
                        f"{100 * m['achieved_bw_over_rate']:.0f}% (on-wire {100 * (m['wire_throughput_over_rate'] or 0):.0f}%)",
                        _ok(m["achieved_bw_over_rate"] >= 0.9)])
    for m in main.values():
        if m["dtype"] in TARGETS and m["mode"] == "diloco" and not m["overlap"]:
            goal = TARGETS[m["dtype"]]
            ok = abs(m["bytes_per_param_per_sync"] - goal) <= 0.02 * goal if m["dtype"] == "fp16" else m["bytes_per_param_per_sync"] <= goal
            out.append([f"{m['dtype']} wire bytes/param {'~' if m['dtype'] == 'fp16' else '<='} {goal}",
                        f"{m['bytes_per_param_per_sync']:.3f}", _ok(ok)])
    return out


def _err(value: float | None) -> str:
    return "n/a (both ~0)" if value is None else f"{100 * value:+.0f}%"


def _pct(m: dict[str, Any]) -> str:
    return f"{100 * m['utilisation_steady']:.1f}% (last arrival {100 * m['utilisation_steady_last_arrival']:.1f}%)"


def _ok_steady(m: dict[str, Any], goal: float) -> str:
    """Met on both sites' steady rounds; or met on the network's cost alone (the last-arriving site,
    which waits for nobody's compute) when the sites ran at different speeds."""
    if m["utilisation_steady"] >= goal:
        return "met"
    if m["utilisation_steady_last_arrival"] >= goal:
        return "met for the network's cost (last arrival); both sites incl. waiting for the slower site's compute: NOT met"
    return "NOT met"


def _ok(flag: bool) -> str:
    return "met" if flag else "NOT met"


def render(data: dict[str, Any]) -> str:
    meta, results = data["meta"], data["results"]
    return "\n\n".join([
        f"## WAN benchmark: {meta['preset']} preset ({meta['params']:,} params), {meta['sites']} sites x {meta['nproc']} "
        f"ranks, link {meta['rate_mbit']:g} Mbit/s per site uplink, {meta['delay_ms']:g} ms one-way "
        f"({2 * meta['delay_ms']:g} ms RTT), jitter {meta['jitter_ms']:g} ms, loss {meta['loss_pct']:g}%, MTU {meta['mtu']}, "
        f"backend {meta['backend']}",
        f"Host settings the rows need beside them: TCP in the sites' namespaces {tcp_words(meta.get('tcp'))}. "
        "Sites on other settings (Linux's defaults: cubic, tcp_slow_start_after_idle = 1) are measured in the idle "
        "rows of the streams table below.",
        f"DiLoCo H={meta['inner_steps']} x {meta['outer_steps']} rounds (+1 for overlapped); data parallel syncs "
        f"every step, reported every {meta['dp_steps']} steps (its H column); {meta['tokens_per_step']} tokens per "
        f"step per site. Sweep rates: {meta['sweep_rates'] or 'none'}. "
        + ("Each site pinned to its own CPU core(s), as on separate machines (`--no-pin-cpus` to share)."
           if meta.get("pin_cpus") else "Sites share all CPUs."),
        "### Measured", markdown_table(MEASURED_HEADERS, measured_rows(results)),
        "### Predicted by zeroband.tools.plan (from each row's measured compute per step)",
        markdown_table(PREDICTED_HEADERS, predicted_rows(results)),
        "### Targets", markdown_table(["target", "measured", "status"], targets_from_meta(data)),
        NOTES.format(chatter=meta["chatter_bytes_per_s"]),
        load_note(meta["loadavg_start"], meta["loadavg_end"]),
        *([ceiling_markdown(data["ceiling"])] if data.get("ceiling") else []),
        *([streams_markdown(data["streams"])] if data.get("streams") else []),
        *([fragments_markdown(data["fragments"])] if data.get("fragments") else []),
        *([fragments_markdown(data["fragments_demo"], demo=True)] if data.get("fragments_demo") else []),
    ])


def targets_from_meta(data: dict[str, Any]) -> list[list[Any]]:
    return data["targets"]


NOTES = (
    "Definitions. Round k = inner steps (k-1)H+1..kH between the train records of steps (k-1)H and kH (wall W_k); "
    "O_k = the round's outer_step_s, A_k = allreduce_s (seconds the main thread waited for the network). Steady "
    "rounds: k >= 2, and for overlapped rows not the final blocking sync. util (wall) = the trainer's "
    "compute_utilisation at its last step (inner compute / wall since start, startup included). util (steady) = "
    "sum(W_k - O_k) / sum(W_k) over both sites. 'last arrival': per round only the site that reached the outer step "
    "last, whose A_k is pure network time; the other site's A_k also holds its wait for the slower site's compute "
    "(sites that run at different speeds, e.g. sharing cores, wait for each other). comm s / outer step = mean A_k (for DP: the H "
    "per-step syncs of a round). Wire bytes "
    "= tx bytes counted at each site's wan0 between round boundaries (sampled every 20 ms from inside the namespace, "
    "interpolated; for overlapped rows the round carries the all-reduce launched at its start), minus idle chatter {chatter:.0f} B/s x W_k (measured between outer steps of blocking rows), "
    "divided by ranks per site; they include IP/TCP headers and the ACKs this site sends for what it receives. "
    "B/param/sync = wire bytes per rank per sync / (shard parameters x 2(S-1)/S). all-reduce BW / rate = wire "
    "bytes per site / A_k (last arrival) / link rate (A_k includes the site-statistics exchange and round trips); on-wire BW = the same "
    "bytes over only the time the counter was rising. Predicted = zeroband.tools.plan with the link's rate, one-way delay "
    "and MTU, no TCP slow start after idle (the emulator disables it, as a WAN site would), and the row's measured compute s per step; for overlapped rows the "
    "communication column is the predicted wait, max(0, T_comm - H x step), compared with the measured wait."
)


def plot(results: list[dict[str, Any]], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in sorted({m["row"] for m in results}):
        pts = sorted((m["rate_mbit"], m["utilisation_steady"], m["predicted"]["utilisation"]) for m in results if m["row"] == name)
        line = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", label=f"{name} (measured)")
        ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], "x:", color=line[0].get_color(), alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per site (Mbit/s, log)")
    ax.set_ylabel("compute utilisation, steady (%)")
    ax.set_title("solid: measured, dotted x: zeroband.tools.plan prediction")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------- main


def plan_runs(args: argparse.Namespace) -> list[tuple[Row, float, int]]:
    """(row, link Mbit/s, rounds) for every run: all rows at the main link, the sweep rows at the others."""
    runs = [(row, args.rate_mbit, args.outer_steps) for row in args.rows]
    for rate in args.sweep_rates:
        if rate != args.rate_mbit:
            runs += [(row, rate, args.sweep_outer_steps) for row in args.rows if row.name in SWEEP_ROWS]
    return runs


def run_all(args: argparse.Namespace, work: Path, extra: list[str]) -> list[dict[str, Any]]:
    """Sequentially (timings must not overlap); --quick runs its rows side by side to stay under a minute."""
    jobs = [(args, row, rate, rounds, work, extra) for row, rate, rounds in plan_runs(args)]
    if not args.quick:
        return [run_row(*job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: run_row(*job), jobs))


def preflight() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench_wan needs root (network namespaces, TUN devices, tc)")


def measure(args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench_wan-") as tmp:
        runs = run_all(args, Path(tmp), extra)
    if args.raw:
        args.raw.write_text(json.dumps(runs))
    return runs


def measured_load(previous: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """A re-analysis keeps the load note of the measuring run (its wan.json), not today's load."""
    if not previous.is_file():
        return {}
    old = json.loads(previous.read_text())["meta"]
    return {k: old[k] for k in ("loadavg_start", "loadavg_end") if k in old}


def load_raw(path: Path) -> list[dict[str, Any]]:
    runs = json.loads(path.read_text())
    for run in runs:  # JSON turned the site keys into strings
        run["records"] = {int(k): v for k, v in run["records"].items()}
        run["samples"] = {int(k): v for k, v in run["samples"].items()}
    return runs


# ---------------------------------------------------------------------------------- emulator ceiling
CEILING_RTT_MS = 200.0
CEILING_RATE_MBIT = 500.0  # 12.5 MB in flight at 200 ms: 3x tcp_wmem max (issue 27's acceptance link)


def ceiling_runs() -> list[tuple[float | None, float, int]]:
    """(rate Mbit/s, None: the forwarder alone; one-way delay ms; streams) of each --ceiling probe."""
    d, chosen = CEILING_RTT_MS / 2, streams_for(CEILING_RATE_MBIT * 1e6, CEILING_RTT_MS / 1e3)
    return [(None, 1.0, 1), (None, 1.0, 4), (None, d, 1), (None, d, 4), (None, d, 16),
            (CEILING_RATE_MBIT, d, 1), (CEILING_RATE_MBIT, d, 4), (CEILING_RATE_MBIT, d, chosen)]


def measure_ceiling(args: argparse.Namespace) -> list[dict[str, Any]]:
    """zeroband.comm.link's probe through the TUN forwarder, beside the link model's prediction."""
    from zeroband.wan import WanEmulator
    from zeroband.wan.measure import measure_link

    rows = []
    for rate, delay, streams in ceiling_runs():
        with WanEmulator(2, rate_mbit=rate, delay_ms=delay, mtu=args.mtu, backend="tun") as wan:
            r = measure_link(wan, 1, 0, streams=streams, seconds=args.ceiling_seconds)
        model = throughput(Link(r["rtt_ms"] / 1e3, (rate or float("inf")) * 1e6, streams, r["window_bytes"]))
        rows.append({"rate_mbit": rate, "delay_ms": delay, "mtu": args.mtu, "model_mbit": model / 1e6, **r})
        print(f"rate {rate or 'none'} Mbit/s, RTT {r['rtt_ms']:.0f} ms, {streams} streams: "
              f"{r['steady_mbit']:.0f} Mbit/s (model {model / 1e6:.0f})", flush=True)
    return rows


def ceiling_markdown(rows: list[dict[str, Any]]) -> str:
    table = [[f"{r['rate_mbit']:g}" if r["rate_mbit"] else "none (forwarder only)", f"{r['rtt_ms']:.1f}", r["streams"],
              f"{r['window_bytes'] / 1e6:.2f}", f"{r['steady_mbit']:.0f}", f"{r['throughput_mbit']:.0f}",
              f"{r['model_mbit']:.0f}"] for r in rows]
    free = max((r for r in rows if not r["rate_mbit"]), key=lambda r: r["steady_mbit"])
    return "\n\n".join([
        "### Emulator ceiling", (
            f"What the TUN backend (user-space forwarder, MTU {rows[0]['mtu']}) carries on this machine: "
            "zeroband.comm.link's probe (5 authenticated pings, then a timed transfer on every stream) from site 1 to "
            f"site 0. Most seen: {free['steady_mbit']:.0f} Mbit/s on {free['streams']} stream(s) at "
            f"{free['rtt_ms']:.0f} ms RTT. At {CEILING_RTT_MS:g} ms each stream is window-bound (the model column: "
            "min(rate, streams x window / RTT)), so the forwarder is not what limits a 500 Mbit/s link there; "
            "enough streams are. Steady = the transfer's second half; mean includes slow start. Regenerate "
            "(keeps the rows above): `flock /tmp/zeroband-bench.lock python scripts/bench_wan.py --ceiling --out benchmarks`."),
        markdown_table(["rate Mbit/s", "RTT ms", "streams", "window MB", "steady Mbit/s", "mean Mbit/s",
                        "link model Mbit/s"], table)])


def update_section(args: argparse.Namespace, key: str, rows: Any, alone: Any) -> int:
    """--ceiling, --streams: rewrite wan.json / wan.md with `rows` under `key`, beside the rows kept
    (`alone(rows)`: the markdown when there are none)."""
    previous = args.out / "wan.json"
    data = json.loads(previous.read_text()) if previous.is_file() else {}
    data[key] = rows
    write_outputs(args.out, "wan", data, render(data) if "results" in data else alone(rows))
    return 0


# ---------------------------------------------------------------------------------- streams per peer
KEPT = ("ceiling", "streams", "fragments", "fragments_demo")  # measured apart (--ceiling, --streams): kept when the rows are re-measured


@dataclass(frozen=True)
class LinkRun:
    """One --streams run: the outer all-reduce alone on an emulated link, 3 rounds."""

    rate_mbit: float
    delay_ms: float  # one-way
    numel: int  # fp32 values of the pseudo-gradient
    streams: str  # sites.streams
    idle_s: float = 0.0  # the link idles this long before each round, as between outer steps
    slow_start_after_idle: bool = False  # the namespaces' net.ipv4.tcp_slow_start_after_idle
    congestion: str | None = None  # the namespaces' tcp_congestion_control (None: the host's)


STREAMS_RUNS = [
    LinkRun(500.0, 100.0, 150_000_000, "auto"), LinkRun(500.0, 100.0, 150_000_000, "1"),
    LinkRun(20.0, 50.0, 1_787_008, "auto"), LinkRun(20.0, 50.0, 1_787_008, "1"),
    # slow-start restarts: 5 s of inner steps between outer steps, with Linux's default and without
    LinkRun(500.0, 100.0, 150_000_000, "auto", 5.0, True), LinkRun(500.0, 100.0, 150_000_000, "auto", 5.0, False),
    # and with cubic, Linux's default (a namespace may pick it only if tcp_allowed_congestion_control lists it)
    LinkRun(500.0, 100.0, 150_000_000, "auto", 5.0, True, "cubic"),
    LinkRun(500.0, 100.0, 150_000_000, "auto", 5.0, False, "cubic"),
    # a small payload on a long link: the round trips of a step dominate
    LinkRun(500.0, 100.0, 1_787_008, "auto"),
]


def measure_streams(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each STREAMS_RUNS link: the all-reduce through scripts/wan/link_allreduce.py, with the TCP
    settings its namespaces ran with."""
    import importlib.util

    from zeroband.wan import WanEmulator

    spec = importlib.util.spec_from_file_location("link_allreduce", REPO / "scripts/wan/link_allreduce.py")
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    rows = []
    allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
    for run in STREAMS_RUNS:
        if run.congestion and run.congestion not in allowed:
            print(f"{run}: skipped, {run.congestion} is not in net.ipv4.tcp_allowed_congestion_control {allowed} "
                  "(a namespace may not pick it)", flush=True)
            continue
        load = load_average()
        with WanEmulator(2, rate_mbit=run.rate_mbit, delay_ms=run.delay_ms, mtu=args.mtu, backend="tun",
                         slow_start_after_idle=run.slow_start_after_idle, congestion=run.congestion) as wan:
            tcp = wan.tcp_settings(0)
            out = worker.run_pair(wan, ["--streams", run.streams, "--numel", str(run.numel), "--rounds", "3",
                                        "--idle-s", str(run.idle_s)], args.timeout)
        rows.append(streams_row(run, out) | {"tcp": tcp, "loadavg_start": load, "mtu": args.mtu})
        r = rows[-1]
        print(f"{run}: {r['streams_used']} streams, {r['seconds']:.2f} s, {100 * r['bw_over_rate']:.0f}% of the rate, "
              f"bound {r['wait_bound_s']:.1f} s, {tcp}, load {load:.1f}", flush=True)
    return rows


def streams_row(run: LinkRun, out: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Rounds 2.. (round 1 also ramps the windows up), per round the faster site's seconds (the one that
    waited only for the network: both enter together, a site's own CPU work delays only itself)."""
    rounds = [min(site[k]["seconds"] for site in out) for k in range(1, len(out[0]) - 1)]
    first, link = out[0][0], out[0][-1]["link"][0]
    seconds = statistics.fmean(rounds)
    return {"rate_mbit": run.rate_mbit, "rtt_ms": 2 * run.delay_ms, "numel": run.numel, "streams": run.streams,
            "idle_s": run.idle_s, "streams_used": link["streams_used"], "probe_rtt_ms": link["rtt_ms"],
            "probe_mbit": link["steady_mbit"], "payload_bytes": first["payload_bytes"], "wire_bytes": first["wire_bytes"],
            "seconds": seconds, "rounds_s": rounds, "bw_over_rate": first["wire_bytes"] * 8 / seconds / (run.rate_mbit * 1e6),
            "wait_bound_s": max(site[k]["wait_bound_s"] for site in out for k in range(len(site) - 1))}


def streams_markdown(rows: list[dict[str, Any]]) -> str:
    table = [[f"{r['rate_mbit']:g}", f"{r['rtt_ms']:g}", f"{r['payload_bytes'] / 1e6:.1f}", r["streams"], r["streams_used"],
              f"{r.get('idle_s', 0.0):g}", tcp_note(r), f"{r['probe_rtt_ms']:.0f}", f"{r['probe_mbit']:.0f}",
              f"{r['seconds']:.2f}", f"{100 * r['bw_over_rate']:.0f}%", f"{r['wait_bound_s']:.1f}",
              f"{r['loadavg_start']:.1f}" if "loadavg_start" in r else "-"] for r in rows]
    return "\n\n".join([
        "### Streams per peer: the outer all-reduce alone (issues 27, 33)", (
            "2 sites in the TUN emulator, one fp16 outer all-reduce of a pseudo-gradient through `reduce_across_sites` "
            "(statistics, review, pieces) on zeroband's transport, 3 rounds, rounds 2-3 reported. `sites.streams` auto: "
            "the group dials 16 connections per peer, probes the link on them at connect (authenticated pings, then "
            "a timed transfer) and keeps those that cover the measured bandwidth-delay product (comm/link.py "
            "choose_streams); 1: one connection, probed on. seconds = mean over rounds of the faster site's time "
            "(both enter together); BW / rate = bytes this site sent (payload, no TCP/IP headers) / seconds / link "
            "rate, so the 4 one-way delays of a step (statistics, the scatter's last byte, review, the all-gather's last "
            "byte) count against it. idle s before: the link idles this long before each round, as it does for the "
            "inner steps between outer steps (0: rounds back to back). TCP: the namespaces' "
            "net.ipv4.tcp_congestion_control and net.ipv4.tcp_slow_start_after_idle (Linux's default 1 restarts a "
            "loss-based sender from its initial window after an idle longer than its retransmission timeout; the "
            "emulator sets 0 unless a row asks for 1; the host's own settings are not changed). bound = the "
            "longest link-derived wait bound of the step (the review's, as for the whole scatter at fp32). 300 MB = "
            "the fp16 outer step of a 150M-parameter model; 3.6 MB = the demo preset's (the rows above). Regenerate "
            "(keeps the rows above): `flock /tmp/zeroband-test.lock python scripts/bench_wan.py --streams --out benchmarks`."),
        markdown_table(["rate Mbit/s", "RTT ms", "payload MB", "sites.streams", "streams used", "idle s before",
                        "TCP (congestion, slow start after idle)", "probe RTT ms", "probe Mbit/s", "seconds",
                        "BW / rate", "bound s", "load (1-min avg)"], table)])


def tcp_words(tcp: dict[str, str] | None) -> str:
    """The TCP settings a run recorded, for the report; older runs did not record them."""
    if not tcp:
        return "not recorded (the emulator's tcp_slow_start_after_idle = 0, the host's congestion control)"
    return ", ".join(f"{k} = {v}" for k, v in tcp.items())


def tcp_note(row: dict[str, Any]) -> str:
    """The namespaces' congestion control and tcp_slow_start_after_idle, as the row recorded them."""
    tcp = row.get("tcp")
    if not tcp:
        return "not recorded"
    return f"{tcp.get('net.ipv4.tcp_congestion_control', '?')}, {tcp.get('net.ipv4.tcp_slow_start_after_idle', '?')}"


def measure_fragments(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """--fragments: every FRAGMENT_ROWS row at the main link, H = FRAGMENTS_H, on FRAGMENTS_MODEL."""
    ensure_demo_data()
    h = 16 if args.quick else FRAGMENTS_H  # --quick: the debug model, two rows (a smoke test)
    rows = [r for r in FRAGMENT_ROWS if r.name in ("fp16 P=1", "sparse P=4")] if args.quick else FRAGMENT_ROWS
    vocab = FRAGMENTS_MODEL["vocab_size"]
    model = {"vocab_size": vocab} if args.quick else dict(FRAGMENTS_MODEL)
    args = argparse.Namespace(**{**vars(args), "inner_steps": h, "model": model, "tokenizer": demo_tokenizer(vocab)})
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="bench_wan-") as tmp:
        runs = [run_row(args, row, args.rate_mbit, args.outer_steps, Path(tmp), extra) for row in rows]
    chatter = chatter_rate(args, runs)
    params = next(r for r in runs[0]["records"][0] if r["kind"] == "run")["params"]
    assert params == model_params(args.preset, model), f"the runs trained {params:,} parameters, not {model}'s"
    return {"meta": {"rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms, "inner_steps": h,
                     "outer_steps": args.outer_steps, "sites": args.sites, "tcp": site_tcp(), "nproc": args.nproc,
                     "mtu": args.mtu, "streams": streams_for(args.rate_mbit * 1e6, 2 * args.delay_ms / 1e3),
                     "window_bytes": kernel_window(), "preset": args.preset, "model": model,
                     "largest_fragment": largest_fragments(args.preset, model),
                     "params": params, "loadavg_start": load_start, "loadavg_end": load_average(), "chatter_bytes_per_s": chatter},
            "results": [analyse(args, run, chatter) for run in runs]}


def demo_tokenizer(vocab: int) -> Path:
    """A tokenizer of `vocab` tokens trained on the demo corpus, cached beside the demo's own."""
    from zeroband.data.tokenizer import TextTokenizer, train_tokenizer

    out = REPO / f"data/demo/tokenizer-{vocab}"
    if not out.is_dir():
        train_tokenizer([REPO / "data/demo/train.jsonl"], vocab, out)
    assert TextTokenizer.load(out).vocab_size <= vocab, f"{out}: more than {vocab} tokens"
    return out


def model_config(preset: str, model: dict[str, Any]) -> Any:
    """The ModelConfig the runs train: `preset` with the shapes `model` gives."""
    from zeroband.config import ModelConfig

    return ModelConfig(preset=preset, **model)


def model_params(preset: str, model: dict[str, Any]) -> int:
    from zeroband.models.llama import num_params

    return num_params(model_config(preset, model))


def largest_fragments(preset: str, model: dict[str, Any]) -> dict[str, float]:
    """Each P's largest fragment, as a share of the parameters (the run's own split, whole tensors)."""
    cfg = model_config(preset, model)
    return {str(p): largest_fragment(cfg, p) for p in sorted({r.fragments for r in FRAGMENT_ROWS})}


def mbit(x: float) -> str:
    """A peak in Mbit/s: one decimal, two significant digits below 1 (sparse rows)."""
    return f"{x:.2g}" if x < 1 else f"{x:.1f}"


def falls(whole: float | None, peak: float) -> str:
    """How many times the P = 1 row's peak (`whole`) this row's peak is; "-" where either is missing."""
    return f"{whole / peak:.1f}x" if whole and peak > 0 else "-"


def fragments_markdown(data: dict[str, Any], demo: bool = False) -> str:
    """The fragments section; `demo`: the earlier rows on the demo preset, whose tables bound the split."""
    meta = data["meta"]
    model = meta.get("model", {})
    shares = meta.get("largest_fragment") or largest_fragments(meta.get("preset", "demo"), model)

    def wire(m: dict[str, Any]) -> float:  # overlapped: sent during compute, so the round's tx less chatter
        return m["wire_bytes_per_site_per_round"] if m["overlap"] else m["sync_wire_bytes_per_site_per_round"]

    one = {(m["dtype"], m["overlap"]): m["peak_tx_mbit_1s"] for m in data["results"] if m["fragments"] == 1}
    rows = [[m["row"], m["fragments"], m["dtype"], f"{100 * shares[str(m['fragments'])]:.1f}%", f"{wire(m) / 1e6:.4f}",
             f"{wire(m) / m['shard_params']:.4f}", mbit(m["peak_tx_mbit_1s"]), falls(one.get((m["dtype"], m["overlap"])), m["peak_tx_mbit_1s"]),
             f"{100 * m['utilisation_steady']:.1f}%", f"{100 * m['utilisation_steady_last_arrival']:.1f}%",
             f"{100 * wan_prediction(meta, m)['utilisation']:.1f}%", f"{m['allreduce_s_last_arrival']:.2f}"]
            for m in data["results"]]
    what = (f"the {meta.get('preset', 'demo')} preset" + (f" with {', '.join(f'{k} {v}' for k, v in model.items())}"
                                                          if model else ""))
    title = "### Fragments x wire format, on the demo preset (earlier rows, kept)" if demo else "### Fragments x wire format"
    why = ("Measured before the balanced model above: the demo preset's 4096 x 128 embedding and output matrices are "
           "29% of its parameters each and a fragment holds whole tensors, so the peak cannot fall below theirs. "
           if demo else "")
    return "\n\n".join([
        title, (
            why + f"`flock /tmp/zeroband-bench.lock python scripts/bench_wan.py --fragments --out benchmarks`: "
            f"{meta['sites']} sites, {what} ({meta['params']:,} parameters), {meta['rate_mbit']:g} Mbit/s per uplink, "
            f"{2 * meta['delay_ms']:g} ms RTT, H = {meta['inner_steps']}, {meta['outer_steps']} rounds of which rounds 2 to "
            f"{meta['outer_steps']} are reported (for P > 1 or overlapped one more round runs, left out: it ends in every "
            "fragment's blocking sync); "
            "blocking unless overlapped (`diloco.overlap`, the eager rule, each fragment's average landing H steps "
            "after its launch); TCP "
            f"{tcp_words(meta.get('tcp'))}. P fragments: fragment p syncs every H steps at offset (p + 1) H / P. Largest "
            "fragment = its share of the parameters as the run splits them (whole tensors, greedy by bytes; 1 / P at "
            "best). Wire "
            "MB per H = the tx bytes a site sent during the round's outer steps (each from its start to 0.1 s after "
            f"it ended, less idle chatter of {meta['chatter_bytes_per_s']:.0f} B/s over those windows; overlapped rows, "
            "whose exchanges run during compute: the whole round's tx less chatter), IP and TCP "
            "headers, MAC tags and this site's ACKs included; B/param = that / parameters (2 sites: the ring's "
            "2(S-1)/S and the all-gather's S-1 are both 1). Peak = the most tx bytes a site's uplink carried in any 1 s "
            "window of the steady rounds; peak falls = the P = 1 row's peak (same wire format) / this row's. util "
            "(steady) = inner compute / wall over the steady rounds, every "
            "fragment's sync counted; predicted: zeroband.tools.plan from the row's compute per step, each of the P "
            "syncs carrying 1/P of the bytes and its own round trips."),
        markdown_table(["row", "P", "wire", "largest fragment", "wire MB / site / H", "B/param on the wire per H",
                        "peak uplink Mbit/s (1 s)", "peak falls", "util (steady)", "util (last arrival)",
                        "util predicted by zeroband plan", "comm s / H (last arrival)"], rows),
        load_note(meta["loadavg_start"], meta["loadavg_end"])])


def keep_demo_fragments(path: Path) -> None:
    """The first fragments rows ran on the demo preset (their meta names no model): kept apart, as
    `fragments_demo`, when the balanced model's rows replace them."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    old = data.get("fragments")
    if old is not None and "model" not in old["meta"]:
        data["fragments_demo"] = data.pop("fragments")
        path.write_text(json.dumps(data, indent=1))


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    preflight()
    if args.fragments_check:
        rows = measure_fragments(args, extra)  # first: a failed measurement leaves wan.json as it was
        keep_demo_fragments(args.out / "wan.json")
        return update_section(args, "fragments", rows, fragments_markdown)
    if args.ceiling:
        return update_section(args, "ceiling", measure_ceiling(args), ceiling_markdown)
    if args.streams_check:
        return update_section(args, "streams", measure_streams(args), streams_markdown)
    ensure_demo_data()
    load_start = load_average()
    runs = load_raw(args.from_raw) if args.from_raw else measure(args, extra)
    params = next(r for r in runs[0]["records"][0] if r["kind"] == "run")["params"]
    chatter = chatter_rate(args, runs)
    results = [analyse(args, run, chatter) for run in runs]
    meta = {"preset": args.preset, "params": params, "sites": args.sites, "nproc": args.nproc, "rate_mbit": args.rate_mbit,
            "delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms, "loss_pct": args.loss_pct, "mtu": args.mtu,
            "backend": backend_name(args), "inner_steps": args.inner_steps, "outer_steps": args.outer_steps,
            "dp_steps": args.dp_steps, "tokens_per_step": args.batch * args.seq_len, "sweep_rates": args.sweep_rates,
            "quick": args.quick, "pin_cpus": args.pin_cpus, "extra_overrides": extra, "chatter_bytes_per_s": chatter, "cores": os.cpu_count(),
            "loadavg_start": load_start, "loadavg_end": load_average(),
            # sites.streams auto: the streams the probe keeps on this link (comm/link.py choose_streams)
            "streams": streams_for(args.rate_mbit * 1e6, 2 * args.delay_ms / 1e3), "window_bytes": kernel_window(),
            "tcp": site_tcp()}
    for m in results:
        m["predicted"] = predicted(meta, m)
    if args.from_raw:
        meta.update(measured_load(args.out / "wan.json", meta))
    data: dict[str, Any] = {"meta": meta, "results": results}
    if (args.out / "wan.json").is_file():  # the emulator's ceiling is measured apart (--ceiling): kept
        data.update({k: v for k, v in json.loads((args.out / "wan.json").read_text()).items() if k in KEPT})
    data["targets"] = targets(args, results)
    write_outputs(args.out, "wan", data, render(data))
    if plot(results, args.out / "wan.png") is not None:
        say_written(args.out / "wan.png")
    return 0


def site_tcp() -> dict[str, str]:
    """The TCP settings the rows' site namespaces run with: the host's congestion control (a new
    namespace inherits it) and the emulator's tcp_slow_start_after_idle (0)."""
    congestion = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    return {"net.ipv4.tcp_congestion_control": congestion, "net.ipv4.tcp_slow_start_after_idle": "0"}


def backend_name(args: argparse.Namespace) -> str:
    from zeroband.wan.emulator import netem_available

    if not (args.delay_ms or args.jitter_ms or args.loss_pct):
        return "veth"
    return "netem" if netem_available() else "tun"


if __name__ == "__main__":
    raise SystemExit(main())
