"""Summaries of finished runs, read back from their metrics.jsonl files: a table and a loss plot,
and (`python -m zeroband.tools.report data RUN_DIR`) what the data ledger's records prove, per
epoch of the corpus."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zeroband.data.ledger import audit


def read_metrics(path: Path) -> list[dict[str, Any]]:
    from zeroband.records import decode_record

    with open(path) as f:
        return [decode_record(line) for line in f if line.strip()]


def summarise_site(records: list[dict[str, Any]]) -> dict[str, Any]:
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    outer = [r for r in records if r["kind"] == "outer"]
    out: dict[str, Any] = {"steps": train[-1]["step"] if train else 0}
    if train:
        out.update(final_loss=train[-1]["loss"], tokens=train[-1]["tokens"], tokens_per_s=train[-1]["tokens_per_s"],
                   compute_utilisation=train[-1]["compute_utilisation"], peak_mem_mb=train[-1]["peak_mem_mb"])
    if val:
        out.update(val_loss=val[-1]["val_loss"], val_ppl=val[-1]["val_ppl"], val_bpb=val[-1]["val_bpb"])
    if outer:
        out.update(
            outer_steps=len(outer),
            payload_bytes_per_outer_step=outer[-1]["payload_bytes"],
            wire_bytes_per_outer_step=outer[-1]["wire_bytes"],
            allreduce_s_mean=sum(r["allreduce_s"] for r in outer) / len(outer),
        )
    return out


def loss_table(series: dict[str, list[dict[str, Any]]], every: int = 1) -> str:
    """Train and val loss of every site (columns) by step (rows): every `every`-th logged step, and
    always the last one, every outer step (marked "outer") and every validation."""
    train = {name: {r["step"]: r["loss"] for r in recs if r["kind"] == "train"} for name, recs in series.items()}
    val = {name: {r["step"]: r["val_loss"] for r in recs if r["kind"] == "val"} for name, recs in series.items()}
    outer = {r["step"] for recs in series.values() for r in recs if r["kind"] == "outer"}
    logged = sorted(set().union(*train.values()))
    shown = {s for i, s in enumerate(logged) if i % every == 0} | set(logged[-1:]) | outer
    shown |= set().union(*val.values())
    names = list(series)
    rows = ["| step | | " + " | ".join(f"{n} train | {n} val" for n in names) + " |",
            "|---:|---|" + "---:|---:|" * len(names)]
    for step in sorted(shown):
        cells = [f"{train[n][step]:.3f}" if step in train[n] else "" for n in names]
        vals = [f"{val[n][step]:.3f}" if step in val[n] else "" for n in names]
        mark = "outer" if step in outer else ""
        rows.append(f"| {step} | {mark} | " + " | ".join(f"{t} | {v}" for t, v in zip(cells, vals)) + " |")
    return "\n".join(rows)


def plot_losses(series: dict[str, list[dict[str, Any]]], out: Path) -> Path | None:
    """One line per run/site: train loss and val loss against step, outer steps as faint vertical
    lines. Sites share a model after each outer step, so their val points coincide: each site has
    its own marker size and line style, the first drawn largest, so none hides another. None if
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    outer = sorted({r["step"] for records in series.values() for r in records if r["kind"] == "outer"})
    for i, step in enumerate(outer):
        ax.axvline(step, color="grey", alpha=0.25, linewidth=0.8, label="outer step" if i == 0 else None)
    styles = ["--", ":", "-.", (0, (1, 3))]
    for k, (name, records) in enumerate(series.items()):
        train = [r for r in records if r["kind"] == "train"]
        val = [r for r in records if r["kind"] == "val"]
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{name} train", alpha=0.7)
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], linestyle=styles[k % len(styles)],
                    marker="o", markersize=max(3, 9 - 3 * k), markerfacecolor="none" if k else None,
                    label=f"{name} val")
    ax.set_xlabel("inner step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_report(run_dir: Path, ckpt_dir: Path, name: str, wall_s: float) -> str:
    """The lines a run ends with: what it reached, where its files are, and its loss plot."""
    records = read_metrics(run_dir / "metrics.jsonl")
    s = summarise_site(records)
    plot = plot_losses({name: records}, run_dir / "loss.png")
    lines = [f"run {name}: {s['steps']} steps, {s.get('tokens', 0):,} tokens in {wall_s:.0f} s"]
    if "final_loss" in s:
        lines.append(f"  final train loss {s['final_loss']:.4f}")
    if "val_loss" in s:
        lines.append(f"  val loss {s['val_loss']:.4f}, ppl {s['val_ppl']:.2f}, bpb {s['val_bpb']:.3f}")
    lines += [f"  checkpoints: {ckpt_dir}/", f"  metrics: {run_dir / 'metrics.jsonl'}",
              f"  loss plot: {plot}" if plot else "  loss plot: skipped (matplotlib is not installed: pip install matplotlib)"]
    return "\n".join(lines)


# ------------------------------------------------------------------ the data ledger (elastic runs)
def ledger_records(metrics_paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every data ledger record (zeroband/data/ledger.py) of every site's metrics, restarts included."""
    return [r for path in metrics_paths for r in read_metrics(path) if r["kind"] == "data"]


def data_audit(metrics_paths: Iterable[Path]) -> dict[str, Any]:
    """`ledger.audit` of a run's records from every site: the run's one line of commits through its
    restarts, per epoch of the corpus."""
    return audit(ledger_records(metrics_paths))


def data_line(d: dict[str, Any]) -> str:
    if not d.get("rounds"):
        return "-"
    return (f"{d['committed_once']} / {d['committed']} (twice {len(d['twice'])}, lost {len(d['lost'])}, "
            f"token chains broken {len(d['broken_chains'])}; rounds {d['first_round']}-{d['last_round']}, unlogged "
            f"{d['missing']}, ledgers differing {d['differing']}, undone by a relaunch {len(d['superseded'])})")


def epoch_lines(d: dict[str, Any]) -> list[str]:
    """The per-epoch table and the lease sizes over the rounds, as `report data` prints them."""
    lines = ["| epoch | documents | read once | twice | never | held (read next) | not dealt yet |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {e['epoch']} | {e['documents']} | {e['once']} | {e['twice']} | {e['never']} | {e['held']} | "
              f"{e['not_dealt']} |" for e in d["epochs"]]
    sizes = d["lease_max"]
    every = max(1, len(sizes) // 20)
    lines.append(f"lease per rank (documents; bound: the round's want, at most {d['want_max']}), by round from "
                 f"{d['first_round']}, every {every}: {sizes[::every]}; off the bound in rounds {d['leases_off_bound']}")
    return lines


def data_clean(d: dict[str, Any]) -> bool:
    """No document read twice or lost, no epoch left unread behind a later one, no chain broken, the
    sites' ledgers equal, every round logged, every lease within its bound."""
    keys = ("twice", "lost", "broken_chains", "held_twice", "committed_and_held", "differing", "missing",
            "leases_off_bound")
    return bool(d.get("rounds")) and not any(d.get(k) for k in keys) and not any(
        e["never"] or e["twice"] for e in d["epochs"])


def main(argv: list[str]) -> int:
    """`python -m zeroband.tools.report data RUN_DIR`: which documents an elastic run trained on."""
    if len(argv) != 2 or argv[0] != "data" or not Path(argv[1]).is_dir():
        print("usage: python -m zeroband.tools.report data RUN_DIR (output_dir/name of an elastic run)", file=sys.stderr)
        return 2
    paths = sorted(Path(argv[1]).glob("site*/metrics.jsonl"))
    d = data_audit(paths)
    print(f"data ledger of {len(paths)} sites: documents committed exactly once / committed: {data_line(d)}")
    if d.get("rounds"):
        print(f"dealt {d['dealt']} documents of the order ({len(d['epochs'])} epochs); still leased or given back: "
              f"{d['held']}")
        print("\n".join(epoch_lines(d)))
    return 0 if data_clean(d) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
