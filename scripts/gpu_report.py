"""scripts/gpu_suite.py's report: <out>/gpu_suite.{json,md} from the cache, every invocation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import markdown_table
from gpu_suite import Row, conv_losses, gap_closed, mean_std, tuned_dp


def current(plan: list[tuple[str, Row]], cache: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Row name -> cached entry, for the rows of this plan (this code version) only."""
    return {row.name: cache["rows"][key] for key, row in plan if key in cache["rows"]}


def speed_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for name, e in results.items():
        if e["kind"] != "speed":
            continue
        r = e["result"]
        how = (f"vocab {r.get('vocab', '4096')}, micro {r.get('micro_batch', '-')} x {r.get('accumulation', 1)}, "
               f"AC {'on' if r.get('activation_checkpointing') else 'off'}")
        for loop, m in r["loops"].items():
            rows.append([name, loop, how, f"{r['params'] / 1e6:.3g}M", r["seq"], r["tokens_per_step"], m["tokens_s"],
                         m["step_s"], f"{100 * m['mfu']:.1f}%", m["peak_gb"], f"{r['ratio']:.3f}x" if loop == "zeroband" else ""])
    if not rows:
        return ["(no speed row measured yet)"]
    return [markdown_table(["row", "loop", "shape", "params", "seq", "tokens/step", "tokens/s", "step s", "MFU",
                            "peak GB", "zeroband / plain"], rows)]


def outer_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    e = results.get("outer/1B")
    if e is None:
        return ["(not measured yet)"]
    r = e["result"]
    return [markdown_table(["params", "wire", "piece MB", "outer device", "threads", "outer step s", "local work s",
                            "fused pass s", "local / pass", "all-reduce Gbit/s", "kernels"],
                           [[f"{r['params'] / 1e9:.3f}B", r["comm_dtype"], r["piece_mb"], r["outer_device"], r["threads"],
                             r["outer_step_s"], r["local_s"], r["fused_pass_s"], r["local_over_pass"],
                             r["allreduce_gbit_s"], r["kernels"]]]),
            "", "2 sites x 1 rank sharing the GPU over authenticated gloo; site 0's medians. One site's share: a "
                "1-rank site does all of it; in a W-rank site each rank does 1/W of the local work on its shard."]


def conv_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    groups = conv_losses(results)
    if not groups:
        return ["(no convergence row measured yet)"]
    single, dp = groups.get("conv/single"), tuned_dp(groups)
    base = (mean_std(single)[0], mean_std(dp[1])[0]) if single and dp else None
    rows = []
    for g, losses in sorted(groups.items()):
        entries = [e for n, e in results.items() if n.rsplit("/seed", 1)[0] == g]
        m, sd = mean_std(losses)
        r0 = entries[0]["result"]
        gap = f"{100 * gap_closed(m, *base):.0f}%" if base else "-"
        rows.append([g.removeprefix("conv/"), len(losses), f"{m:.4f} ± {sd:.4f}", gap, r0["outer_steps"] or "-",
                     f"{r0['epochs']:.2f}", f"{sum(e['wall_s'] for e in entries) / len(entries):.0f}"])
    lines = [markdown_table(["row", "seeds", "val loss (mean ± std)", "gap closed", "outer steps", "epochs",
                             "wall s per run"], rows), ""]
    lines.append(f"Tuned data parallel: {dp[0].removeprefix('conv/')} (lowest mean over the lrs tried)." if dp else "")
    return lines + epoch_ranking(results)


def epoch_ranking(results: dict[str, dict[str, Any]]) -> list[str]:
    """Where a row trained past 2 epochs: the rows ranked by their loss at the last evaluation within
    1 epoch, beside their final ranking (does the order hold without repeated data?)."""
    conv = {n: e["result"] for n, e in results.items() if n.startswith("conv/")}
    if not conv or max(r["epochs"] for r in conv.values()) <= 2:
        return ["Every row trained at most 2 epochs." if conv else ""]
    early = {n: [p for p in r["curve"] if p["epochs"] <= 1.0] for n, r in conv.items()}
    ranked = sorted((n for n in conv if early[n]), key=lambda n: early[n][-1]["val_loss"])
    final = sorted(conv, key=lambda n: conv[n]["val_loss"])
    return ["Some rows trained past 2 epochs. Ranking at <= 1 epoch: " + ", ".join(ranked),
            "Final ranking: " + ", ".join(final)]


