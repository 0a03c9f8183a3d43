"""zeroband.tools.plan: the arithmetic against values worked out by hand, and the `zeroband plan` command."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from zeroband.cli import main as cli_main
from zeroband.config import ModelConfig
from zeroband.tools.plan import (
    DTYPE_BYTES,
    PlanInput,
    dtype_bytes,
    fragments_text,
    largest_fragment,
    predict,
    predict_data_parallel,
    ramp_seconds,
    ring_factor,
    table_rows,
    table_step_time,
    traffic_reduction,
    utilisation,
)


def test_ring_factor() -> None:
    assert ring_factor(2) == 1.0
    assert ring_factor(4) == 1.5
    assert ring_factor(8) == 1.75


def test_utilisation_blocking_and_overlapped() -> None:
    assert utilisation(100.0, 25.0, overlap=False) == pytest.approx(0.8)
    assert utilisation(100.0, 25.0, overlap=True) == 1.0  # communication hides under compute
    assert utilisation(100.0, 200.0, overlap=True) == pytest.approx(0.5)  # only the excess is waited for


def test_traffic_reduction_is_h_times_4_over_bytes() -> None:
    assert traffic_reduction(500, "fp16") == pytest.approx(1000.0)
    assert traffic_reduction(100, "fp32") == pytest.approx(100.0)
    assert traffic_reduction(100, "int8") == pytest.approx(400 / 1.015625)
    assert traffic_reduction(500, "int4") == pytest.approx(2000 / 0.53125)


def test_dtype_bytes() -> None:
    assert DTYPE_BYTES["fp32"] == 4 and DTYPE_BYTES["bf16"] == DTYPE_BYTES["fp16"] == 2
    assert dtype_bytes("int8") == pytest.approx(1.02, abs=0.01)
    assert dtype_bytes("int4") == pytest.approx(0.53, abs=0.01)
    with pytest.raises(ValueError, match="fp8"):
        dtype_bytes("fp8")


def test_prediction_by_hand() -> None:
    # 1e9 params, 4 sites, 1 Gbit/s (1.25e8 B/s), 50 ms one-way, H=500 x 1.2 s, fp16, no TCP ramp
    p = PlanInput(1e9, 1.2, 4, 1.0, 50.0, 500, "fp16", overlap=False, tcp_ramp=False)
    pred = predict(p)
    assert pred.payload_bytes == pytest.approx(2e9)
    assert pred.wire_bytes == pytest.approx(3e9)  # x 2(4-1)/4
    assert pred.bandwidth_s == pytest.approx(24.0)
    # 4 one-way delays, any S: statistics, the scatter's last byte, the review, the all-gather's last byte
    assert pred.latency_s == pytest.approx(0.2)
    assert pred.comm_s == pytest.approx(24.2)
    assert pred.compute_s == pytest.approx(600.0)
    assert pred.utilisation == pytest.approx(600 / 624.2)
    assert pred.traffic_reduction == pytest.approx(1000.0)
    assert predict(PlanInput(1e9, 1.2, 4, 1.0, 50.0, 500, "fp16", overlap=True, tcp_ramp=False)).utilisation == 1.0
    # per-step fp32 data parallel: 1.5 x 4e9 B / 1.25e8 B/s + 0.2 s per step
    assert pred.dp_comm_s == pytest.approx(48.2)
    assert pred.dp_utilisation == pytest.approx(1.2 / 49.4)
    dp = predict_data_parallel(p)
    assert dp.comm_s == pytest.approx(48.2) and dp.utilisation == pytest.approx(1.2 / 49.4)


def test_fragments_by_hand() -> None:
    # the same run in 4 fragments: the same bytes per H, each of the 4 syncs with its own 4 one-way delays
    p = PlanInput(1e9, 1.2, 4, 1.0, 50.0, 500, "fp16", overlap=False, tcp_ramp=False, fragments=4)
    pred = predict(p)
    assert pred.wire_bytes == pytest.approx(3e9) and pred.bandwidth_s == pytest.approx(24.0)
    assert pred.latency_s == pytest.approx(0.8) and pred.utilisation == pytest.approx(600 / 624.8)
    assert predict(replace(p, fragments=1)).latency_s == pytest.approx(0.2)


def test_tcp_ramp_by_hand() -> None:
    # 100 Mbit/s, 100 ms RTT: BDP 1.25 MB; MSS 8948 at MTU 9000, initial window 10 x MSS = 89,480 B.
    # Windows 89,480 / 178,960 / 357,920 / 715,840 are below the BDP: 4 RTTs carrying 1,342,200 B.
    assert ramp_seconds(1e9, 12.5e6, 0.1, 9000) == pytest.approx(0.4 - 1_342_200 / 12.5e6)
    assert ramp_seconds(50_000, 12.5e6, 0.1, 9000) == pytest.approx(0.1 - 50_000 / 12.5e6)  # one short round
    assert ramp_seconds(1e9, 1e6, 0.01, 9000) == 0.0  # BDP below the initial window: no ramp
    with_ramp = predict(PlanInput(1e9, 1.2, 4, 1.0, 50.0, 500, "fp16", tcp_ramp=True))
    assert with_ramp.ramp_s > 0 and with_ramp.comm_s == pytest.approx(24.2 + with_ramp.ramp_s)
    # from a window that survived the idle: 1 MB in flight, one round of 1 MB below the 1.25 MB BDP
    assert ramp_seconds(1e9, 12.5e6, 0.1, 9000, start_bytes=1e6) == pytest.approx(0.1 - 1e6 / 12.5e6)


def test_restart_window_halves_per_retransmission_timeout() -> None:
    from zeroband.tools.plan import restart_window

    # RTT 100 ms: timeout 300 ms. An idle up to one timeout keeps the window (Linux restarts only past it);
    # 1 s is 4 timeouts begun: 3 halvings of 8 MB; minutes of inner steps: the initial window
    assert restart_window(0.3, 0.1, 8e6, 89_480) == 8e6
    assert restart_window(0.31, 0.1, 8e6, 89_480) == 4e6
    assert restart_window(1.0, 0.1, 8e6, 89_480) == 1e6
    assert restart_window(600.0, 0.1, 8e6, 89_480) == 89_480
    # in a prediction: a blocking round of 5 x 0.05 s idles 0.25 s, under the 300 ms timeout: no ramp
    short = predict(PlanInput(1e9, 0.05, 4, 1.0, 50.0, 5, "fp16", tcp_ramp=True))
    assert short.ramp_s == 0.0


WINDOW = 4194304 * 2 // 3  # 2,796,202 B in flight per stream: 2/3 of tcp_wmem max (comm/link.py)


def test_plan_uses_the_link_model() -> None:
    # 500 Mbit/s, 100 ms one-way (200 ms RTT): 12.5 MB in flight / 2.80 MB per stream -> 5 streams, the full rate
    p = PlanInput(1e9, 1.2, 2, 0.5, 100.0, 500, "fp16", tcp_ramp=False, window_bytes=WINDOW)
    pred = predict(p)
    assert pred.streams == 5 and pred.throughput_bps == 500e6
    assert pred.bandwidth_s == pytest.approx(32.0)  # 2 GB x 8 / 500 Mbit/s
    # one stream: 2,796,202 x 8 / 0.2 s = 111.8 Mbit/s, 2 GB in 143.05 s
    one = predict(replace(p, streams=1))
    assert one.throughput_bps == pytest.approx(WINDOW * 8 / 0.2) and one.bandwidth_s == pytest.approx(2e9 / (WINDOW / 0.2))
    # wait bounds: the all-reduce 3 x 32 s + 4 x 0.2 s = 96.8 s; a piece (4 MiB of fp32 = 2 MiB of fp16, x 1 at
    # S = 2) takes 0.034 s: 3 x 0.034 + 0.8 = 0.9 s, lifted to the 10 s floor
    assert pred.sync_wait_s == pytest.approx(96.8) and pred.piece_wait_s == 10.0
    assert predict(replace(p, timeout_s=60.0)).sync_wait_s == 60.0  # never above sites.timeout_s
    # 10 Gbit/s at 100 ms RTT would need 45 windows: 16 streams carry 16 x 2,796,202 x 8 / 0.1 = 3.58 Gbit/s
    fast = predict(PlanInput(1e9, 1.2, 2, 10.0, 50.0, 500, "fp16", tcp_ramp=False, window_bytes=WINDOW))
    assert fast.streams == 16 and fast.throughput_bps == pytest.approx(16 * WINDOW * 8 / 0.1)
    # slow start on 4 streams starts from 4 x 89,480 B: rounds of 357,920 and 715,840 B below the 1.25 MB BDP
    assert ramp_seconds(1e9, 12.5e6, 0.1, 9000, streams=4) == pytest.approx(0.2 - 1_073_760 / 12.5e6)


def test_cli_prints_streams_and_wait_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--params", "1e9", "--step-time", "1.2", "--sites", "2", "--gbps", "0.5", "--latency-ms", "100",
            "--no-tcp-ramp", "--window-mb", "2.796202"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "5 streams per peer (chosen: bandwidth-delay product 12.5 MB / window" in out and "-> 500 Mbit/s" in out
    assert "10.0 s per piece (4 MB of fp32), 96.8 s per all-reduce" in out
    assert cli_main([*argv, "--streams", "1"]) == 0
    assert "1 stream per peer (given (--streams)) -> 112 Mbit/s" in capsys.readouterr().out


def test_table_covers_models_bandwidths_h_and_dtypes() -> None:
    rows = table_rows()
    assert len(rows) == 4 * 3 * 2 * 3
    assert {r[0] for r in rows} == {"150M", "1B", "10B", "100B"}
    # 1B: 6 x 1e9 x 524288 tokens / (8 x 989e12 x 0.4) s per step
    assert table_step_time("1B") == pytest.approx(6 * 1e9 * 524288 / (8 * 989e12 * 0.4))


def test_cli_single_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--params", "1e9", "--step-time", "1.2", "--sites", "4", "--gbps", "1", "--latency-ms", "50",
            "--inner-steps", "500", "--dtype", "fp16", "--no-tcp-ramp"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "24.200 s" in out and "96.12%" in out and "1000x" in out
    assert cli_main([*argv, "--overlap"]) == 0
    assert "100.00%" in capsys.readouterr().out


def test_cli_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--table"]) == 0
    out = capsys.readouterr().out
    assert "| 100B |" in out and "MFU" in out
    assert cli_main(["plan"]) == 2  # neither --params nor --preset
    assert cli_main(["plan", "--preset", "demo", "--step-time", "0.1"]) == 0


def test_overlap_steps_cover_the_all_reduce() -> None:
    from zeroband.tools.plan import overlap_steps

    assert overlap_steps(2.5, 1.0, 500) == 3  # 2.5 s of all-reduce over 1 s steps: lands at step 3
    assert overlap_steps(0.01, 1.0, 500) == 1  # the earliest it can land
    assert overlap_steps(600.0, 1.0, 500) == 0  # longer than a round: a whole round (the default)


# ------------------------------------------------------------------------------- from a config file (issue 24)

CONFIGS = sorted((Path(__file__).resolve().parent.parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_plan_reads_every_shipped_config(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from zeroband.config import load_config
    from zeroband.models.llama import num_params

    cfg = load_config(config, [])
    assert cli_main(["plan", str(config), "--sites", "4", "--gbps", "1", "--latency-ms", "50"]) == 0
    out = capsys.readouterr().out
    h = cfg.diloco.inner_steps if cfg.diloco else 500
    dtype = cfg.diloco.comm_dtype if cfg.diloco else "fp16"
    assert f"H={h}" in out and f"wire {dtype}" in out and "4 sites" in out and "compute utilisation" in out
    assert f"{num_params(cfg.model):.3g} params" in out


def test_plan_from_config_by_hand(tmp_path: Path) -> None:
    import argparse

    from zeroband.tools.plan import plan_from_config

    args = argparse.Namespace(sites=4, gbps=1.0, latency_ms=50.0, overlap=False, no_tcp_ramp=True, mtu=1500,
                              step_time=None, step_json=None, gpus_per_site=8)
    cp = plan_from_config("configs/1B.toml", args)
    assert cp.plan.inner_steps == 500 and cp.plan.dtype == "fp16" and cp.piece_mb == 16
    assert cp.tokens_per_step == 256 * 2048
    assert cp.pieces == -(-int(cp.plan.params) * 4 // (16 * 2**20))  # ceil(fp32 bytes / piece bytes)
    # a measured step: tokens per step / (tokens/s per GPU x GPUs per site), from a gpu_suite.json
    bench = tmp_path / "gpu_suite.json"
    bench.write_text(json.dumps({"gpu": "H100", "rows": {"speed/shipped-1B": {"result": {"loops": {
        "zeroband": {"tokens_s": 65536.0}}}}}}))
    args.step_json = bench
    cp = plan_from_config("configs/1B.toml", args)
    assert cp.plan.step_time_s == pytest.approx(524288 / (65536.0 * 8)) and "measured" in cp.step_source
    # and from bench_step.py --inner's inner_step.json
    bench.write_text(json.dumps({"device": "H100", "rows": [{"preset": "1B", "loop": "zeroband", "tokens_s": 131072.0}]}))
    assert plan_from_config("configs/1B.toml", args).plan.step_time_s == pytest.approx(0.5)


def test_plan_step_json_without_the_model_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "inner_step.json"
    bench.write_text(json.dumps({"rows": [{"preset": "150M", "loop": "zeroband", "tokens_s": 1e5}]}))
    assert cli_main(["plan", "configs/1B.toml", "--step-json", str(bench)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--step-json" in err and "'1B'" in err


def test_plan_vs_every_measured_wan_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wan = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "wan.json"
    out = tmp_path / "plan_vs_wan.md"
    assert cli_main(["plan", "--vs-wan", str(wan)]) == 0
    assert not out.exists()  # written only when asked
    assert cli_main(["plan", "--vs-wan", str(wan), "--write", str(out)]) == 0
    text = out.read_text()
    rows = json.loads(wan.read_text())["results"]
    assert sum(line.startswith("| DiLoCo") or line.startswith("| DP") for line in text.splitlines()) == len(rows)
    assert "mean |error|" in text and capsys.readouterr().out.count("# zeroband plan vs") == 2


# ------------------------------------------------------------------------------- the recommended H (issue 33)


def test_h_for_utilisation_by_hand() -> None:
    from zeroband.tools.plan import h_for_utilisation

    # blocking: H x 1 s / (H x 1 s + 2 s) >= 0.95  <=>  H >= 0.95 x 2 / 0.05 = 38
    assert h_for_utilisation(1.0, 2.0, 0.95) == 38
    assert h_for_utilisation(1.0, 2.01, 0.95) == 39
    # overlapped: H x 1 s / max(H x 1 s, 2 s) >= 0.95  <=>  H >= 1.9
    assert h_for_utilisation(1.0, 2.0, 0.95, overlap=True) == 2
    assert h_for_utilisation(1.0, 0.0, 0.95) == 1  # a free sync: any H


def test_recommend_h_keeps_the_outer_steps_floor() -> None:
    from zeroband.tools.plan import MIN_OUTER_STEPS, recommend_h

    assert MIN_OUTER_STEPS == 20
    h, why = recommend_h(5000, 1.0, 2.0)
    assert h == 250  # 5000 / 20
    assert "the largest H keeping >= 20 outer steps over 5000 steps" in why
    assert "H >= 38 reaches 95% compute utilisation" in why and "docs/results/large_h.md" in why
    # H must divide train.steps and checkpoint.interval: 88000 / 20 = 4400, but 5000 % 4400 != 0 -> 1000
    assert recommend_h(88000, 1.0, 2.0, period=5000)[0] == 1000
    assert recommend_h(4999, 1.0, 2.0)[0] == 1  # 4999 is prime: only H = 1 divides it below 249


def test_recommend_h_says_when_the_link_misses_the_target() -> None:
    from zeroband.tools.plan import recommend_h

    # 1000 steps -> H = 50 (20 outer steps); a 100 s sync over 1 s steps: 50 / 150 = 33.3%; 95% needs H >= 1900
    h, why = recommend_h(1000, 1.0, 100.0)
    assert h == 50 and "reaches only 33.3% compute utilisation" in why and "95% needs H >= 1900" in why
    assert "more than the run's 1000 steps" in why
    h, why = recommend_h(10, 1.0, 0.1)  # fewer steps than the floor: H = 1 keeps the most
    assert h == 1 and "no H keeps >= 20 outer steps over 10 steps" in why


def test_h_warning_when_the_config_keeps_too_few_outer_steps() -> None:
    from zeroband.tools.plan import h_warning

    assert h_warning(500, 88000) is None  # 176 outer steps
    line = h_warning(500, 5000)  # 10 outer steps
    assert line is not None and "leaves 10 outer steps" in line and "--diloco.inner_steps" in line


def test_plan_config_prints_the_recommended_h(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "short.toml"  # the 1B config, shortened to 5000 steps: its H = 500 keeps 10 outer steps
    config.write_text(Path("configs/1B.toml").read_text().replace("steps = 50000", "steps = 5000"))
    assert cli_main(["plan", str(config), "--sites", "2", "--gbps", "1", "--latency-ms", "50", "--step-time", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rec = [line for line in out if line.startswith("recommended H: ")]
    assert len(rec) == 1 and rec[0].startswith("recommended H: 250 (the largest H keeping >= 20 outer steps over 5000")
    assert any(line.startswith("warning: diloco.inner_steps=500 leaves 10 outer steps") for line in out)


def test_slow_start_restarts_only_for_loss_based_senders() -> None:
    from zeroband.tools.plan import link_run_prediction, restarts_slow_start

    cubic = {"net.ipv4.tcp_congestion_control": "cubic", "net.ipv4.tcp_slow_start_after_idle": "1"}
    assert restarts_slow_start(cubic)
    assert not restarts_slow_start(cubic | {"net.ipv4.tcp_slow_start_after_idle": "0"})
    assert not restarts_slow_start(cubic | {"net.ipv4.tcp_congestion_control": "bbr"})  # Linux skips it for BBR
    assert not restarts_slow_start(None)  # not recorded: the emulator's 0
    # a --streams row: 20,000 fp32 values -> 40 kB of fp16 between 2 sites, 1 stream, 20 Mbit/s, 100 ms RTT:
    # 40,000 x 8 / 20e6 = 0.016 s + 4 one-way delays of 50 ms; after 5 s idle a cubic sender restarts from
    # 10 x 8948 B, more than the 40 kB: one round of 0.1 - 40,000 / 2.5e6 s more
    row = {"numel": 20_000, "rate_mbit": 20.0, "rtt_ms": 100.0, "streams_used": 1, "idle_s": 5.0, "mtu": 9000}
    assert link_run_prediction(row, WINDOW) == pytest.approx(0.016 + 0.2)
    assert link_run_prediction(row | {"tcp": cubic}, WINDOW) == pytest.approx(0.016 + 0.2 + 0.1 - 0.016)


def test_largest_fragment_is_the_split_of_the_real_shapes() -> None:
    # demo: 4096 x 128 embedding and lm_head, 524,288 each, of 1,787,008: one of them alone fills a fragment
    demo = ModelConfig(preset="demo")
    assert largest_fragment(demo, 4) == pytest.approx(524_288 / 1_787_008)
    assert largest_fragment(demo, 1) == 1.0
    # 1B: the 32000 x 2048 tables are 6% of the model, so 10 fragments balance to 1 / 10 within 1%
    assert largest_fragment(ModelConfig(preset="1B"), 10) < 1.01 / 10
    p = PlanInput(1.787e6, 0.05, 2, 0.02, 50.0, 160, "fp16", tcp_ramp=False, fragments=4,
                  largest_fragment=524_288 / 1_787_008)
    pred = predict(p)
    assert pred.largest_sync_bytes == pytest.approx(pred.wire_bytes * 524_288 / 1_787_008)
    assert "3.4-fold, not 4-fold" in fragments_text(p, pred)[0]
    assert predict(replace(p, largest_fragment=0.0)).largest_sync_bytes == pytest.approx(pred.wire_bytes / 4)
