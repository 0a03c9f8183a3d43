"""Aggregate the experiment's runs into a markdown table and two plots (log-x)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

ROW_ORDER = ("baseline", "baseline_kx_tokens", "data_parallel")


def group_rows(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        rows.setdefault(r["row"], []).append(r)
    first = [k for k in ROW_ORDER if k in rows]
    rest = [k for k in rows if k not in ROW_ORDER and not k.startswith("tune")]
    tune = [k for k in rows if k.startswith("tune")]
    return {k: rows[k] for k in first + rest + tune}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}" if n else "0"


def summary(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ppl, ppl_sd = mean_std([r["val_ppl"] for r in runs])
    loss, loss_sd = mean_std([r["val_loss"] for r in runs])
    bpb, bpb_sd = mean_std([r["val_bpb"] for r in runs])
    r0 = runs[0]
    return {"row": name, "n": len(runs), "ppl": ppl, "ppl_sd": ppl_sd, "loss": loss, "loss_sd": loss_sd,
            "bpb": bpb, "bpb_sd": bpb_sd, "payload": r0["payload_bytes"], "wire": r0["wire_bytes"],
            "wall": statistics.fmean(r["wall_s"] for r in runs), "tokens": r0["tokens"], "sites": r0["sites"],
            "steps": r0["steps"], "h": r0["h"], "comm": r0["comm"], "procs": r0.get("concurrent_processes", 1),
            "outer_lr": r0["outer_lr"] if r0["method"] == "diloco" else None,
            "ppl_by_seed": {r["seed"]: r["val_ppl"] for r in runs}}


def table(summaries: list[dict[str, Any]]) -> str:
    head = ("| row | seeds | sites | steps/site | tokens | val ppl (mean ± std) | val loss | bits/byte | "
            "payload MiB/site | wire MiB/site | wall s (procs) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(
            f"| {s['row']} | {s['n']} | {s['sites']} | {s['steps']} | {s['tokens']:,} | {s['ppl']:.2f} ± {s['ppl_sd']:.2f} "
            f"| {s['loss']:.4f} ± {s['loss_sd']:.4f} | {s['bpb']:.4f} ± {s['bpb_sd']:.4f} | {mib(s['payload'])} "
            f"| {mib(s['wire'])} | {s['wall']:.0f} ({s['procs']}) |")
    return "\n".join(lines)


def mean_curve(runs: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    n = min(len(r["curve"]) for r in runs)
    xs = [statistics.fmean(r["curve"][i][key] for r in runs) for i in range(n)]
    ys = [statistics.fmean(r["curve"][i]["val_loss"] for r in runs) for i in range(n)]
    return xs, ys


def plot(rows: dict[str, list[dict[str, Any]]], key: str, xlabel: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, runs in rows.items():
        if name.startswith("tune"):
            continue
        xs, ys = mean_curve(runs, key)
        style = "--" if runs[0]["method"] == "single" else "-"
        if key != "tokens" and runs[0]["method"] == "single":
            ax.axhline(ys[-1], linestyle=":", color="grey", label=f"{name} (no communication), final")
            continue
        pts = [(x, y) for x, y in zip(xs, ys) if x > 0]
        if pts:
            ax.plot(*zip(*pts), style, marker="o", markersize=3, label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/token), mean over seeds")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def ratio_lines(by_name: dict[str, dict[str, Any]]) -> list[str]:
    dp = by_name.get("data_parallel")
    if not dp:
        return []
    out = []
    for name, s in by_name.items():
        if name.startswith("diloco") and s["wire"]:
            out.append(f"- {name}: DP / DiLoCo wire bytes = {dp['wire'] / s['wire']:,.0f}x "
                       f"(payload {dp['payload'] / s['payload']:,.0f}x)")
    return out


def write_report(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    rows = group_rows(runs)
    summaries = [summary(k, v) for k, v in rows.items()]
    plot(rows, "tokens", "tokens seen (all sites)", out / "val_loss_vs_tokens.png")
    plot(rows, "wire_bytes", "bytes sent per site (wire estimate, cumulative)", out / "val_loss_vs_bytes.png")
    from exp_text import narrative

    text = narrative(meta, {s["row"]: s for s in summaries}, table(summaries), ratio_lines({s["row"]: s for s in summaries}))
    (out / "diloco_vs_dp.md").write_text(text)
    print(table(summaries), flush=True)