def write_report(out: Path, plan: list[tuple[str, Row]], cache: dict[str, Any], ctx: dict[str, Any],
                 checks: Callable[..., list[dict[str, str]]], checks_hash: str, mfu: str) -> None:
    results = current(plan, cache)
    hs = ctx["scale"]["conv_hs"]
    verdicts = checks(results, hs)
    left = [row.name for key, row in plan if key not in cache["rows"]]
    envs = {json.dumps(e["env"], sort_keys=True) for e in results.values()}
    failures = {f["row"]: f["error"] for f in cache["failures"].values()}
    s = ctx["scale"]
    md = [f"# GPU evidence suite: {ctx['gpu']}", "",
          f"Dense bf16 peak used for MFU: {ctx['peak_tflops']:g} TFLOP/s. {mfu}.", "",
          "Environment of the rows (GPU, torch, CUDA, transformers, commit): "
          + "; ".join(sorted(envs)) if envs else "No row measured yet.", "",
          f"`python scripts/gpu_suite.py{' --quick' if ctx['quick'] else ''}`: {len(results)} of {len(plan)} rows "
          f"measured" + (f"; missing: {', '.join(left)}" if left else "") + ".", "",
          "## Inner step: zeroband vs the fair plain loop", "",
          "Plain loop: transformers LlamaForCausalLM, sdpa attention on the causal path (no mask is built; the run "
          "checks that none reaches attention), use_cache=False, bf16 autocast, fused AdamW, torch.compile of the "
          "model, the same shapes, batch, optimizer settings and gradient clipping. Bench rows: random tokens at "
          "vocab 4096, one micro-batch. Shipped rows: the config's vocab, activation checkpointing, micro-batch and "
          "accumulation, with zeroband's data loader on real text in both loops.", "", *speed_lines(results), "",
          "## Outer step of configs/1B.toml's model", "", *outer_lines(results), "",
          f"## Convergence at GPU scale: k = {s['conv_sites']} sites in one process (zeroband.sim)", "",
          f"Model {s['conv_model']}, vocab {s['conv_vocab']}, seq {s['conv_seq']}, {s['conv_batch']} sequences per "
          f"site per step, T = {s['conv_steps']} steps, inner AdamW lr {s['conv_lr']:g} (cosine, warm-up "
          f"{s['conv_warmup']}), {'bf16' if s['bf16'] else 'fp32'}. single: one site, T steps. dp_lrX: data "
          f"parallel at equal tokens (one site at {s['conv_sites']} x the batch, the same update as averaging "
          f"gradients every step), lr X. DiLoCo rows at H = {', '.join(map(str, hs))}: shipped defaults, paper "
          "(0.7 / 0.9 Nesterov), plain averaging (1.0 / 0). Gap closed = (one site - row) / (one site - tuned "
          "DP), on mean validation loss. Epochs = tokens x bytes/token / train-split bytes.", "",
          *conv_lines(results), "",
          f"## Checks (fixed in scripts/gpu_suite.py `checks()`, source hash {checks_hash})", "",
          markdown_table(["check", "measured", "status"], [[c["check"], c["measured"], c["status"]] for c in verdicts])]
    if failures:
        md += ["", "## Failed rows (retried by the next invocation)", "",
               *[f"- {name}: {err}" for name, err in sorted(failures.items())]]
    data = {"gpu": ctx["gpu"], "peak_tflops": ctx["peak_tflops"], "mfu_definition": mfu, "commit": ctx["commit"],
            "checks_source_hash": checks_hash, "checks": verdicts, "rows": results, "missing": left,
            "failures": failures, "scale": s}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    (out / "gpu_suite.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/gpu_suite.py --help\n(scripts/gpu_report.py is gpu_suite.py's report; it does nothing on its own)")
