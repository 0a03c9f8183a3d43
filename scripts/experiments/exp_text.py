"""The markdown around the table: command, setup, hyperparameters, and the acceptance checks, from the data."""

from __future__ import annotations

from typing import Any


def pct(a: float, b: float) -> float:
    return 100.0 * (a - b) / b


def paired(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Per-seed relative ppl differences of row a against row b."""
    seeds = sorted(set(a["ppl_by_seed"]) & set(b["ppl_by_seed"]))
    diffs = [pct(a["ppl_by_seed"][s], b["ppl_by_seed"][s]) for s in seeds]
    return ", ".join(f"seed {s}: {d:+.3f}%" for s, d in zip(seeds, diffs)) or "no common seeds"


def setup_lines(meta: dict[str, Any]) -> list[str]:
    s, base = meta["scale"], meta["base_config"]
    m, o = base["model"], base["optim"]
    return [
        "## Setup",
        "",
        f"- Corpus: `{meta['corpus']}`; validation = the loader's whole-document hash split (`data.val_fraction = "
        f"{base['data']['val_fraction']}`), the same documents for every row; {s['eval_batches']} eval batches of "
        f"{s['batch']} x {s['seq_len']} tokens ({s['eval_batches'] * s['batch'] * s['seq_len']:,} tokens), every "
        f"{s['eval_interval']} steps and at the end, on site 0 (after an outer step all sites hold the same model; a curve point of a DiLoCo row whose step is not a "
        "multiple of its H is site 0's local model between outer steps; the final point always follows an outer step).",
        f"- Tokenizer: byte-level BPE, vocab {s['vocab']}, trained on the train split only (`{meta['tokenizer']}`).",
        f"- Model: Llama dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads ({m['n_kv_heads']} kv), "
        f"ffn {m['ffn_dim']}, vocab {m['vocab_size']}, seq_len {s['seq_len']}.",
        f"- Batch B = {s['batch']} sequences per site per step, T = {s['steps']} inner steps per site, k = {s['sites']} "
        "sites, 1 rank per site, fp32 compute, OMP_NUM_THREADS=1 per process.",
        "- Data: documents shuffled by `data.shuffle_seed = 1000 + seed`, document j to reader j mod k (disjoint per "
        "site); `train.seed = seed` sets the initial weights.",
        "",
        "## Hyperparameters and how they were chosen",
        "",
        f"- Inner AdamW (all rows): lr {o['lr']}, betas (0.9, 0.95), weight decay {o['weight_decay']}, grad clip "
        f"{o['grad_clip']}, warmup {o['warmup_steps']} steps then cosine to {o['min_lr_ratio']} x lr over T. Taken "
        "from the project's demo config (chosen there for this model width, at 2,048 tokens per step; here a site's "
        f"step is {s['batch'] * s['seq_len']:,} tokens); not re-tuned, the same for every row; warmup ~6% of T. Data parallel uses "
        "the same lr at k x the batch (as in the DiLoCo paper); a larger lr might help it, so DP is if anything "
        "slightly under-tuned here.",
        f"- Outer optimizer: SGD Nesterov, momentum 0.9, lr {meta['outer_lr']}: chosen by the lowest final validation "
        f"loss among outer lr {{0.5, 0.7, 1.0}} on a half-length run (T = {s['tune_steps']}, H = {s['h_main']}, "
        "fp32, seed 100, same k); the tuning runs are the `tune_outer_lr_*` rows at the bottom. They use the same "
        "validation documents as the table (there is no separate test split at this scale).",
        f"- H: {s['h_main']} (main) and {s['h_alt']}: with T = {s['steps']} that is {s['steps'] // s['h_main']} and "
        f"{s['steps'] // s['h_alt']} outer steps. int8/int4 rows use error feedback.",
        "",
    ]


def acceptance_lines(rows: dict[str, dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    h = meta["scale"]["h_main"]
    base, dp = rows.get("baseline"), rows.get("data_parallel")
    f32, f16 = rows.get(f"diloco_H{h}_fp32"), rows.get(f"diloco_H{h}_fp16")
    out = ["## Acceptance checks (computed from the table above)", ""]
    if not (base and dp and f32):
        return out + ["- rows missing: no verdict", ""]
    beats = f32["ppl"] < base["ppl"]
    gap = base["ppl"] - dp["ppl"]
    closed = (base["ppl"] - f32["ppl"]) / gap * 100 if gap else float("nan")
    out.append(f"- DiLoCo (H={h}, fp32) vs one-site baseline: ppl {f32['ppl']:.2f} vs {base['ppl']:.2f} "
               f"({pct(f32['ppl'], base['ppl']):+.2f}%): {'beats' if beats else 'does NOT beat'} the baseline.")
    out.append(f"- DiLoCo vs data parallel: ppl {f32['ppl']:.2f} vs {dp['ppl']:.2f} ({pct(f32['ppl'], dp['ppl']):+.2f}%); "
               f"DiLoCo closes {closed:.0f}% of the baseline -> DP gap.")
    if "baseline_kx_tokens" in rows:
        kx = rows["baseline_kx_tokens"]
        out.append(f"- One site at the same total tokens ({kx['tokens']:,}, k x the sequential steps): ppl "
                   f"{kx['ppl']:.2f}.")
    if f16:
        d = pct(f16["ppl"], f32["ppl"])
        verdict = "within" if abs(d) <= 0.5 else "NOT within"
        spread = max(f32["ppl_sd"], f16["ppl_sd"]) / f32["ppl"] * 100
        out.append(f"- fp16 vs fp32 communication (H={h}): ppl {f16['ppl']:.2f} vs {f32['ppl']:.2f} ({d:+.2f}%): "
                   f"{verdict} 0.5%. Seed-to-seed spread is {spread:.2f}% of ppl.")
        out.append(f"- fp16 vs fp32 paired by seed (same init and data): {paired(f16, f32)}.")
    return out + [""]


def narrative(meta: dict[str, Any], rows: dict[str, dict[str, Any]], table: str, ratios: list[str]) -> str:
    s = meta["scale"]
    cmd = meta["command"] if meta["quick"] else f"flock /tmp/zeroband-bench.lock python scripts/experiments/{meta['command']}"
    lines = [
        "# DiLoCo vs data parallel vs one site: convergence at equal tokens",
        "",
        "Generated by:",
        "",
        "```bash",
        cmd,
        "```",
        "",
        f"Total wall time {meta['total_wall_s'] / 60:.1f} min on this machine; 1-min load average "
        f"{meta['load_before']:.1f} before / {meta['load_after']:.1f} after (other engineers' jobs share the 2 cores).",
        "",
        f"Token accounting (DiLoCo paper, Table 2): every row runs T = {s['steps']} inner steps of B = {s['batch']} "
        f"sequences per site. Baseline = 1 site (T x B sequences). Data parallel = k = {s['sites']} sites averaging "
        "fp32 gradients every step (`diloco.mode = \"data_parallel\"`), i.e. batch k x B for T steps. DiLoCo = k sites, "
        "batch B each, T steps, outer step every H. DP and DiLoCo see the same k x T x B sequences; "
        "`baseline_kx_tokens` is one site for k x T steps (same tokens, k x the sequential steps).",
        "",
        table,
        "",
        "Bytes are per site (site 0's rank), summed over the run's \"outer\" records: payload = what the rank "
        "put into the all-reduce, wire = the ring estimate (measured for int8/int4). Wall time is per run; "
        "the number in brackets is how many processes shared the 2 cores (one-site runs went two side by side, "
        "4-site rows are 4 processes on 2 cores), so wall times of rows with different process counts are not "
        "comparable and every number is inflated by whatever else ran on the machine.",
        "",
        "Communication ratio (DP bytes / DiLoCo bytes, per site, whole run):",
        "",
        *ratios,
        "",
        *acceptance_lines(rows, meta),
        "![validation loss vs tokens](val_loss_vs_tokens.png)",
        "",
        "![validation loss vs bytes](val_loss_vs_bytes.png)",
        "",
        *setup_lines(meta),
        "Raw per-run numbers and curves: `diloco_vs_dp.json`.",
        "",
    ]
    return "\n".join(lines)
