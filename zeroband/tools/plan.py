"""Capacity planning for DiLoCo over a WAN: how much each sync costs and what utilisation to expect.

Model (one outer sync, per site; all of a site's FSDP ranks share the site's WAN uplink, so the
site moves the whole model's payload whatever W is):

- payload P = params x bytes/param of the wire format, as its codec counts them (zeroband/comm/codecs/:
  fp32 4, bf16/fp16 2, int8 1 + 2/128 for the per-block bf16 scales ~ 1.02, int4 0.5 + 2/64 ~ 0.53,
  sparse ~0.036 at density 0.02);
- wire bytes per site = 2(S-1)/S x P (direct reduce-scatter + all-gather, zeroband/comm/direct.py;
  the same bytes as a ring), or (S-1) x P for a codec whose contributions go to every site (sparse:
  zeroband/comm/gather.py);
- communication seconds T_comm = wire / throughput, where throughput = min(rate, streams x window /
  RTT) is zeroband/comm/link.py's link model: one TCP stream keeps at most one kernel window in
  flight, and the streams per peer default to those that cover the bandwidth-delay product
  (`streams_for`, at most 16), as the cross-site transport chooses them;
  + latency: 4 one-way delays whatever S (ONE_WAY_DELAYS; zeroband's transport pushes a message
  without waiting for the receiver to announce its buffer): the site statistics that precede every
  average, the scatter's last byte, the review of what every source sent (comm/reduce.py: it waits
  for the whole scatter, so the all-gather cannot start before it), the all-gather's last byte;
  the payload's messages within a phase are all posted at once, so no per-hop latency as in a ring
  + TCP ramp (optional, on by default: Linux's tcp_slow_start_after_idle = 1 with a loss-based
  congestion control such as cubic; BBR, or the setting at 0, keeps the window: --no-tcp-ramp): a
  sender idle for more than a retransmission timeout (RTT + 200 ms) halves its window per timeout,
  down to the initial 10 segments (`restart_window`), so after the inner steps of a round every
  sync starts from the initial window on every stream and doubles it per round trip; each such
  round that carries less than a bandwidth-delay product costs RTT - carried/throughput extra
  seconds (the review's pause between scatter and all-gather is shorter than a timeout);
- inner compute per round T_c = H x step time;
- utilisation: blocking T_c / (T_c + T_comm); overlapped T_c / max(T_c, T_comm) (the average of
  round k travels while round k+1 computes; only what does not fit is waited for);
- traffic reduction vs per-step fp32 data parallel = H x 4 / (bytes/param);
- wait bounds: `wait_bound` of one piece's wire bytes and of the whole all-reduce's, with
  sites.wait_factor, sites.timeout_floor_s and sites.timeout_s (the bounds a link-timed transport
  would give its waits).

Per-step data parallel is the same model with H = 1, fp32, blocking.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from zeroband.comm import codecs
from zeroband.comm.link import (
    DEFAULT_WINDOW,
    Link,
    kernel_window,
    streams_for,
    throughput,
    transfer_s,
    wait_bound,
)
from zeroband.config import DilocoConfig, SitesConfig

# Payload bytes per parameter of each wire format at its default settings, as its codec counts them.
DTYPE_BYTES: dict[str, float] = {name: spec.bytes_per_param() for name, spec in codecs.registry().items()}
INITIAL_WINDOW_SEGMENTS = 10  # Linux initcwnd
RTO_MIN_S = 0.2  # Linux TCP_RTO_MIN: a steady link's retransmission timeout is about RTT + 200 ms
# One-way delays on the critical path of one all-reduce (comm/reduce.py, comm/direct.py; zeroband's
# transport pushes every message without waiting for the receiver): the site statistics, the
# scatter's last byte, the review of what every source sent (it waits for the whole scatter), the
# all-gather's last byte.
ONE_WAY_DELAYS = 4
IP_TCP_HEADERS = 52  # IPv4 20 + TCP 20 + timestamps option 12

# The --table assumptions: H100 dense bf16 peak x 40% MFU; step time = 6 N x tokens per step /
# (GPUs per site x peak x MFU). Tokens per step from configs/{150M,1B,10B}.toml; 100B assumed.
H100_PEAK_FLOPS = 989e12
TABLE_MFU = 0.40
TABLE_MODELS: dict[str, dict[str, float]] = {
    "150M": {"params": 150e6, "tokens_per_step": 524288, "gpus_per_site": 8},
    "1B": {"params": 1e9, "tokens_per_step": 524288, "gpus_per_site": 8},
    "10B": {"params": 10e9, "tokens_per_step": 1048576, "gpus_per_site": 64},
    "100B": {"params": 100e9, "tokens_per_step": 4194304, "gpus_per_site": 512},
}
TABLE_GBPS = (0.1, 1.0, 10.0)
TABLE_H = (100, 500)
TABLE_DTYPES = ("fp16", "int8", "int4")
TABLE_SITES = 4
TABLE_LATENCY_MS = 50.0
_SITES, _DILOCO = SitesConfig.model_fields, DilocoConfig.model_fields


@dataclass(frozen=True)
class PlanInput:
    params: float  # parameters whose pseudo-gradients a site sends (the whole model per site)
    step_time_s: float  # one inner step's compute
    sites: int
    gbps: float  # per-site uplink, Gbit/s
    latency_ms: float  # one-way
    inner_steps: int  # H
    dtype: str = "fp16"
    overlap: bool = False
    tcp_ramp: bool = True
    mtu: int = 1500
    streams: int | None = None  # TCP streams per peer; None: those that cover the bandwidth-delay product
    window_bytes: int = DEFAULT_WINDOW  # bytes one stream keeps in flight at most
    piece_mb: float = _DILOCO["piece_mb"].default
    wait_factor: float = _SITES["wait_factor"].default
    timeout_floor_s: float = _SITES["timeout_floor_s"].default
    timeout_s: float = _SITES["timeout_s"].default
    density: float = _DILOCO["density"].default  # the sparse codec's (diloco.density)
    fragments: int = 1  # diloco.fragments: P syncs per H, each its own round trips
    largest_fragment: float = 0.0  # the largest fragment's share of the parameters (0: an even 1 / P)


@dataclass(frozen=True)
class Prediction:
    payload_bytes: float
    wire_bytes: float
    bandwidth_s: float
    latency_s: float
    ramp_s: float
    comm_s: float
    compute_s: float
    utilisation: float
    traffic_reduction: float
    dp_comm_s: float  # per-step fp32 data parallel: communication per step
    dp_utilisation: float
    streams: int = 1
    throughput_bps: float = 0.0  # the streams' rate: min(link rate, streams x window / RTT)
    piece_wait_s: float = 0.0  # wait_bound of one piece's wire bytes
    sync_wait_s: float = 0.0  # wait_bound of the whole all-reduce's wire bytes
    largest_sync_bytes: float = 0.0  # wire bytes of the largest single sync (fragments: the largest one's)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def ring_factor(sites: int) -> float:
    """Bytes each participant sends in a ring all-reduce, per byte of payload: 2(S-1)/S."""
    return 2 * (sites - 1) / sites


def dtype_bytes(dtype: str, density: float | None = None) -> float:
    """Payload bytes per parameter of wire format `dtype`, asked of its codec (`density`: the sparse
    codec's setting; None: the default)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
    if density is None:
        return DTYPE_BYTES[dtype]
    return codecs.spec(dtype).bytes_per_param(DilocoConfig(comm_dtype=dtype, density=density))


def wire_factor(p: PlanInput) -> float:
    """Bytes a site sends per byte of its payload: its codec's exchange (`ring_factor` for most)."""
    return codecs.spec(p.dtype).wire_factor(p.sites)


def utilisation(compute_s: float, comm_s: float, overlap: bool) -> float:
    if overlap:
        return compute_s / max(compute_s, comm_s)
    return compute_s / (compute_s + comm_s)


def overlap_steps(comm_s: float, step_time_s: float, inner_steps: int) -> int:
    """The `diloco.overlap_steps` (tau) that hides one all-reduce: the inner steps it takes, rounded
    up; 0 (a whole round) when it takes a round or more. Smaller tau trains closer to blocking
    (docs/results/convergence_tuning.md), so this is the freshest setting that costs no waiting."""
    steps = max(1, math.ceil(comm_s / step_time_s))
    return steps if steps < inner_steps else 0


def traffic_reduction(inner_steps: int, dtype: str, density: float | None = None) -> float:
    """Bytes of per-step fp32 data parallel over H steps / bytes of one DiLoCo sync."""
    return inner_steps * 4.0 / dtype_bytes(dtype, density)


def ramp_seconds(nbytes: float, rate_bytes_s: float, rtt_s: float, mtu: int, streams: int = 1,
                 start_bytes: float | None = None) -> float:
    """Extra seconds slow start costs a transfer of nbytes that starts from `start_bytes` in flight
    over all streams (default: the initial window of each of `streams` streams); `rate_bytes_s` is
    what the streams deliver once ramped up."""
    mss = mtu - IP_TCP_HEADERS
    cwnd = streams * INITIAL_WINDOW_SEGMENTS * mss if start_bytes is None else start_bytes
    bdp, left, extra = rate_bytes_s * rtt_s, nbytes, 0.0
    while left > 0 and cwnd < bdp:
        carried = min(cwnd, left)
        extra += rtt_s - carried / rate_bytes_s
        left -= carried
        cwnd *= 2
    return extra


def restart_window(idle_s: float, rtt_s: float, steady_bytes: float, initial_bytes: float) -> float:
    """Bytes in flight a sender restarts with after `idle_s` without sending (Linux tcp_cwnd_restart,
    tcp_slow_start_after_idle = 1, a loss-based congestion control): an idle up to one retransmission
    timeout (RTT + 200 ms on a steady link) changes nothing; each further timeout halves the window,
    down to the initial window. Idle seconds between outer steps are many timeouts: the initial window."""
    halvings = max(0, math.ceil(idle_s / (rtt_s + RTO_MIN_S)) - 1)
    return max(initial_bytes, steady_bytes / 2.0 ** min(halvings, 64))


def link_of(p: PlanInput) -> Link:
    """The link model of the plan: RTT = 2 x one-way, the uplink's rate, the streams and window."""
    rtt, rate = 2 * p.latency_ms / 1e3, p.gbps * 1e9
    return Link(rtt, rate, p.streams or streams_for(rate, rtt, p.window_bytes), p.window_bytes)


def comm_seconds(wire_bytes: float, p: PlanInput, idle_s: float = math.inf) -> tuple[float, float, float]:
    """(bandwidth, latency, ramp) seconds of one all-reduce sending wire_bytes per site, after the link
    idled `idle_s` (the inner steps since the last sync)."""
    link = link_of(p)
    latency = ONE_WAY_DELAYS * link.rtt_s / 2
    ramp = 0.0
    if p.tcp_ramp:
        rate = throughput(link) / 8
        initial = link.streams * INITIAL_WINDOW_SEGMENTS * (p.mtu - IP_TCP_HEADERS)
        start = restart_window(idle_s, link.rtt_s, rate * link.rtt_s, initial)
        ramp = ramp_seconds(wire_bytes, rate, link.rtt_s, p.mtu, link.streams, start)
    return transfer_s(wire_bytes, link), latency, ramp


def wait_bounds(wire_bytes: float, p: PlanInput) -> tuple[float, float]:
    """(one piece's, the whole all-reduce's) wait bound: a piece is piece_mb of fp32 values sent in
    the wire format, with the all-reduce's 2(S-1)/S factor."""
    piece = min(wire_bytes, wire_factor(p) * p.piece_mb * 2**20 / 4 * dtype_bytes(p.dtype, p.density))
    bound = [wait_bound(b, link_of(p), p.wait_factor, p.timeout_floor_s, p.timeout_s) for b in (piece, wire_bytes)]
    return bound[0], bound[1]


def predict(p: PlanInput) -> Prediction:
    if p.sites < 2:
        raise ValueError("sites must be >= 2")
    payload = p.params * dtype_bytes(p.dtype, p.density)
    wire = wire_factor(p) * payload
    compute = p.inner_steps * p.step_time_s
    share, gap = wire / p.fragments, compute / p.fragments  # one fragment's sync, and the link's idle between syncs
    bw_s, lat_s, ramp_s = comm_seconds(share, p, gap)
    if p.overlap:  # the link idles only for what of the round the all-reduce leaves
        bw_s, lat_s, ramp_s = comm_seconds(share, p, max(0.0, gap - bw_s - lat_s))
    bw_s, lat_s, ramp_s = (p.fragments * x for x in (bw_s, lat_s, ramp_s))  # every fragment once per H
    comm = bw_s + lat_s + ramp_s
    dp_comm = sum(comm_seconds(ring_factor(p.sites) * p.params * 4.0, p, p.step_time_s))
    link = link_of(p)
    piece_wait, sync_wait = wait_bounds(wire, p)
    largest = wire * (p.largest_fragment or 1 / p.fragments)
    return Prediction(
        payload_bytes=payload, wire_bytes=wire, bandwidth_s=bw_s, latency_s=lat_s, ramp_s=ramp_s, comm_s=comm,
        compute_s=compute, utilisation=utilisation(compute, comm, p.overlap),
        traffic_reduction=traffic_reduction(p.inner_steps, p.dtype, p.density),
        dp_comm_s=dp_comm, dp_utilisation=utilisation(p.step_time_s, dp_comm, False),
        streams=link.streams, throughput_bps=throughput(link), piece_wait_s=piece_wait, sync_wait_s=sync_wait,
        largest_sync_bytes=largest,
    )


def predict_data_parallel(p: PlanInput) -> Prediction:
    """Per-step fp32 data parallel as a 'DiLoCo' with H = 1, blocking, fp32."""
    return predict(replace(p, inner_steps=1, dtype="fp32", overlap=False))


# ------------------------------------------------------------------------------- the recommended H

# Fewest outer steps a run should keep. 20 is the regime of the large-H study
# (scripts/experiments/large_h.py, docs/results/large_h.md): runs of >= 20 outer steps. It stays the
# floor until that study's results say otherwise.
MIN_OUTER_STEPS = 20
TARGET_UTILISATION = 0.95  # the compute utilisation the recommendation reports the H for
STUDY = "docs/results/large_h.md"


def h_for_utilisation(step_time_s: float, sync_time_s: float, target: float, overlap: bool = False) -> int:
    """Smallest H whose compute utilisation reaches `target` (< 1): blocking H t / (H t + c) >= u, so
    H >= u c / ((1 - u) t); overlapped H t / max(H t, c) >= u, so H >= u c / t."""
    need = target * sync_time_s / (step_time_s if overlap else (1 - target) * step_time_s)
    return max(1, math.ceil(need - 1e-9))  # 1e-9: an exact quotient is not pushed one H up by rounding


def valid_h(steps: int, most: int, period: int = 0) -> int:
    """Largest H <= most that divides train.steps (the run ends on an outer step) and `period`
    (checkpoint.interval, when set: checkpoints sit on outer boundaries); 0 when none."""
    return next((h for h in range(min(most, steps), 0, -1) if steps % h == 0 and (not period or period % h == 0)), 0)


def recommend_h(steps: int, step_time_s: float, sync_time_s: float, min_outer_steps: int = MIN_OUTER_STEPS,
                target_util: float = TARGET_UTILISATION, overlap: bool = False, period: int = 0) -> tuple[int, str]:
    """(H, why): the largest H that keeps `min_outer_steps` outer steps over `steps` inner steps, beside
    the H at which one sync of `sync_time_s` costs no more than the utilisation target. Pure."""
    h = valid_h(steps, steps // min_outer_steps, period)
    fits = f", dividing checkpoint.interval={period}" if period else ""
    if h == 0:
        h = 1  # the most outer steps there are
        keep = f"no H keeps >= {min_outer_steps} outer steps over {steps} steps{fits}; H = 1 keeps the most"
    else:
        keep = f"the largest H keeping >= {min_outer_steps} outer steps over {steps} steps{fits}"
    h_util = h_for_utilisation(step_time_s, sync_time_s, target_util, overlap)
    if h_util <= h:
        link = f"H >= {h_util} reaches {target_util:.0%} compute utilisation on this link"
    else:
        outer = f"{steps // h_util} outer steps" if h_util <= steps else f"more than the run's {steps} steps"
        link = (f"it reaches only {utilisation(h * step_time_s, sync_time_s, overlap):.1%} compute utilisation on "
                f"this link, {target_util:.0%} needs H >= {h_util} ({outer}): overlap, a smaller wire format or a "
                "faster link")
    return h, f"{keep}; {link}; floor {min_outer_steps}: the regime of {STUDY}, until that study says otherwise"


def h_warning(inner_steps: int, steps: int, min_outer_steps: int = MIN_OUTER_STEPS) -> str | None:
    """One line when the config's own H leaves fewer outer steps than the floor; None otherwise."""
    outer = steps // inner_steps
    if outer >= min_outer_steps:
        return None
    return (f"warning: diloco.inner_steps={inner_steps} leaves {outer} outer step{'s' if outer != 1 else ''} over "
            f"train.steps={steps}, under the {min_outer_steps} of the measured regime ({STUDY}): set "
            "--diloco.inner_steps to the recommended H")


# ------------------------------------------------------------------------------- tables and the CLI


def table_step_time(model: str) -> float:
    m = TABLE_MODELS[model]
    return 6 * m["params"] * m["tokens_per_step"] / (m["gpus_per_site"] * H100_PEAK_FLOPS * TABLE_MFU)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def table_rows() -> list[list[Any]]:
    rows = []
    for model in TABLE_MODELS:
        step = table_step_time(model)
        for gbps in TABLE_GBPS:
            for h in TABLE_H:
                for dtype in TABLE_DTYPES:
                    p = PlanInput(TABLE_MODELS[model]["params"], step, TABLE_SITES, gbps, TABLE_LATENCY_MS, h, dtype)
                    blocking, overlapped = predict(p), predict(replace(p, overlap=True))
                    rows.append([model, f"{step:.2f}", gbps, h, dtype, _fmt_bytes(blocking.wire_bytes),
                                 f"{blocking.comm_s:.2f}", f"{blocking.compute_s:.0f}",
                                 f"{100 * blocking.utilisation:.1f}%", f"{100 * overlapped.utilisation:.1f}%",
                                 f"{100 * blocking.dp_utilisation:.2f}%", f"{blocking.traffic_reduction:.0f}x"])
    return rows


TABLE_HEADERS = ["model", "step s", "Gbit/s", "H", "dtype", "wire/site/sync", "comm s", "compute s/round",
                 "util blocking", "util overlapped", "util per-step DP", "traffic vs DP"]


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def table_markdown() -> str:
    notes = (
        f"Assumptions: {TABLE_SITES} sites, {TABLE_LATENCY_MS:.0f} ms one-way latency, MTU 1500, TCP slow start after "
        f"every idle period. Step time = 6 N x tokens/step / (GPUs/site x H100 {H100_PEAK_FLOPS / 1e12:.0f} TFLOP/s x "
        f"{TABLE_MFU:.0%} MFU); tokens/step and GPUs/site: "
        + ", ".join(f"{k} {int(v['tokens_per_step']):,} tok on {int(v['gpus_per_site'])} GPUs" for k, v in TABLE_MODELS.items())
        + " (150M/1B/10B from configs/, 100B assumed). Per-step DP = fp32 gradients all-reduced every step."
    )
    return markdown(TABLE_HEADERS, table_rows()) + "\n\n" + notes


def prediction_text(p: PlanInput, pred: Prediction) -> str:
    mode = "overlapped" if p.overlap else "blocking"
    return "\n".join([
        f"{p.params:.3g} params, {p.sites} sites, {p.gbps:g} Gbit/s per site, {p.latency_ms:g} ms one-way, "
        f"H={p.inner_steps}, {p.dtype} ({dtype_bytes(p.dtype, p.density):.3g} B/param), {mode}, step {p.step_time_s:g} s",
        f"  payload per sync per site      {_fmt_bytes(pred.payload_bytes)}",
        f"  wire per sync per site         {_fmt_bytes(pred.wire_bytes)}  (x {wire_factor(p):.3g} the payload)",
        f"  communication per sync         {pred.comm_s:.3f} s  (bandwidth {pred.bandwidth_s:.3f} + latency "
        f"{pred.latency_s:.3f} + TCP ramp {pred.ramp_s:.3f})",
        f"  inner compute per round        {pred.compute_s:.1f} s",
        f"  compute utilisation            {100 * pred.utilisation:.2f}%",
        *([f"  diloco.overlap_steps to set    {overlap_steps(pred.comm_s, p.step_time_s, p.inner_steps)}"
           "  (inner steps one all-reduce takes; 0 = a whole round)"] if p.overlap else []),
        f"  per-step fp32 data parallel    {pred.dp_comm_s:.3f} s comm/step, {100 * pred.dp_utilisation:.2f}% utilisation",
        f"  traffic reduction vs DP        {pred.traffic_reduction:.0f}x",
        *fragments_text(p, pred),
        *link_text(p, pred),
    ])


def fragments_text(p: PlanInput, pred: Prediction) -> list[str]:
    """The largest sync of a run in fragments: what its peak uplink need falls by. P-fold only when the
    fragments, whole tensors, balance; otherwise the largest tensor (often the embedding) bounds it."""
    if p.fragments == 1:
        return []
    share = p.largest_fragment or 1 / p.fragments
    bound = f", not {p.fragments}-fold (whole tensors)" if share > 1.05 / p.fragments else ""
    return [f"  largest fragment sync          {_fmt_bytes(pred.largest_sync_bytes)}  ({100 * share:.1f}% of the "
            f"model; 1 / P = {100 / p.fragments:.1f}%): the peak per sync falls {1 / share:.1f}-fold{bound}"]


def largest_fragment(model: Any, fragments: int) -> float:
    """The share of the parameters in the largest of `fragments` fragments, as the run splits them
    (zeroband/outer/fragments.py `split`, whole tensors), from the model's shapes on the meta device."""
    import torch

    from zeroband.models.llama import Llama
    from zeroband.outer.fragments import split

    with torch.device("meta"):
        numels = [q.numel() for q in Llama(model).parameters()]
    return max(sum(numels[i] for i in part) for part in split(numels, fragments)) / sum(numels)


def link_text(p: PlanInput, pred: Prediction) -> list[str]:
    """The link model's lines: streams (chosen or given), what they deliver, the wait bounds."""
    link = link_of(p)
    chosen = "given (--streams)" if p.streams else f"chosen: bandwidth-delay product {link.bdp_bytes / 1e6:.3g} MB / window, at most 16"
    return [
        f"  link                           RTT {1e3 * link.rtt_s:g} ms, window {link.window_bytes / 1e6:.3g} MB per stream, "
        f"{pred.streams} stream{'s' if pred.streams > 1 else ''} per peer ({chosen}) -> {pred.throughput_bps / 1e6:,.0f} Mbit/s",
        f"  wait bounds                    {pred.piece_wait_s:.1f} s per piece ({p.piece_mb:g} MB of fp32), "
        f"{pred.sync_wait_s:.1f} s per all-reduce  ({p.wait_factor:g} x transfer + 4 RTT, floor {p.timeout_floor_s:g} s, "
        f"ceiling sites.timeout_s {p.timeout_s:g} s)",
    ]


def params_of_preset(preset: str) -> int:
    from zeroband.config import ModelConfig
    from zeroband.models.llama import num_params

    return num_params(ModelConfig(preset=preset))


def input_from_args(args: argparse.Namespace) -> PlanInput:
    if (args.params is None) == (args.preset is None):
        raise ValueError("give exactly one of --params or --preset (or a config file: zeroband plan CONFIG.toml)")
    params = float(args.params) if args.params is not None else float(params_of_preset(args.preset))
    step = 1.0 if args.step_time is None else args.step_time
    return PlanInput(params, step, args.sites, args.gbps, args.latency_ms, args.inner_steps, args.dtype,
                     args.overlap, not args.no_tcp_ramp, args.mtu, **link_args(args),
                     density=getattr(args, "density", _DILOCO["density"].default))


def link_args(args: argparse.Namespace) -> dict[str, Any]:
    """--streams and --window-mb (default: this machine's kernel window) as PlanInput fields."""
    window_mb = getattr(args, "window_mb", None)  # a Namespace built by hand may lack both
    window = int(window_mb * 1e6) if window_mb else kernel_window()
    return {"streams": getattr(args, "streams", None), "window_bytes": window}


# ------------------------------------------------------------------------------- from a config file


@dataclass(frozen=True)
class ConfigPlan:
    """What `zeroband plan CONFIG.toml` read and assumed, beside the planner's input."""

    plan: PlanInput
    model: str
    piece_mb: float
    pieces: int  # pipeline pieces of one all-reduce (diloco.piece_mb of fp32 values each)
    tokens_per_step: int
    step_source: str
    notes: tuple[str, ...]
    steps: int = 0  # train.steps
    period: int = 0  # checkpoint.interval: H must divide it as well (0: checkpoints only at the end)


def measured_tokens_s(data: dict[str, Any], preset: str | None) -> tuple[float, str] | None:
    """zeroband's inner-step tokens/s for `preset` in a benchmark JSON: scripts/gpu_suite.py's
    gpu_suite.json (the shipped-config row first, then the bench-shape row) or bench_step.py --inner's
    inner_step.json."""
    rows = data.get("rows")
    if isinstance(rows, dict):  # gpu_suite.json
        for name in (f"speed/shipped-{preset}", f"speed/bench-{preset}"):
            if name in rows:
                return rows[name]["result"]["loops"]["zeroband"]["tokens_s"], f"{name} on {data.get('gpu', '?')}"
    elif isinstance(rows, list):  # inner_step.json
        for row in rows:
            if row.get("preset") == preset and row.get("loop") == "zeroband":
                return row["tokens_s"], f"inner_step.json {preset} on {data.get('device', '?')}"
    return None


def step_time_from_json(path: Path, preset: str | None, tokens_per_step: int, gpus: int) -> tuple[float, str]:
    """Seconds per inner step of a site of `gpus` GPUs, from one GPU's measured tokens/s (assumes the
    site scales linearly over its GPUs)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--step-json {path}: cannot read it as JSON ({e})") from None
    found = measured_tokens_s(data, preset)
    if found is None:
        raise ValueError(f"--step-json {path}: no zeroband row for model preset {preset!r}; give a gpu_suite.json "
                         "or inner_step.json that measured it, or --step-time SECONDS")
    tokens_s, where = found
    return tokens_per_step / (tokens_s * gpus), f"measured: {tokens_s:,.0f} tokens/s per GPU ({where}) x {gpus} GPUs"


def plan_from_config(path: str, args: argparse.Namespace) -> ConfigPlan:
    """The planner's input from a training config: model size, H, wire format, overlap and piece size
    from the file; the step time from --step-time, --step-json, or 6N + attention at TABLE_MFU."""
    from zeroband.config import DilocoConfig, load_config
    from zeroband.models.llama import flops_per_token, num_params

    cfg = load_config(path, [])
    notes = []
    d = cfg.diloco
    if d is None:
        d = DilocoConfig()
        notes.append(f"{path} has no [diloco] section: planned with DiLoCo's defaults (H={d.inner_steps}, {d.comm_dtype})")
    tokens = cfg.train.global_batch * cfg.data.seq_len
    gpus = args.gpus_per_site
    if args.step_time is not None:
        step, source = args.step_time, "given (--step-time)"
    elif args.step_json is not None:
        step, source = step_time_from_json(args.step_json, cfg.model.preset, tokens, gpus)
    else:
        flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens
        step = flops / (gpus * H100_PEAK_FLOPS * TABLE_MFU)
        source = f"assumed: (6N + attention) x tokens / ({gpus} GPUs x H100 989 TFLOP/s x {TABLE_MFU:.0%} MFU)"
    params = num_params(cfg.model)
    s = cfg.sites
    link = link_args(args)
    if link["streams"] is None and s.streams != "auto":  # the config's given streams; "auto": those the probe keeps
        link["streams"] = int(s.streams)
    plan = PlanInput(float(params), step, args.sites, args.gbps, args.latency_ms, d.inner_steps, d.comm_dtype,
                     d.overlap or args.overlap, not args.no_tcp_ramp, args.mtu, **link, piece_mb=d.piece_mb,
                     wait_factor=s.wait_factor, timeout_floor_s=s.timeout_floor_s, timeout_s=s.timeout_s,
                     density=d.density, fragments=d.fragments,
                     largest_fragment=largest_fragment(cfg.model, d.fragments) if d.fragments > 1 else 0.0)
    pieces = max(1, math.ceil(params * 4 / (d.piece_mb * 2**20)))
    return ConfigPlan(plan, cfg.model.preset or f"{params / 1e6:.0f}M", d.piece_mb, pieces, tokens, source, tuple(notes),
                      cfg.train.steps, cfg.checkpoint.interval)


def config_plan_text(path: str, cp: ConfigPlan) -> str:
    p = cp.plan
    size = f"{p.params / 1e9:.3g}B" if p.params >= 1e9 else f"{p.params / 1e6:.3g}M"
    head = [f"{path}: model {cp.model} ({size} params), H={p.inner_steps}, wire {p.dtype}, piece {cp.piece_mb:g} MB "
            f"({cp.pieces} piece{'s' if cp.pieces > 1 else ''} per all-reduce), {cp.tokens_per_step:,} tokens per step per site",
            f"  step time {p.step_time_s:.3g} s: {cp.step_source}", *(f"  note: {n}" for n in cp.notes)]
    pred = predict(p)
    return "\n".join([*head, prediction_text(p, pred), *h_lines(cp, pred)])


def h_lines(cp: ConfigPlan, pred: Prediction) -> list[str]:
    """The recommended H with its reason, and a warning when the config's own H keeps too few outer steps."""
    p = cp.plan
    h, why = recommend_h(cp.steps, p.step_time_s, pred.comm_s, overlap=p.overlap, period=cp.period)
    warning = h_warning(p.inner_steps, cp.steps)
    return [f"recommended H: {h} ({why})", *([warning] if warning else [])]


# ------------------------------------------------------------------------------- checked against benchmarks/wan.json


def wan_prediction(meta: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """This planner's prediction for one measured WAN row (scripts/bench_wan.py), from the row's own
    measured compute per step and the run's streams, window and TCP settings (before they were
    recorded: one stream, Linux's default window, the emulator's tcp_slow_start_after_idle = 0)."""
    p = PlanInput(m["shard_params"] * meta["nproc"], m["compute_s_per_step"], meta["sites"], m["rate_mbit"] / 1e3,
                  meta["delay_ms"], m["inner_steps"], m["dtype"], m["overlap"], restarts_slow_start(meta.get("tcp")),
                  meta["mtu"],
                  streams=meta.get("streams", 1), window_bytes=meta.get("window_bytes", DEFAULT_WINDOW),
                  fragments=m.get("fragments", 1))
    if m["mode"] == "data_parallel":
        step = predict_data_parallel(p)
        comm, util = step.comm_s * m["inner_steps"], step.utilisation
    else:
        pred = predict(p)
        comm = max(0.0, pred.comm_s - pred.compute_s) if m["overlap"] else pred.comm_s  # overlapped: the wait
        util = pred.utilisation
    return {"comm_s": comm, "utilisation": util}


def restarts_slow_start(tcp: dict[str, str] | None) -> bool:
    """Whether a row's senders restart slow start after idle: tcp_slow_start_after_idle = 1 and a
    loss-based congestion control (Linux skips the restart for BBR, which keeps its own model of the
    link). Not recorded: the emulator's setting, 0."""
    tcp = tcp or {}
    return (tcp.get("net.ipv4.tcp_slow_start_after_idle") == "1"
            and tcp.get("net.ipv4.tcp_congestion_control") != "bbr")


def tcp_text(tcp: dict[str, str] | None) -> str:
    """A row's TCP settings in words."""
    if not tcp:
        return "not recorded (the emulator's tcp_slow_start_after_idle = 0)"
    return ", ".join(f"{k.rsplit('.', 1)[-1]} = {v}" for k, v in tcp.items())


def link_run_prediction(r: dict[str, Any], window_bytes: int) -> float:
    """Predicted seconds of one all-reduce of a --streams row (bench_wan.py): fp16, 2 sites, the
    streams the run used, after the row's idle seconds."""
    p = PlanInput(float(r["numel"]), r.get("idle_s", 0.0), 2, r["rate_mbit"] / 1e3, r["rtt_ms"] / 2, 1, "fp16",
                  tcp_ramp=restarts_slow_start(r.get("tcp")), mtu=r.get("mtu", 9000), streams=r["streams_used"],
                  window_bytes=window_bytes)
    return predict(p).comm_s


def link_run_table(data: dict[str, Any]) -> list[str]:
    """Prediction vs the measured all-reduce-alone rows (wan.json's "streams"), with the mean error."""
    runs = [r for r in data.get("streams", []) if "tcp" in r]  # rows measured since the settings are recorded
    if not runs:
        return []
    window = data["meta"].get("window_bytes", DEFAULT_WINDOW)
    rows, errs = [], []
    for r in runs:
        pred = link_run_prediction(r, window)
        errs.append(abs(pred - r["seconds"]) / r["seconds"])
        rows.append([f"{r['rate_mbit']:g}", f"{r['rtt_ms']:g}", f"{r['payload_bytes'] / 1e6:.1f}", r["streams_used"],
                     f"{r.get('idle_s', 0.0):g}", ", ".join(r["tcp"].values()), f"{r['seconds']:.3f}", f"{pred:.3f}",
                     f"{100 * (pred - r['seconds']) / r['seconds']:+.1f}%"])
    headers = ["rate Mbit/s", "RTT ms", "payload MB", "streams used", "idle s before", "TCP", "seconds measured",
               "seconds predicted", "error"]
    return ["", "## The outer all-reduce alone", "", "The `--streams` rows of the same file (scripts/wan/link_allreduce.py: "
            "`reduce_across_sites` of an fp16 pseudo-gradient between 2 sites, the faster site's seconds per round). "
            "Predicted: `predict` with the row's rate, RTT, payload, streams used, idle seconds before the round and "
            "TCP settings (slow start restarts only with tcp_slow_start_after_idle = 1 and a loss-based congestion "
            "control).", "", markdown(headers, rows), "",
            f"Error over the {len(runs)} rows: mean |error| {100 * sum(errs) / len(errs):.1f}% "
            f"(max {100 * max(errs):.1f}%)."]


def _rel(pred: float, measured: float) -> float | None:
    """Relative error; None where the measured wait is under 50 ms (overlapped rows: both ~0)."""
    return (pred - measured) / measured if measured > 0.05 else None


def wan_table(data: dict[str, Any], source: str) -> str:
    """Prediction vs every measured WAN row, with the relative errors and their summary."""
    meta, rows, comm_errs, util_errs = data["meta"], [], [], []
    for m in data["results"]:
        pred = wan_prediction(meta, m)
        ce = _rel(pred["comm_s"], m["allreduce_s_last_arrival"])
        ue = (pred["utilisation"] - m["utilisation_steady_last_arrival"]) / m["utilisation_steady_last_arrival"]
        comm_errs += [abs(ce)] if ce is not None else []
        util_errs.append(abs(ue))
        rows.append([m["row"], f"{m['rate_mbit']:g}", m["inner_steps"], f"{m['allreduce_s_last_arrival']:.3f}",
                     f"{pred['comm_s']:.3f}", "n/a (both ~0)" if ce is None else f"{100 * ce:+.1f}%",
                     f"{100 * m['utilisation_steady_last_arrival']:.1f}%", f"{100 * pred['utilisation']:.1f}%",
                     f"{100 * ue:+.1f}%"])
    headers = ["row", "Mbit/s", "H", "comm s measured (last arrival)", "comm s predicted", "error",
               "util measured (steady, last arrival)", "util predicted", "error"]
    summary = (f"Error over the {len(data['results'])} measured rows: communication time mean |error| "
               f"{100 * sum(comm_errs) / len(comm_errs):.1f}% (max {100 * max(comm_errs):.1f}%, {len(comm_errs)} rows "
               f"with a measurable wait), utilisation mean |error| {100 * sum(util_errs) / len(util_errs):.1f}% "
               f"(max {100 * max(util_errs):.1f}%).")
    return "\n".join([
        "# zeroband plan vs the measured WAN rows", "", f"Measured: `{source}` ({meta['preset']} preset, "
        f"{meta['params']:,} params, {meta['sites']} sites x {meta['nproc']} rank, {meta['delay_ms']:g} ms one-way, "
        f"MTU {meta['mtu']}, emulated link `{meta['backend']}`, TCP {tcp_text(meta.get('tcp'))}). Predicted: "
        "`zeroband.tools.plan.predict` with each row's measured compute per step, rate, delay, MTU and TCP settings. "
        "Overlapped rows compare the predicted wait, max(0, T_comm - H x step), with the measured wait.", "",
        markdown(headers, rows), "", summary, *link_run_table(data), "",
        "Regenerate: `zeroband plan --vs-wan benchmarks/wan.json --write docs/results/plan_vs_wan.md`."])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None,
                   help="a training config (.toml): model size, H, wire format, piece size and overlap from it")
    p.add_argument("--table", action="store_true", help="print the 150M..100B x bandwidth x H x dtype table")
    p.add_argument("--step-json", type=Path, default=None,
                   help="with a config: the inner step time from a benchmark JSON (gpu_suite.json, inner_step.json)")
    p.add_argument("--gpus-per-site", type=int, default=8, help="with a config: GPUs per site (default 8)")
    p.add_argument("--vs-wan", type=Path, default=None, metavar="WAN_JSON",
                   help="compare predictions with every measured row of benchmarks/wan.json")
    p.add_argument("--write", type=Path, default=None, help="with --vs-wan: also write the table to this file")
    p.add_argument("--params", type=float, default=None, help="model parameters, e.g. 1e9")
    p.add_argument("--preset", default=None, help="or a model preset (debug, demo, 150M, 1B, 7B, 10B)")
    p.add_argument("--step-time", type=float, default=None, help="inner step compute seconds (default 1.0)")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--gbps", type=float, default=1.0, help="per-site WAN bandwidth, Gbit/s")
    p.add_argument("--latency-ms", type=float, default=50.0, help="one-way latency between sites")
    p.add_argument("--inner-steps", type=int, default=500, help="H")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--density", type=float, default=_DILOCO["density"].default,
                   help="diloco.density: the fraction of values the sparse codec sends")
    p.add_argument("--overlap", action="store_true", help="overlapped outer step")
    p.add_argument("--no-tcp-ramp", action="store_true",
                   help="leave TCP slow start out of the model: the sites set net.ipv4.tcp_slow_start_after_idle=0 or "
                        "run BBR (default: Linux's defaults, cubic with slow start after every idle)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--streams", type=int, default=None,
                   help="TCP streams per peer (default: enough to cover the bandwidth-delay product, at most 16)")
    p.add_argument("--window-mb", type=float, default=None,
                   help="bytes one stream keeps in flight, MB (default: 2/3 of this machine's tcp_wmem max)")
