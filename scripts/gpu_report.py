"""scripts/gpu_suite.py's report: <out>/gpu_suite.{json,md} from the rows known, after every call."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import markdown_table
from gpu_suite import Results, Row, by_seed, gap_closed, mean_std, paired


def current(rows: dict[str, tuple[str, Row]], res: Results) -> dict[str, dict[str, Any]]:
    """Row name -> its result entry, for the rows of this plan (this code version, this GPU) only."""
    return {name: res.done[key] for name, (key, _) in rows.items() if key in res.done}


def speed_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for name, e in results.items():
        if e["kind"] != "speed":
            continue
        r = e["result"]
        how = (f"vocab {r.get('vocab', '4096')}, micro {r.get('micro_batch', '-')} x {r.get('accumulation', 1)}, "
               f"AC {'on' if r.get('activation_checkpointing') else 'off'}")
        for loop, m in r["loops"].items():
            attn = ", ".join(f"{op} {ms:.1f} ms" for op, ms in m.get("attention", {}).items()) or "-"
            rows.append([name, loop, how, f"{r['params'] / 1e6:.3g}M", r["seq"], r["tokens_per_step"], m["tokens_s"],
                         m["step_s"], f"{100 * m['mfu']:.1f}%", m["peak_gb"], attn,
                         f"{r['ratio']:.3f}x" if loop == "zeroband" else ""])
    if not rows:
        return ["(no speed row measured yet)"]
    return [markdown_table(["row", "loop", "shape", "params", "seq", "tokens/step", "tokens/s", "step s", "MFU",
                            "peak GB", "attention ops (3 profiled steps)", "zeroband / plain"], rows)]


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
            "", "2 sites x 1 rank sharing the GPU over authenticated gloo; site 0's medians."]


def conv_lines(results: dict[str, dict[str, Any]], group: str, settings: list[str]) -> list[str]:
    single, dp, d = (by_seed(results, group, s) for s in ("single", "dp", "defaults"))
    base = (mean_std(list(single.values()))[0], mean_std(list(dp.values()))[0]) if single and dp else None
    rows = []
    for setting in ["single", "dp", "defaults", *settings]:
        losses = by_seed(results, group, setting)
        if not losses:
            continue
        entries = [results[f"conv/{group}/{setting}/seed{s}"] for s in sorted(losses)]
        m, sd = mean_std(list(losses.values()))
        diffs = paired(d, losses) if setting != "defaults" else []
        r0 = entries[0]["result"]
        rows.append([setting, len(losses), f"{m:.4f} ± {sd:.4f}", f"{100 * gap_closed(m, *base):.0f}%" if base else "-",
                     f"{mean_std(diffs)[0]:+.4f} ({len(diffs)})" if diffs else "-", r0["outer_steps"] or "-",
                     f"{r0['epochs']:.2f}", f"{sum(e['wall_s'] for e in entries) / len(entries):.0f}"])
    if not rows:
        return ["(no row measured yet)"]
    return [markdown_table(["row", "seeds", "val loss (mean ± std)", "gap closed", "defaults minus row (paired seeds)",
                            "outer steps", "epochs", "wall s per run"], rows)]


def write_report(out: Path, rows: dict[str, tuple[str, Row]], res: Results, ctx: dict[str, Any],
                 checks: Callable[[dict[str, dict[str, Any]]], list[dict[str, str]]], checks_hash: str, mfu: str) -> None:
    results = current(rows, res)
    verdicts = checks(results)
    left = [name for name, (key, _) in rows.items() if key not in res.done]
    envs = {json.dumps(e["env"], sort_keys=True) for e in results.values()}
    mine = {key for key, _ in rows.values()}
    problems = {f["name"]: f"{f['status']}: {f['error']}" for fs in res.failures.values() for f in fs if f["key"] in mine
                and f["key"] not in res.done}
    s = ctx["scale"]
    settings = sorted({n.split("/")[2] for n in rows if n.startswith("conv/")} - {"single", "dp", "defaults"})
    md = [f"# GPU evidence suite: {ctx['gpu']}", "",
          f"Dense bf16 peak used for MFU: {ctx['peak_tflops']:g} TFLOP/s. {mfu}.", "",
          ("Environment of the rows (GPU, torch, CUDA, transformers, commit): " + "; ".join(sorted(envs)))
          if envs else "No row measured yet.", "",
          f"{len(results)} of {len(rows)} rows measured" + (f"; missing: {', '.join(left)}" if left else "") + ".", "",
          "## Inner step: zeroband vs the fair plain loop", "",
          "Plain loop: transformers LlamaForCausalLM, sdpa attention on the causal path (no mask is built; the run "
          "checks that none reaches attention), use_cache=False, bf16 autocast, fused AdamW, torch.compile of the "
          "model, the same shapes, batch, optimizer settings and gradient clipping; both loops' attention ops are "
          "read from a 3-step profile. Bench rows: random tokens at vocab 4096, one micro-batch. Shipped rows: the "
          "config's vocab, activation checkpointing, micro-batch and accumulation, with zeroband's data loader on "
          "real text in both loops.", "", *speed_lines(results), "",
          "## Outer step of configs/1B.toml's model", "", *outer_lines(results), "",
          f"## Convergence at GPU scale: k = {s['conv_sites']} sites, each its own process sharing the GPU", "",
          f"Model {s['conv_model']}, vocab {s['conv_vocab']}, seq {s['conv_seq']}, inner AdamW lr {s['conv_lr']:g} for "
          f"every row (fixed before the runs: no row's lr is swept), cosine after a T/50 warm-up, "
          f"{'bf16' if s['bf16'] else 'fp32'}, the production trainer (`zeroband.train.train`). single: one site, "
          f"T steps of B sequences. dp: data parallel at equal tokens (one site at {s['conv_sites']} x B, the same "
          "update as averaging gradients every step). Outer settings as in scripts/experiments/large_h.py. Gap "
          "closed = (one site - row) / (one site - dp), on mean validation loss. Seeds are paired: seed s sets the "
          "same initial weights and data order in every row.", ""]
    for g in s["conv_groups"]:
        md += [f"### {g['name']}: H = {g['h']}, T = {g['steps']}, B = {g['batch']}, "
               f"{g['steps'] // g['h']} outer steps", "", *conv_lines(results, g["name"], settings), ""]
    md += [f"## Checks (fixed in scripts/gpu_suite.py `checks()`, source hash {checks_hash})", "",
           markdown_table(["check", "measured", "status"], [[c["check"], c["measured"], c["status"]] for c in verdicts])]
    if problems:
        md += ["", "## Rows failed or stopped (retried by the next call)", "",
               *[f"- {name}: {err}" for name, err in sorted(problems.items())]]
    data = {"gpu": ctx["gpu"], "peak_tflops": ctx["peak_tflops"], "mfu_definition": mfu, "commit": ctx["commit"],
            "checks_source_hash": checks_hash, "checks": verdicts, "rows": results, "missing": left,
            "problems": problems, "scale": s}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    (out / "gpu_suite.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":  # a module the scripts import, not a command: say which command to run
    print("usage: python scripts/gpu_suite.py --help\n(scripts/gpu_report.py is gpu_suite.py's report; it does nothing on its own)")
