"""zeroband DiLoCo versus torchft's DiLoCo on the same model, data, batch, schedule and H, in one run.

    python scripts/bench_torchft.py --out benchmarks                 # loopback, demo preset
    python scripts/bench_torchft.py --rate-mbit 100 --delay-ms 50    # loopback + an emulated WAN (temp dir)
    python scripts/bench_torchft.py --quick                          # CI smoke test (debug preset)

Per network setting (plain loopback, or zeroband.wan.WanEmulator namespaces with a rate/delay link):

- torchft: S replica groups x 1 rank (scripts/torchft_worker.py), `torchft.local_sgd.DiLoCo` +
  `Manager` (synchronous quorum, init_sync off) over torchft's `ProcessGroupGloo`, with
  `torchft_lighthouse` on loopback or inside site 0's namespace;
- zeroband: `launch_sites(..., wan=WanLink(...))`, 1 rank per site, `--diloco.comm_dtype` fp16 and fp32.

Both use configs/demo_diloco.toml (model, data split dp_rank = site / dp_size = S, inner AdamW +
schedule, grad clip, H, outer SGD Nesterov) with the same overrides, and OMP_NUM_THREADS = cores / S.
tokens/s is the steady state from the end of the first sync (startup, first quorum and connection
setup excluded) to the end of the last step. Bytes per sync: under the emulator, counted at each
site's `wan0` (sampled from outside; torchft's worker also reads its own counters around each sync);
on loopback, computed from the payload each replica puts into its all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    CORES,
    REPO,
    add_out_argument,
    ensure_demo_data,
    load_average,
    load_note,
    markdown_table,
    output_dir,
    write_outputs,
)

CONFIG = "configs/demo_diloco.toml"
WORKER = REPO / "scripts" / "torchft_worker.py"
LIGHTHOUSE_PORT = 29510
SAMPLE_S = 0.25


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", type=int, default=2, help="S: replica groups / sites, 1 rank each")
    p.add_argument("--steps", type=int, default=None, help="inner steps per run (default 100; 6 with --quick)")
    p.add_argument("--inner-steps", type=int, default=None, help="H (default: the config's, 20; 2 with --quick)")
    p.add_argument("--zb-dtypes", default=None, help="zeroband comm dtypes (default fp16,fp32; fp16 with --quick)")
    p.add_argument("--torchft-buckets", default=None,
                   help="torchft DiLoCo variants: 0 = its default per-parameter all-reduce, N = use_bucketization "
                        "with bucket_cap_mb=N (default 0,32: 32 MB is zeroband's diloco.piece_mb; 0 with --quick)")
    p.add_argument("--rate-mbit", type=float, default=None, help="also run under an emulated link of this rate")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay of the emulated link")
    p.add_argument("--no-loopback", action="store_true", help="skip the plain loopback setting")
    p.add_argument("--quick", action="store_true", help="debug preset, seq 64, tiny run (CI smoke test)")
    add_out_argument(p, "benchmarks", "torchft.json / torchft.md")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = p.parse_args(argv)
    args.out = output_dir(args.out, "torchft", args.quick)
    args.steps = args.steps or (6 if args.quick else 100)
    args.inner_steps = args.inner_steps or (2 if args.quick else config_h())
    args.zb_dtypes = [d for d in (args.zb_dtypes or ("fp16" if args.quick else "fp16,fp32")).split(",") if d]
    args.torchft_buckets = [int(b) for b in (args.torchft_buckets or ("0" if args.quick else "0,32")).split(",") if b]
    if args.sites < 2 or args.steps % args.inner_steps or args.steps < 2 * args.inner_steps:
        p.error("need --sites >= 2 and --steps a multiple of H, at least 2 x H (steady window starts after sync 1)")
    if args.delay_ms and args.rate_mbit is None:
        p.error("--delay-ms needs --rate-mbit")
    return args


def config_h() -> int:
    from zeroband.config import load_config

    cfg = load_config(REPO / CONFIG)
    assert cfg.diloco is not None
    return cfg.diloco.inner_steps


def links(args: argparse.Namespace) -> dict[str, Any]:
    """{name: None (loopback) or WanLink}."""
    from zeroband.tools.launch import WanLink

    out: dict[str, Any] = {} if args.no_loopback else {"loopback": None}
    if args.rate_mbit is not None:
        out[f"wan-{args.rate_mbit:g}mbit-{args.delay_ms:g}ms"] = WanLink(rate_mbit=args.rate_mbit, delay_ms=args.delay_ms)
    return out


# ---------------------------------------------------------------------------------- shared configuration


def model_overrides(quick: bool) -> list[str]:
    if not quick:
        return []  # configs/demo_diloco.toml as is: demo preset, seq 256, batch 8 (micro 4)
    return ["--model.preset", "debug", "--model.vocab_size", "4096", "--data.seq_len", "64",
            "--train.global_batch", "4", "--train.micro_batch", "2"]


def common_overrides(args: argparse.Namespace) -> list[str]:
    """What both systems read: model, batch, steps (the cosine schedule spans them), H, eval batches."""
    return [*model_overrides(args.quick), "--train.steps", str(args.steps),
            "--diloco.inner_steps", str(args.inner_steps), "--checkpoint.interval", "0"]


def zeroband_overrides(args: argparse.Namespace, dtype: str, out_dir: Path, name: str) -> list[str]:
    """One train record per step, no periodic eval (one at the end), no checkpoints."""
    return [*common_overrides(args), "--name", name, "--output_dir", str(out_dir), "--diloco.comm_dtype", dtype,
            "--sites.timeout_s", "300", "--sites.insecure", "true", "--log.interval", "1", "--log.progress_bar", "false",
            "--eval.interval", "0", "--checkpoint.save_at_end", "false", "--checkpoint.resume", "none"]


def thread_env(sites: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(max(1, CORES // sites)), "OMP_WAIT_POLICY": "PASSIVE"}


# ---------------------------------------------------------------------------------- interface sampling


def ns_iface_bytes(ns: str) -> tuple[int, int]:
    """(tx, rx) bytes of `wan0` in namespace ns (as WanEmulator.iface_bytes)."""
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", "wan0"], capture_output=True, text=True)
    stats = json.loads(out.stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


class Sampler:
    """Polls every site's wan0 counters from outside the namespaces: [(wall time, tx, rx)] per site."""

    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self.samples: list[list[tuple[float, int, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, namespaces: list[str]) -> None:
        self.namespaces = namespaces
        self.samples = [[] for _ in namespaces]
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for series, ns in zip(self.samples, self.namespaces):
                try:
                    series.append((time.time(), *ns_iface_bytes(ns)))
                except (IndexError, KeyError, ValueError):
                    pass  # the namespace is going away
            self._stop.wait(SAMPLE_S)

    def stop(self) -> list[list[tuple[float, int, int]]]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.samples


# ---------------------------------------------------------------------------------- torchft


class TorchftNet:
    """Where the lighthouse and each replica live: loopback, or the emulator's namespaces."""

    def __init__(self, emu: Any | None) -> None:
        from zeroband.tools.launch import free_port

        self.emu = emu
        self.port = LIGHTHOUSE_PORT if emu else free_port()

    def host(self, i: int) -> str:
        return self.emu.site_ip(i) if self.emu else "127.0.0.1"

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        return self.emu.wrap(i, cmd) if self.emu else cmd

    def env(self, i: int) -> dict[str, str]:
        return self.emu.env(i) if self.emu else {"GLOO_SOCKET_IFNAME": "lo"}

    @property
    def lighthouse(self) -> str:
        return f"http://{self.host(0)}:{self.port}"


def start_lighthouse(net: TorchftNet, sites: int, log: Path) -> subprocess.Popen:
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    cmd = net.wrap(0, [binary, "--min_replicas", str(sites), "--bind", f"{net.host(0)}:{net.port}"])
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while "listening" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"torchft_lighthouse did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc


def start_workers(args: argparse.Namespace, net: TorchftNet, work: Path, bucket_mb: int) -> list[subprocess.Popen]:
    procs = []
    for i in range(args.sites):
        cmd = [sys.executable, str(WORKER), "--replica", str(i), "--replicas", str(args.sites),
               "--lighthouse", net.lighthouse, "--host", net.host(i), "--result", str(work / f"replica{i}.json"),
               "--bucket-mb", str(bucket_mb),
               "--", *common_overrides(args)]
        env = {**os.environ, **thread_env(args.sites), **net.env(i)}
        log = open(work / f"replica{i}.log", "w")
        procs.append(subprocess.Popen(net.wrap(i, cmd), stdout=log, stderr=subprocess.STDOUT, env=env,
                                      cwd=REPO, start_new_session=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; whatever still runs after the timeout (or on an exception) is killed by process group."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]


def run_torchft(args: argparse.Namespace, link: Any | None, work: Path, bucket_mb: int) -> dict[str, Any]:
    work.mkdir(parents=True)
    with emulator(args.sites, link) as emu:
        net, sampler = TorchftNet(emu), Sampler()
        lighthouse = start_lighthouse(net, args.sites, work / "lighthouse.log")
        try:
            if emu:
                sampler.start([emu.site_ns(i) for i in range(args.sites)])
            codes = wait_all(start_workers(args, net, work, bucket_mb), args.timeout)
        finally:
            samples = sampler.stop()
            wait_all([lighthouse], 0)
    if any(codes):
        logs = "\n".join((work / f"replica{i}.log").read_text()[-3000:] for i in range(args.sites))
        raise RuntimeError(f"torchft workers exited with {codes}:\n{logs}")
    replicas = [json.loads((work / f"replica{i}.json").read_text()) for i in range(args.sites)]
    return summarise_torchft(args, replicas, samples)


class emulator:  # noqa: N801  (a context manager used like a function)
    """WanEmulator(link) or nothing (loopback)."""

    def __init__(self, sites: int, link: Any | None) -> None:
        self.sites, self.link, self.emu = sites, link, None

    def __enter__(self) -> Any | None:
        if self.link is None:
            return None
        from zeroband.wan import WanEmulator

        lk = self.link
        self.emu = WanEmulator(self.sites, lk.rate_mbit, lk.delay_ms, lk.jitter_ms, lk.loss_pct, lk.mtu, name="zbtf")
        return self.emu.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.emu is not None:
            self.emu.__exit__(*exc)


# ---------------------------------------------------------------------------------- zeroband


def run_zeroband(args: argparse.Namespace, link: Any | None, dtype: str, work: Path) -> dict[str, Any]:
    from zeroband.tools.launch import launch_sites

    sampler = Sampler()

    def on_started(procs: list[subprocess.Popen]) -> None:
        if link is not None:  # `ip netns exec <ns> ...`: the namespace is the 4th word
            sampler.start([p.args[3] for p in procs])  # type: ignore[index]

    name = f"zb-{dtype}"
    os.environ.update(thread_env(args.sites))  # launch_sites passes OMP_NUM_THREADS through
    try:
        codes = launch_sites(CONFIG, args.sites, 1, zeroband_overrides(args, dtype, work, name), work / "logs",
                             timeout_s=args.timeout, wan=link, on_started=on_started)
    finally:
        samples = sampler.stop()
    if any(codes):
        logs = "\n".join((work / "logs" / f"site{s}.log").read_text()[-3000:] for s in range(args.sites))
        raise RuntimeError(f"zeroband sites exited with {codes}:\n{logs}")
    records = [read_jsonl(work / name / f"site{s}" / "metrics.jsonl") for s in range(args.sites)]
    return summarise_zeroband(args, records, samples)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------- summaries


def tokens_per_step(args: argparse.Namespace) -> int:
    from zeroband.config import load_config

    cfg = load_config(REPO / CONFIG, common_overrides(args))
    return cfg.train.global_batch * cfg.data.seq_len


def steady(args: argparse.Namespace, step_end: list[list[float]]) -> dict[str, Any]:
    """Throughput from the end of step H (first sync done) to the end of the last step, per replica."""
    h, n, tps = args.inner_steps, args.steps, tokens_per_step(args)
    spans = [ends[n - 1] - ends[h - 1] for ends in step_end]
    per = [(n - h) * tps / span for span in spans]
    return {"tokens_per_s": sum(per), "tokens_per_s_per_replica": per,
            "step_s": statistics.fmean(spans) / (n - h), "window": [step_end[0][h - 1], step_end[0][n - 1]],
            "syncs_in_window": (n - h) // h}


def iface_summary(samples: list[list[tuple[float, int, int]]], window: list[float], syncs: list[list[list[float]]],
                  n_syncs: int) -> dict[str, Any] | None:
    """Bytes each site's wan0 sent/received per sync in the steady window, all traffic included, and the
    background rate (heartbeats, quorum RPCs ...) measured between syncs; None without samples."""
    if not samples or not all(len(s) > 2 for s in samples):
        return None
    per_site = [_site_bytes(s, window, sync, n_syncs) for s, sync in zip(samples, syncs)]
    means = {k: None if any(p[k] is None for p in per_site) else statistics.fmean(p[k] for p in per_site)
             for k in per_site[0]}
    return {**means, "per_site": per_site}


def _site_bytes(series: list[tuple[float, int, int]], window: list[float], syncs: list[list[float]],
                n_syncs: int) -> dict[str, float]:
    t = [s[0] for s in series]

    def at(when: float, col: int) -> float:
        import numpy as np

        return float(np.interp(when, t, [s[col] for s in series]))

    tx = at(window[1], 1) - at(window[0], 1)
    rx = at(window[1], 2) - at(window[0], 2)
    bg_bytes = bg_time = 0.0
    for a, b in zip(series, series[1:]):
        if window[0] <= a[0] and b[0] <= window[1] and not any(a[0] < e + 0.3 and b[0] > s - 0.3 for s, e in syncs):
            bg_bytes, bg_time = bg_bytes + b[1] - a[1], bg_time + b[0] - a[0]
    bg_rate = bg_bytes / bg_time if bg_time > 1.0 else None  # no stretch between syncs long enough to measure
    span = window[1] - window[0]
    return {"tx_per_sync": tx / n_syncs, "rx_per_sync": rx / n_syncs, "background_tx_bytes_per_s": bg_rate,
            "tx_per_sync_minus_background": None if bg_rate is None else (tx - bg_rate * span) / n_syncs}


def final_losses(args: argparse.Namespace, losses: list[list[float]]) -> dict[str, float]:
    h = args.inner_steps
    return {"final_train_loss_last_step": statistics.fmean(x[-1] for x in losses),
            "final_train_loss_last_h": statistics.fmean(statistics.fmean(x[-h:]) for x in losses)}


def summarise_torchft(args: argparse.Namespace, replicas: list[dict[str, Any]], samples: list) -> dict[str, Any]:
    s = args.sites
    st = steady(args, [r["step_end"] for r in replicas])
    in_window = [[x for x in r["syncs"] if x["step"] > args.inner_steps] for r in replicas]
    sync_s = statistics.fmean(x["sync_s"] for w in in_window for x in w)
    payload = replicas[0]["payload_bytes"]
    out = {
        "system": "torchft", "bucket_mb": replicas[0]["bucket_mb"], **st, "sync_s": sync_s,
        "quorum_s": statistics.fmean(x["quorum_s"] for w in in_window for x in w),
        "payload_bytes": payload, "computed_wire_bytes_per_sync": 2 * (s - 1) / s * payload,
        "startup_s": statistics.fmean(r["step_end"][args.inner_steps - 1] - r["start"] for r in replicas),
        **final_losses(args, [r["losses"] for r in replicas]), "val_loss": replicas[0]["val_loss"],
        "replicas_identical": len({r["param_checksum"] for r in replicas}) == 1, "numel": replicas[0]["numel"],
        "torchft_version": replicas[0]["torchft_version"], "threads": replicas[0]["threads"],
    }
    counted = [x["tx_bytes"] for w in in_window for x in w if "tx_bytes" in x]
    if counted:
        out["worker_counted_tx_per_sync"] = statistics.fmean(counted)
    out["iface"] = iface_summary(samples, st["window"], [[[x["start"], x["end"]] for x in r["syncs"]] for r in replicas],
                                 st["syncs_in_window"])
    return out


def summarise_zeroband(args: argparse.Namespace, records: list[list[dict[str, Any]]], samples: list) -> dict[str, Any]:
    train = [[r for r in rs if r["kind"] == "train"] for rs in records]
    outer = [[r for r in rs if r["kind"] == "outer"] for rs in records]
    st = steady(args, [[r["time"] for r in t] for t in train])
    in_window = [o for os_ in outer for o in os_ if o["step"] > args.inner_steps]
    val = [r for r in records[0] if r["kind"] == "val"]
    out = {
        "system": "zeroband", **st, "sync_s": statistics.fmean(o["outer_step_s"] for o in in_window),
        "allreduce_s": statistics.fmean(o["allreduce_s"] for o in in_window),
        "payload_bytes": outer[0][-1]["payload_bytes"], "computed_wire_bytes_per_sync": outer[0][-1]["wire_bytes"],
        "startup_s": None, **final_losses(args, [[r["loss"] for r in t] for t in train]),
        "val_loss": val[-1]["val_loss"] if val else None,
    }
    syncs = [[[o["time"] - o["outer_step_s"], o["time"]] for o in os_] for os_ in outer]
    out["iface"] = iface_summary(samples, st["window"], syncs, st["syncs_in_window"])
    return out


# ---------------------------------------------------------------------------------- report


def bytes_per_sync(r: dict[str, Any]) -> tuple[float, str]:
    """Measured at the interface when there is one, otherwise computed from the all-reduce payload."""
    if r.get("iface"):
        return r["iface"]["tx_per_sync"], "wan0 tx (all traffic)"
    return r["computed_wire_bytes_per_sync"], "computed 2(S-1)/S x payload"


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """zeroband / torchft for every (zeroband run, torchft variant) pair."""
    out = {}
    for tf_name, tf in results.items():
        for name, r in results.items():
            if r["system"] == "zeroband" and tf["system"] == "torchft":
                out[f"{name} / {tf_name}"] = {"tokens_per_s": r["tokens_per_s"] / tf["tokens_per_s"],
                                              "bytes_per_sync": bytes_per_sync(r)[0] / bytes_per_sync(tf)[0],
                                              "sync_s": r["sync_s"] / tf["sync_s"]}
    return out


def fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def link_table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    rows: list[list[Any]] = []

    def row(label: str, fn: Any) -> None:
        rows.append([label, *(fn(results[n]) for n in names)])

    row("tokens/s (all replicas, steady)", lambda r: fmt(r["tokens_per_s"], ",.0f"))
    row("s per step", lambda r: fmt(r["step_s"], ".3f"))
    row("time per sync, s (mean, steady window)", lambda r: fmt(r["sync_s"], ".3f"))
    row("  of which quorum (torchft) / all-reduce wait (zeroband), s",
        lambda r: fmt(r.get("quorum_s", r.get("allreduce_s")), ".3f"))
    row("bytes sent per sync per replica", lambda r: fmt(bytes_per_sync(r)[0], ",.0f"))
    row("  (how)", lambda r: bytes_per_sync(r)[1])
    row("  torchft worker: wan0 tx during its sync hook", lambda r: fmt(r.get("worker_counted_tx_per_sync"), ",.0f"))
    row("bytes received per sync per replica", lambda r: fmt((r.get("iface") or {}).get("rx_per_sync"), ",.0f"))
    row("background tx between syncs, B/s", lambda r: fmt((r.get("iface") or {}).get("background_tx_bytes_per_s"), ",.0f"))
    row("all-reduce payload B", lambda r: fmt(r["payload_bytes"], ",.0f"))
    row("final train loss (last step, mean over replicas)", lambda r: fmt(r["final_train_loss_last_step"], ".4f"))
    row("final train loss (mean of last H steps)", lambda r: fmt(r["final_train_loss_last_h"], ".4f"))
    row("val loss after the last sync", lambda r: fmt(r["val_loss"], ".4f"))
    return markdown_table(["", *names], rows)


def ratio_table(rat: dict[str, dict[str, float]]) -> str:
    rows = [[n, f"{r['tokens_per_s']:.3f}", f"{r['bytes_per_sync']:.3f}", f"{r['sync_s']:.3f}"] for n, r in rat.items()]
    return markdown_table(["zeroband / torchft", "tokens/s ratio zb / torchft", "bytes/sync ratio zb / torchft",
                           "sync time ratio zb / torchft"], rows)


def render(data: dict[str, Any]) -> str:
    m = data["meta"]
    parts = [f"## zeroband vs torchft DiLoCo: {m['preset']} preset, {m['sites']} sites x 1 rank, H={m['inner_steps']}, "
             f"{m['steps']} steps, torchft {m['torchft_version']}, torch {m['torch_version']}, {m['cores']} cores"]
    for link, results in data["links"].items():
        parts += [f"### {link}", link_table(results), ratio_table(data["ratios"][link])]
    parts += [NOTES.format(**m), load_note(m["loadavg_start"], m["loadavg_end"])]
    return "\n\n".join(parts)


NOTES = (
    "Same config for both ({config}): model seeded by zeroband's init_weights, zeroband's PackedBatches with "
    "dp_rank = site / dp_size = S, inner AdamW with the same lr schedule and grad clip, H inner steps, outer SGD "
    "Nesterov; OMP_NUM_THREADS={OMP_NUM_THREADS} per replica ({sites} replicas on {cores} cores). tokens/s: from "
    "the end of the first sync to the end of the last step (startup, first quorum, PG setup excluded), summed over "
    "replicas. Time per sync: torchft = its optimizer post-hook on sync steps (lighthouse quorum + pseudo-gradient "
    "+ per-parameter fp32 gloo all-reduces + should_commit RPC + outer step); zeroband = OuterStats.outer_step_s. "
    "Bytes on loopback are computed (2(S-1)/S x payload: torchft sends fp32 per parameter, zeroband its comm dtype); "
    "under the emulator they are wan0 tx bytes over the steady window / syncs, sampled every {sample_s} s from "
    "outside, so they include headers, heartbeats and RPCs (background = tx rate between syncs). Differences that "
    "torchft imposes: a lighthouse quorum RPC per sync, a should_commit RPC per sync, a 100 ms heartbeat from every "
    "manager to the lighthouse, an HTTP checkpoint server per replica; zeroband wraps its 1-rank site in FSDP2 and "
    "exchanges site statistics before each all-reduce, torchft's worker runs the plain module."
)


def check_torchft() -> str | None:
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        return f"torchft is not installed ({e}); `pip install torchft` (it must not replace the installed torch)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = check_torchft()
    if missing:
        print(f"bench_torchft: SKIPPED: {missing}", file=sys.stderr)
        return 0 if args.quick else 2
    ensure_demo_data()
    os.chdir(REPO)
    load_start = load_average()
    data: dict[str, Any] = {"links": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="bench_torchft-") as tmp:
        for link_name, link in links(args).items():
            data["links"][link_name] = run_link(args, link_name, link, Path(tmp) / link_name)
            data["ratios"][link_name] = ratios(data["links"][link_name])
    data["meta"] = meta(args, data, load_start)
    write_outputs(args.out, "torchft", data, render(data))
    return 0


def run_link(args: argparse.Namespace, name: str, link: Any | None, work: Path) -> dict[str, dict[str, Any]]:
    t0 = time.perf_counter()
    results = {}
    for b in args.torchft_buckets:
        label = f"torchft bucketized {b} MB" if b else "torchft"
        results[label] = run_torchft(args, link, work / f"torchft-{b}", b)
    for dtype in args.zb_dtypes:
        results[f"zeroband {dtype}"] = run_zeroband(args, link, dtype, work / f"zb-{dtype}")
    print(f"[bench_torchft] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return results


def meta(args: argparse.Namespace, data: dict[str, Any], load_start: float) -> dict[str, Any]:
    import torch

    try:
        tf_version = version("torchft")
    except PackageNotFoundError:
        tf_version = "?"
    return {"preset": "debug" if args.quick else "demo", "sites": args.sites, "inner_steps": args.inner_steps,
            "steps": args.steps, "config": CONFIG, "overrides": common_overrides(args), "cores": CORES,
            "torchft_version": tf_version, "torch_version": torch.__version__, "quick": args.quick,
            "tokens_per_step_per_replica": tokens_per_step(args), "sample_s": SAMPLE_S,
            **thread_env(args.sites), "loadavg_start": load_start, "loadavg_end": load_average()}


if __name__ == "__main__":
    raise SystemExit(main())
