"""Chaos run: a multi-site elastic DiLoCo training with sites killed, hung, partitioned, stopped and
restarted on a schedule, and etcd members lost; then a report of what was detected, how fast, what
was lost, and whether every surviving replica stayed bitwise identical.

    flock /tmp/zeroband-bench.lock python scripts/chaos.py --faults 32 --sites 4 --wan rate=1000 --etcd --out docs/results

Fault kinds (each a few times, round-robin in a seeded order):
  kill_inner / kill_allreduce / kill_checkpoint  phase-exact SIGKILL armed by tests/inject.py (only in the
                                                 victim's incarnation that is due to hit that step)
  kill_external   os.kill(worker, SIGKILL) at a random moment
  term            SIGTERM: graceful leave (checkpoint, exit 0); the site is restarted later (a join)
  hang            SIGSTOP of the worker; SIGKILL once the survivors dropped it; restart
  partition       `ip link set wan0 down` in the site's namespace for a few seconds (needs --wan)
  etcd_member     SIGKILL of one etcd member; restarted later (needs --etcd)
Every restart of a site is also a `join` event (a fresh site receiving the state from a peer).
As a user runs it: the sites share a fresh secret (TLS between sites, a guarded store), and etcd
(--etcd) runs with TLS and authentication, the run's user limited to its prefix; --insecure drops both.

Goodput = (seconds per committed outer step of a fault-free run of the same config) /
          (seconds per committed outer step of the chaos run), both measured from the first to the
          last committed outer step; a token-weighted variant (committed site-tokens per second) is
          reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import add_out_argument, output_dir, say_written  # noqa: E402

from tests import chaos  # noqa: E402
from tests.etcd_cluster import RUN_PREFIX, EtcdCluster, start_cluster  # noqa: E402
from zeroband.tools.launch import WanLink, free_port, is_running, last_error_line, store_process  # noqa: E402
from zeroband.tools.report import data_audit, data_line  # noqa: E402
from zeroband.trust.secret import SECRET_ENV  # noqa: E402

ENV_KINDS = {"kill_inner": "inner", "kill_allreduce": "allreduce", "kill_checkpoint": "checkpoint"}
SITE_KINDS = ["kill_inner", "kill_allreduce", "kill_checkpoint", "kill_external", "term", "hang", "partition"]
TICK_S = 0.2


@dataclass
class Settings:
    sites: int
    faults: int
    seed: int
    steps: int
    gap: int
    inner_steps: int = 2
    fragments: int = 1  # diloco.fragments: a round per fragment boundary, P per inner_steps
    ckpt_interval: int = 20
    keep_last: int = 8
    heartbeat_s: float = 0.25
    dead_after_s: float = 2.0
    grace_s: float = 1.0
    timeout_s: float = 30.0
    partition_s: float = 5.0
    term_rejoin_s: float = 4.0
    etcd_down_s: float = 8.0
    baseline_steps: int = 120
    config: str = str(ROOT / "configs" / "debug.toml")  # from any working directory


@dataclass
class Fault:
    index: int
    kind: str
    step: int  # the inner step at which it is due
    site: int | None  # victim slot (None: an etcd member)
    member: int | None = None
    injected_at: float | None = None
    injected_step: int | None = None
    restored_at: float | None = None
    detected_at: float | None = None
    detect_s: float | None = None
    note: str = ""

    @property
    def injected(self) -> bool:
        return self.injected_at is not None


@dataclass
class Join:
    site: int
    incarnation: int
    started: float
    joined_at: float | None = None


# ---------------------------------------------------------------------------------- planning


def plan_faults(s: Settings, kinds: list[str]) -> list[Fault]:
    rng = random.Random(s.seed)
    order = [kinds[i % len(kinds)] for i in range(s.faults)]
    rng.shuffle(order)
    order.sort(key=lambda k: k == "term")  # a left site is never re-admitted (library bug): leaves go last
    faults, last_victim = [], -1
    for i, kind in enumerate(order):
        step = 30 + i * s.gap + rng.randrange(0, max(1, s.gap // 4))
        step = align(kind, step, s)
        victim = None
        if kind != "etcd_member":
            choices = [v for v in range(s.sites) if v != last_victim and not (kind == "partition" and v == 0)]
            victim = rng.choice(choices or list(range(s.sites)))
            last_victim = victim
        faults.append(Fault(i, kind, step, victim, member=rng.randrange(3) if kind == "etcd_member" else None))
    return faults


def align(kind: str, step: int, s: Settings) -> int:
    if kind == "kill_checkpoint":
        return -(-step // s.ckpt_interval) * s.ckpt_interval
    if kind == "kill_allreduce":
        return -(-step // s.inner_steps) * s.inner_steps
    if kind == "kill_inner":
        return step if step % s.inner_steps else step + 1  # strictly inside an inner phase
    return step


def run_overrides(s: Settings, out: Path, name: str, steps: int, net: Net) -> list[str]:
    """The run's settings; with the run's secret (the default) nothing is insecure, and an etcd
    store is reached with the run's etcd credentials."""
    values: dict[str, Any] = {
        "output_dir": out, "name": name, "model.vocab_size": 4096, "train.steps": steps, "eval.interval": 0,
        "eval.batches": 1, "log.interval": 10, "checkpoint.interval": s.ckpt_interval,
        "checkpoint.keep_last": s.keep_last, "diloco.elastic": "true", "diloco.inner_steps": s.inner_steps,
        "diloco.fragments": s.fragments,
        "diloco.heartbeat_s": s.heartbeat_s, "diloco.dead_after_s": s.dead_after_s, "diloco.grace_s": s.grace_s,
        "diloco.start_grace_s": 120, "sites.timeout_s": s.timeout_s, "diloco.join_timeout_s": 90,
        "diloco.log_checksum": "true", "diloco.comm_dtype": "fp32",
        **({"sites.insecure": "true"} if net.secret is None else {f"sites.{k}": v for k, v in net.access.items()}),
    }
    return [x for k, v in values.items() for x in (f"--{k}", str(v))]


# ---------------------------------------------------------------------------------- network + store


@dataclass
class Net:
    store: str
    wrap: Any
    env: Any
    emulator: Any = None
    etcd: EtcdCluster | None = None
    secret: str | None = None  # the run's shared secret (None: --insecure)
    access: dict[str, str] = field(default_factory=dict)  # the sites' etcd credentials (a secure etcd)

    def namespace(self, site: int) -> str | None:
        return None if self.emulator is None else self.emulator.site_ns(site)


@contextmanager
def network(sites: int, wan: WanLink | None, etcd: bool, root: Path, secure: bool = True):
    """(store address prefix, wrap, env) with the store in its own process(es), never in a site.
    `secure` (the default, as a user runs): a fresh shared secret for the sites and the store, and
    etcd with TLS and authentication (tests/etcd_cluster.py `secure`), the run's user limited to
    RUN_PREFIX."""
    secret = secrets.token_hex(16) if secure else None
    # in this process's environment: the sites and the store inherit it, and the post-mortem verifies
    # the signed checkpoints with it, as the run's owner would
    os.environ.pop(SECRET_ENV, None)
    if secret:
        os.environ[SECRET_ENV] = secret
    with ExitStack() as stack:
        emu = None
        if wan is not None:
            from zeroband.wan import WanEmulator

            emu = stack.enter_context(WanEmulator(sites, wan.rate_mbit, wan.delay_ms, wan.jitter_ms, wan.loss_pct,
                                                  wan.mtu))
        wrap = emu.wrap if emu else (lambda site, cmd: cmd)
        env = emu.env if emu else (lambda site: {})
        if etcd:
            hosts = [(emu.site_ip(i % sites), emu.wrap(i % sites, [])) if emu else ("127.0.0.1", [])
                     for i in range(3)]
            cluster = start_cluster(hosts=hosts, root=root / "etcd", secure=secure)
            stack.callback(cluster.stop)
            yield Net(cluster.url(RUN_PREFIX), wrap, env, emu, cluster, secret, cluster.access() if secure else {})
            return
        host, port = (emu.site_ip(0), 29600) if emu else ("127.0.0.1", free_port())
        stack.enter_context(store_process([host, port], (lambda c: emu.wrap(0, c)) if emu else (lambda c: c)))
        yield Net(f"tcp://{host}:{port}", wrap, env, emu, secret=secret)


def store_for(net: Net, name: str) -> str:
    """The run's store address: on etcd a prefix of its own under RUN_PREFIX (the run user's keys)."""
    return f"{net.store}/{name}" if net.etcd is not None else net.store


# ---------------------------------------------------------------------------------- the controller

CONFIG_EXIT = 2  # zeroband's exit status for an error of its own making (one `zeroband: error:` line)


class Controller:
    def __init__(self, s: Settings, net: Net, out: Path, faults: list[Fault], rng: random.Random) -> None:
        self.s, self.net, self.out, self.faults, self.rng = s, net, out, faults, rng
        self.metrics = [out / "chaos" / f"site{i}" / "metrics.jsonl" for i in range(s.sites)]
        self.sites = chaos.make_sites(s.config, s.sites, store_for(net, "chaos"),
                                      run_overrides(s, out, "chaos", s.steps, net), out / "logs", net.wrap, net.env)
        self.restart_at: dict[int, float] = {}
        self.expected_exit: dict[int, Fault] = {}  # site -> the external fault that will end it
        self.joins: list[Join] = []
        self.active: Fault | None = None  # the external fault being carried out
        self.finished: set[int] = set()
        self.events: list[str] = []
        self.stuck: list[str] = []
        self.fatal: str | None = None  # a site stopped on its configuration: restarting cannot help
        self.lost_slots: set[int] = set()
        self.tail = chaos.DecisionTail(self.metrics)

    # ----- helpers
    def step(self) -> int:
        return max(chaos.last_step(p) for p in self.metrics)

    def log(self, msg: str) -> None:
        line = f"[chaos {time.strftime('%H:%M:%S')} step {self.step()}] {msg}"
        self.events.append(line)
        print(line, flush=True)

    def env_faults(self, site: int) -> str:
        now = self.step()
        due = [f for f in self.faults if f.site == site and f.kind in ENV_KINDS and not f.injected
               and f.step > now + 4]
        return ",".join(f"site{site}:step{f.step}:{ENV_KINDS[f.kind]}:kill" for f in due)

    def start_site(self, site: int) -> None:
        inc = self.sites[site].start(self.env_faults(site))
        if inc.number > 0:
            self.joins.append(Join(site, inc.number, inc.started))
        self.log(f"site {site} incarnation {inc.number} started (faults {inc.faults or '-'})")

    def members_now(self) -> set[int]:
        """Sites in the newest decision (by round) any site logged; the ones a fault can hit."""
        decisions = self.tail.read()
        if not decisions:
            return set()
        newest = max(decisions, key=lambda d: (d.round, d.attempt, d.time))
        return set(newest.members) - set(newest.fresh)

    # ----- main loop
    def run(self, deadline_s: float) -> None:
        for i in range(self.s.sites):
            self.start_site(i)
        deadline = time.monotonic() + deadline_s
        try:
            while time.monotonic() < deadline and not self.done():
                self.watch_sites()
                self.maybe_inject()
                self.advance_active()
                self.watch_joins()
                self.maybe_restart()
                time.sleep(TICK_S)
        finally:  # also on SIGTERM (main turns it into SystemExit) or an error here: no site left running
            self.teardown()

    def done(self) -> bool:
        return self.fatal is not None or (not any(p.running for p in self.sites) and not self.restart_at)

    def ending(self) -> bool:
        return self.step() >= self.s.steps - 3 * self.s.inner_steps or bool(self.finished)

    def watch_sites(self) -> None:
        for p in self.sites:
            inc = p.current
            if inc is None or inc.ended is not None:
                continue
            p.workers()
            if p.poll() is None:
                self.watch_env_kill(p)
                continue
            self.on_exit(p)

    def watch_env_kill(self, p: chaos.SiteProcess) -> None:
        """A phase-exact kill: the worker is gone while the agent still runs (or about to exit)."""
        inc = p.current
        if inc is None or not inc.workers or any(is_running(w) for w in inc.workers):
            return
        if p.site not in self.expected_exit and time.time() - inc.started > 5:
            self.attribute_env_kill(p)

    def attribute_env_kill(self, p: chaos.SiteProcess) -> None:
        pending = [f for f in self.faults if f.site == p.site and f.kind in ENV_KINDS and not f.injected
                   and f"step{f.step}:" in (p.current.faults if p.current else "")]
        if not pending:
            return
        if "exitcode: -9" not in self.log_since(p) and "Signal 9" not in self.log_since(p):
            return
        f = min(pending, key=lambda f: f.step)
        f.injected_at, f.injected_step = time.time(), f.step
        self.expected_exit[p.site] = f
        self.log(f"fault {f.index} {f.kind}: site {p.site} died at its planned step {f.step}")

    def log_since(self, p: chaos.SiteProcess) -> str:
        """The site's log written by its current incarnation."""
        text = p.log_path.read_text(errors="replace")
        marker = f"incarnation {p.current.number if p.current else 0} of site {p.site} "
        return text[text.rfind(marker):]

    def on_exit(self, p: chaos.SiteProcess) -> None:
        inc = p.current
        assert inc is not None
        fault = self.expected_exit.pop(p.site, None)
        if fault is None and inc.returncode != 0:
            self.attribute_env_kill(p)
            fault = self.expected_exit.pop(p.site, None)
        done = chaos.last_step(self.metrics[p.site]) >= self.s.steps
        if stuck_join(self.log_since(p), bool(self.finished)):
            self.stuck.append(f"site {p.site} incarnation {inc.number}: RoundTimeout (never admitted)")
        self.log(f"site {p.site} incarnation {inc.number} exited {inc.returncode}"
                 + (f" ({fault.kind})" if fault else "") + (" after the last step" if done else ""))
        if fault is None and inc.returncode == CONFIG_EXIT and untrained(self.sites, self.metrics) is not None:
            # before anyone trained, an exit 2 is the run's configuration (data, tokenizer, settings):
            # every restart would stop on it again
            self.fatal = f"site {p.site} stopped on its configuration (exit 2): {last_error_line(self.log_since(p))}"
            return
        if done:
            self.finished.add(p.site)
            return
        if self.ending() or p.site in self.lost_slots:
            self.log(f"site {p.site} not restarted: " + ("slot given up" if p.site in self.lost_slots else "the run is ending"))
            return
        wait = self.s.term_rejoin_s if fault is not None and fault.kind == "term" else self.rng.uniform(0.5, 2.0)
        self.restart_at[p.site] = time.monotonic() + wait

    def watch_joins(self) -> None:
        """A restarted site that is not admitted within 60 s is stuck: stop it, give the slot up."""
        decisions = self.tail.read()
        for j in self.joins:
            p = self.sites[j.site]
            inc = p.current
            if j.joined_at is not None or inc is None or inc.number != j.incarnation or not p.running:
                continue
            d = chaos.first_inclusion(decisions, j.site, j.started)
            if d is not None:
                j.joined_at = d.time
            elif time.time() - j.started > 75 and not self.finished:
                self.stuck.append(f"site {j.site} incarnation {j.incarnation}: not admitted after 75 s")
                self.log(f"site {j.site} incarnation {j.incarnation} never admitted: stopping it, slot given up")
                self.lost_slots.add(j.site)
                self.expected_exit[j.site] = Fault(-1, "stuck_join", 0, j.site)
                p.stop()

    def maybe_restart(self) -> None:
        for site, when in list(self.restart_at.items()):
            if time.monotonic() >= when:
                del self.restart_at[site]
                if not self.ending():
                    self.start_site(site)

    # ----- external faults
    def maybe_inject(self) -> None:
        if self.active is not None or self.ending():
            return
        now = self.step()
        due = [f for f in self.faults if not f.injected and f.kind not in ENV_KINDS and f.step <= now and not f.note]
        if not due:
            self.expire_env_faults(now)
            return
        f = due[0]
        if f.kind == "etcd_member":
            return self.inject_etcd(f)
        victim = self.pick_victim(f)
        if victim is None:
            return  # try again next tick: everyone is busy recovering
        f.site = victim
        getattr(self, f"inject_{f.kind}")(f)
        f.injected_at, f.injected_step = time.time(), now
        self.active = f

    def expire_env_faults(self, now: int) -> None:
        for f in self.faults:
            if f.kind in ENV_KINDS and not f.injected and not f.note and f.step < now - 2 * self.s.inner_steps:
                p = self.sites[f.site]
                if f"step{f.step}:" not in (p.current.faults if p.current else "") or not p.running:
                    f.note = "not injected: the victim was not running at its step"
                    self.log(f"fault {f.index} {f.kind} on site {f.site} at step {f.step}: {f.note}")

    def pick_victim(self, f: Fault) -> int | None:
        members = self.members_now()
        ok = [p.site for p in self.sites if p.running and p.site in members and p.site not in self.expected_exit
              and p.site not in self.restart_at and not (f.kind == "partition" and self.net.emulator is None)]
        if f.kind == "partition":
            ok = [v for v in ok if v != 0 or self.net.etcd is not None]  # the tcp store lives in site 0's netns
        if len(members) < 2 or not ok:
            return None
        return f.site if f.site in ok else self.rng.choice(ok)

    def inject_kill_external(self, f: Fault) -> None:
        self.expected_exit[f.site] = f
        pids = self.sites[f.site].signal_workers(signal.SIGKILL)
        self.log(f"fault {f.index} kill_external: SIGKILL site {f.site} workers {pids}")
        f.restored_at = time.time()

    def inject_term(self, f: Fault) -> None:
        """SIGTERM to every process group of the site, as SLURM signals a job step: the agent's (as
        `zeroband launch` does; torchrun passes it on to its ranks' groups) and each rank's whole
        group (as torchrun does), not the trainer pid alone."""
        self.expected_exit[f.site] = f
        site = self.sites[f.site]
        inc = site.current
        groups: set[int] = set()
        for pid in [*([inc.proc.pid] if inc else []), *site.workers()]:
            try:
                if (group := os.getpgid(pid)) not in groups:
                    os.killpg(group, signal.SIGTERM)
                    groups.add(group)
            except ProcessLookupError:  # it ended meanwhile
                pass
        self.log(f"fault {f.index} term: SIGTERM site {f.site} process groups {sorted(groups)}")
        f.restored_at = time.time()

    def inject_hang(self, f: Fault) -> None:
        self.expected_exit[f.site] = f
        pids = self.sites[f.site].signal_workers(signal.SIGSTOP)
        self.log(f"fault {f.index} hang: SIGSTOP site {f.site} workers {pids}")

    def inject_partition(self, f: Fault) -> None:
        ns = self.net.namespace(f.site)
        subprocess.run(["ip", "-n", ns, "link", "set", "wan0", "down"], check=True)
        self.log(f"fault {f.index} partition: site {f.site} ({ns}) wan0 down")

    def inject_etcd(self, f: Fault) -> None:
        assert self.net.etcd is not None and f.member is not None
        self.net.etcd.kill(f.member)
        f.injected_at, f.injected_step = time.time(), self.step()
        self.active = f
        self.log(f"fault {f.index} etcd_member: SIGKILL etcd member {f.member}")

    def advance_active(self) -> None:
        """Finish the external fault in progress: un-hang, heal, restart a store member."""
        f = self.active
        if f is None:
            return
        held = time.time() - (f.injected_at or 0)
        if f.kind == "hang" and f.restored_at is None:
            dropped = chaos.first_exclusion(self.tail.read(), f.site,
                                            f.injected_at or 0)
            if dropped is not None or held > 4 * self.s.dead_after_s + self.s.grace_s:
                self.sites[f.site].signal_workers(signal.SIGKILL)
                f.restored_at = time.time()
                self.log(f"fault {f.index} hang: site {f.site} SIGKILLed after {held:.1f} s stopped")
        elif f.kind == "partition" and f.restored_at is None and held >= self.s.partition_s:
            subprocess.run(["ip", "-n", self.net.namespace(f.site), "link", "set", "wan0", "up"], check=True)
            f.restored_at = time.time()
            self.log(f"fault {f.index} partition: site {f.site} wan0 up after {held:.1f} s")
        elif f.kind == "etcd_member" and f.restored_at is None and held >= self.s.etcd_down_s:
            self.net.etcd.start(f.member)
            f.restored_at = time.time()
            self.log(f"fault {f.index} etcd_member: member {f.member} restarted after {held:.1f} s")
        if f.restored_at is not None and time.time() - f.restored_at > 2 * self.s.dead_after_s:
            self.active = None

    def teardown(self) -> None:
        self.watch_sites()  # exits seen on the last tick still get classified
        for p in self.sites:
            if p.running:
                self.log(f"site {p.site} still running at the end: stopping it (counted as a hang)")
                p.stop()
        if self.active is not None and self.active.kind == "partition" and self.active.restored_at is None:
            subprocess.run(["ip", "-n", self.net.namespace(self.active.site), "link", "set", "wan0", "up"])


# ---------------------------------------------------------------------------------- analysis


def stuck_join(log: str, run_finished: bool) -> bool:
    """A restarted site that timed out waiting to be admitted. One that came back as the run ended
    and gave up because nobody was left to join ("nothing to join") did what it should: no hang."""
    return "RoundTimeout" in log and not (run_finished and "nothing to join" in log)


def analyse(s: Settings, c: Controller, out: Path, baseline: dict[str, Any] | None, wall_s: float) -> dict[str, Any]:
    decisions = chaos.read_decisions(c.metrics)
    detect(c.faults, decisions)
    for j in c.joins:
        d = chaos.first_inclusion(decisions, j.site, j.started)
        end = c.sites[j.site].incarnations[j.incarnation].ended
        j.joined_at = d.time if d and (end is None or d.time <= end) else None
    records = {i: chaos.outer_records(c.metrics[i]) for i in range(s.sites)}
    table = chaos.crc_table(records)
    committed = sorted(table)
    expected = s.steps * s.fragments // s.inner_steps  # outer records: one per step that ends a round
    ckpts = check_checkpoints(s, c, out)
    result = {
        "settings": asdict(s), "wall_s": wall_s,
        "kinds": kind_table(c.faults, c.joins),
        "faults_injected": sum(f.injected for f in c.faults), "faults_planned": len(c.faults),
        "expected_outer_steps": expected, "committed_outer_steps": len(committed),
        "outer_steps_lost": expected - len(committed),
        "aborted_attempts": chaos.count_events(c.metrics, "aborted"),
        "skipped_rounds": chaos.count_events(c.metrics, "skipped"),
        "crc_compared_steps": sum(1 for by in table.values() if len(by) > 1),
        "crc_mismatch_steps": chaos.crc_mismatches(table),
        "sites_finished": sorted(c.finished), "hangs": stranded(c) + c.stuck, "lost_slots": sorted(c.lost_slots),
        "incarnations": incarnation_table(c), "skipped_handover": skipped_handover(c, decisions),
        **ckpts, **goodput(s, records, baseline), "data": data_audit(c.metrics),
        "faults": [asdict(f) for f in c.faults], "joins": [asdict(j) for j in c.joins], "events": c.events,
    }
    result["replicas_not_identical"] = len(result["crc_mismatch_steps"]) + ckpts["final_weights_differ"]
    return result


def skipped_handover(c: Controller, decisions: list[chaos.LoggedDecision]) -> list[str]:
    """Restarted incarnations whose first decision lists them as members that already hold the state:
    they adopted a decision made before they died, and skipped the state hand-over."""
    out = []
    for p in c.sites:
        for inc in p.incarnations[1:]:
            own = [d for d in decisions if d.site == p.site and d.time >= inc.started]
            if own and p.site in own[0].members and p.site not in own[0].fresh:
                d = own[0]
                out.append(f"site {p.site} incarnation {inc.number}: round {d.round} attempt {d.attempt} "
                           f"members {list(d.members)} fresh {list(d.fresh)}")
    return out


def stranded(c: Controller) -> list[str]:
    """Incarnations that the controller had to stop at the end (never finished on their own)."""
    return [ev.split("] ", 1)[1] for ev in c.events if "still running at the end" in ev]


def detect(faults: list[Fault], decisions: list[chaos.LoggedDecision]) -> None:
    for f in faults:
        if not f.injected or f.site is None:
            continue
        d = chaos.first_exclusion(decisions, f.site, (f.injected_at or 0) - 0.5)
        if d is not None and d.time - (f.injected_at or 0) < 30:
            f.detected_at, f.detect_s = d.time, max(0.0, d.time - (f.injected_at or 0))


def kind_table(faults: list[Fault], joins: list[Join]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for f in faults:
        row = rows.setdefault(f.kind, {"planned": 0, "injected": 0, "detected": 0, "detect_s": []})
        row["planned"] += 1
        row["injected"] += f.injected
        row["detected"] += f.detect_s is not None
        if f.detect_s is not None:
            row["detect_s"].append(round(f.detect_s, 2))
    times = [round(j.joined_at - j.started, 2) for j in joins if j.joined_at]
    rows["join"] = {"planned": len(joins), "injected": len(joins), "detected": len(times), "detect_s": times}
    for row in rows.values():
        t = row.pop("detect_s")
        row.update(detect_median_s=_median(t), detect_max_s=max(t) if t else None, detect_all_s=t)
    return rows


def _median(values: list[float]) -> float | None:
    v = sorted(values)
    return None if not v else (v[len(v) // 2] if len(v) % 2 else round((v[len(v) // 2 - 1] + v[len(v) // 2]) / 2, 2))


def incarnation_table(c: Controller) -> list[dict[str, Any]]:
    return [{"site": p.site, "incarnation": inc.number, "faults": inc.faults, "returncode": inc.returncode,
             "seconds": round((inc.ended or time.time()) - inc.started, 1)} for p in c.sites for inc in p.incarnations]


def check_checkpoints(s: Settings, c: Controller, out: Path) -> dict[str, Any]:
    root = out / "chaos" / "checkpoints"
    count, errors = chaos.verify_all_checkpoints(root)
    finals = {i: chaos.final_checkpoint(root, i) for i in range(s.sites)}
    at_end = {i: p for i, p in finals.items() if p is not None and p.name == f"step_{s.steps:09d}"}
    differ, loaded, load_errors = 0, 0, []
    ref = None
    for i, path in at_end.items():
        try:
            weights = chaos.load_weights(out / "chaos" / f"site{i}" / "config.toml", path)
            loaded += 1
        except Exception as e:  # an unloadable checkpoint is a finding, not a crash of the report
            load_errors.append(f"{path}: {type(e).__name__}: {e}")
            continue
        if ref is None:
            ref = weights
        elif not chaos.same_weights(ref, weights):
            differ += 1
    return {"checkpoints_verified": count, "checkpoints_unloadable": len(errors) + len(load_errors),
            "checkpoint_errors": errors + load_errors, "final_checkpoints_loaded": loaded,
            "final_checkpoint_sites": sorted(at_end), "final_weights_differ": differ}


def span(records: dict[int, list[dict[str, Any]]]) -> tuple[float, int, float]:
    """(seconds from the first to the last committed outer step, steps in between, site-rounds)."""
    times: dict[int, float] = {}
    used: dict[int, int] = {}
    for recs in records.values():
        for r in recs:
            times[r["step"]] = min(times.get(r["step"], r["time"]), r["time"])
            used[r["step"]] = r["sites_used"]
    if len(times) < 2:
        return 0.0, 0, 0.0
    steps = sorted(times)
    return times[steps[-1]] - times[steps[0]], len(steps) - 1, float(sum(used[k] for k in steps[1:]))


def goodput(s: Settings, records: dict[int, list[dict[str, Any]]], baseline: dict[str, Any] | None) -> dict[str, Any]:
    secs, n, site_rounds = span(records)
    out: dict[str, Any] = {"chaos_s_per_outer_step": secs / n if n else None,
                           "chaos_site_rounds_per_s": site_rounds / secs if secs else None}
    if baseline and n and baseline.get("s_per_outer_step"):
        out["baseline_s_per_outer_step"] = baseline["s_per_outer_step"]
        out["baseline_site_rounds_per_s"] = baseline["site_rounds_per_s"]
        out["goodput"] = baseline["s_per_outer_step"] / out["chaos_s_per_outer_step"]
        out["goodput_tokens"] = out["chaos_site_rounds_per_s"] / baseline["site_rounds_per_s"]
    return out


def run_baseline(s: Settings, net: Net, out: Path) -> dict[str, Any]:
    """The same config without faults (fewer steps): the steady-state time per outer step."""
    sites = chaos.make_sites(s.config, s.sites, store_for(net, "baseline"),
                             run_overrides(s, out, "baseline", s.baseline_steps, net), out / "baseline-logs",
                             net.wrap, net.env)
    for p in sites:
        p.start()
    deadline = time.monotonic() + 600
    while any(p.running for p in sites) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in sites:
        p.stop()
    metrics = [out / "baseline" / f"site{i}" / "metrics.jsonl" for i in range(s.sites)]
    records = {i: chaos.outer_records(path) for i, path in enumerate(metrics)}
    secs, n, site_rounds = span(records)
    return {"s_per_outer_step": secs / n if n else None, "site_rounds_per_s": site_rounds / secs if secs else None,
            "returncodes": [p.current.returncode for p in sites if p.current], "untrained": untrained(sites, metrics)}


def untrained(sites: list[chaos.SiteProcess], metrics: list[Path]) -> str | None:
    """One line when no site logged a single inner step (the run could not start: data, config, store),
    naming site 0's error line from its log; None when some site trained, so there is a run to analyse."""
    if any(chaos.last_step(path) > 0 for path in metrics):
        return None
    log = sites[0].log_path
    why = last_error_line(log.read_text(errors="replace")) if log.is_file() else "it wrote no log"
    return f"chaos: no site trained a single step, so there is nothing to analyse; site 0: {why} (logs in {log.parent}/)"


# ---------------------------------------------------------------------------------- report


def render(r: dict[str, Any], command: str) -> str:
    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))

    lines = ["# Chaos run", "", f"Command: `{command}`", "",
             f"{r['settings']['sites']} sites x 1 rank, debug model, {r['settings']['steps']} inner steps "
             f"(H={r['settings']['inner_steps']}, {r['settings'].get('fragments', 1)} fragment(s)), "
             f"wall {r['wall_s']:.0f} s, "
             f"{r['faults_injected']} faults injected of {r['faults_planned']} planned.", "",
             "| kind | planned | injected | detected | detect median s | detect max s |",
             "|---|---|---|---|---|---|"]
    for kind, row in r["kinds"].items():
        lines.append(f"| {kind} | {row['planned']} | {row['injected']} | {row['detected']} | "
                     f"{fmt(row['detect_median_s'])} | {fmt(row['detect_max_s'])} |")
    summary = [
        ("outer steps expected / committed / lost", f"{r['expected_outer_steps']} / {r['committed_outer_steps']} / "
                                                    f"{r['outer_steps_lost']}"),
        ("aborted attempts (retried) / skipped rounds", f"{r['aborted_attempts']} / {r['skipped_rounds']}"),
        ("hangs (never finished on their own)", f"{len(r['hangs'])} {r['hangs'] or ''}"),
        ("outer steps compared across >= 2 sites", r["crc_compared_steps"]),
        ("restarted sites that adopted a pre-crash decision (no hand-over)", len(r["skipped_handover"])),
        ("replicas not bitwise identical", f"{r['replicas_not_identical']} (crc steps {r['crc_mismatch_steps']}, "
                                           f"final weights differing {r['final_weights_differ']})"),
        ("documents committed exactly once / committed (data ledger)", data_line(r.get("data", {}))),
        ("checkpoints verified / unloadable", f"{r['checkpoints_verified']} / {r['checkpoints_unloadable']}"),
        ("final checkpoints loaded with load_for_export", f"{r['final_checkpoints_loaded']} "
                                                          f"(sites {r['final_checkpoint_sites']})"),
        ("s per outer step: fault-free / chaos", f"{fmt(r.get('baseline_s_per_outer_step'))} / "
                                                 f"{fmt(r.get('chaos_s_per_outer_step'))}"),
        ("goodput (time per committed outer step)", fmt(r.get("goodput"))),
        ("goodput (committed site-rounds per s)", fmt(r.get("goodput_tokens"))),
    ]
    lines += ["", "| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in summary]
    lines += ["", "Incarnations (site, number, return code, seconds, faults armed):", ""]
    lines += [f"- site {i['site']} #{i['incarnation']}: rc {i['returncode']}, {i['seconds']} s, "
              f"{i['faults'] or '-'}" for i in r["incarnations"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=32)
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=int, default=36, help="inner steps between two planned faults")
    p.add_argument("--wan", default=None, help="emulate a WAN (rate=..,delay=..); enables partitions")
    p.add_argument("--etcd", action="store_true", help="a 3-member etcd cluster as the store; lose members")
    p.add_argument("--insecure", action="store_true",
                   help="no shared secret and a plain etcd (sites.insecure); default: a fresh secret, etcd with TLS + auth")
    p.add_argument("--quick", action="store_true", help="a few faults, a short run (development)")
    p.add_argument("--fixed", type=int, default=0, metavar="N",
                   help="instead: N rounds of the default-mode faults (frozen peer, launcher SIGTERM, resume "
                        "mismatch, NaN divergence) on 2 sites under `zeroband launch`; no root needed")
    p.add_argument("--overrides", default="", metavar="'--key value ...'",
                   help="with --fixed: extra overrides, e.g. --overrides='--data.path X --model.vocab_size 384'")
    p.add_argument("--fragments", type=int, default=1, help="diloco.fragments (Streaming DiLoCo; divides H = 2)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/zeroband-chaos"))
    add_out_argument(p, "docs/results", "chaos.{md,json} (chaos_fixed.* with --fixed)")
    args = p.parse_args(argv)
    args.out = output_dir(args.out, "chaos", args.quick)
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    faults = min(args.faults, 8) if args.quick else args.faults
    steps = 30 + faults * args.gap + 3 * args.gap
    return Settings(args.sites, faults, args.seed, steps - steps % 20, args.gap, fragments=args.fragments,
                    baseline_steps=60 if args.quick else 120)


def run_fixed(rounds: int, workdir: Path, seed: int, data: list[str]) -> list[chaos.ScenarioResult]:
    """Default-mode faults (tests/chaos.py, "fixed-mode scenarios"), each on a fresh run directory;
    every scenario ends with a relaunch that must resume and finish with identical, verified checkpoints."""
    rng, timeout_s, steps, h = random.Random(seed), 15.0, 40, 2
    results = []
    for r in range(rounds):
        def fresh(name: str) -> chaos.FixedRun:
            values = {"output_dir": workdir, "name": name, "model.vocab_size": 4096, "train.steps": steps,
                      "eval.interval": 0, "eval.batches": 1, "log.interval": 2, "checkpoint.interval": 4,
                      "checkpoint.keep_last": 3, "diloco.inner_steps": h, "sites.timeout_s": timeout_s,
                      "diloco.comm_dtype": "fp32", "sites.insecure": "true"}
            flags = [x for k, v in values.items() for x in (f"--{k}", str(v))]
            return chaos.FixedRun(str(ROOT / "configs" / "debug.toml"), flags + data, workdir, name)

        at = rng.randrange(6, steps - 10)
        results.append(chaos.frozen_peer(fresh(f"frozen{r}"), at, timeout_s, rng.choice(["cont", "kill"]), 300))
        sigterm_run = fresh(f"sigterm{r}")
        results.append(chaos.launcher_sigterm(sigterm_run, at, 300))
        results.append(chaos.resume_mismatch(sigterm_run, 300))  # its checkpoints: site 1 loses the newest
        results.append(chaos.resume_refused(sigterm_run, 120))
        results.append(chaos.nan_divergence(fresh(f"nan{r}"), -(-at // h) * h, 300, h))
        print(f"[chaos] fixed round {r}: {[asdict(x) for x in results[-5:]]}", flush=True)
    return results


def render_fixed(results: list[chaos.ScenarioResult], command: str) -> str:
    lines = ["# Chaos run: default (non-elastic) mode", "", f"Command: `{command}`", "",
             "| fault | injected | detected, median s | hung runs | runs that lost data | work lost (steps) |",
             "|---|---|---|---|---|---|"]
    for kind in sorted({x.kind for x in results}):
        rs = [x for x in results if x.kind == kind]
        detected = sorted(x.detected_s for x in rs if x.detected_s is not None)
        median = f"{detected[len(detected) // 2]:.1f}" if detected else "-"
        lines.append(f"| {kind} | {sum(x.injected for x in rs)} | {median} ({len(detected)}/{len(rs)}) | "
                     f"{sum(x.hung for x in rs)} | {sum(x.data_lost for x in rs)} | {sum(x.lost_steps for x in rs)} |")
    lines += ["", f"Total: {sum(x.injected for x in results)} faults injected, {sum(x.hung for x in results)} runs hung, "
              f"{sum(x.data_lost for x in results)} lost data, {sum(x.lost_steps for x in results)} inner steps of "
              "work lost (steps trained before a fault and not in the resumed run).", ""]
    lines += [f"- {x.kind}: {x.message or x.note}" for x in results if x.message or x.note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like an error: the sites are stopped, the etcd cluster and the namespaces removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.fixed:
        shutil.rmtree(args.workdir, ignore_errors=True)
        args.workdir.mkdir(parents=True)
        results = run_fixed(args.fixed, args.workdir, args.seed, shlex.split(args.overrides))
        report = render_fixed(results, "python scripts/chaos.py " + " ".join(sys.argv[1:] if argv is None else argv))
        print(report)
        write_report(args.out / "chaos_fixed", report, [asdict(x) for x in results])
        return 0 if not any(x.hung or x.data_lost for x in results) else 1
    s = settings_from(args)
    kinds = SITE_KINDS[:-1] + (["partition"] if args.wan else []) + (["etcd_member"] if args.etcd else [])
    faults = plan_faults(s, kinds)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    with network(s.sites, WanLink.parse(args.wan) if args.wan else None, args.etcd, args.workdir,
                 not args.insecure) as net:
        baseline = None if args.no_baseline else run_baseline(s, net, args.workdir)
        print(f"[chaos] baseline: {baseline}", flush=True)
        if baseline is not None and baseline["untrained"]:  # the chaos run would not train either
            print(baseline["untrained"], file=sys.stderr)
            return 2
        c = Controller(s, net, args.workdir, faults, random.Random(args.seed + 1))
        t0 = time.time()
        c.run(deadline_s=max(900.0, 6.0 * s.steps))
        wall = time.time() - t0
    if c.fatal is not None:
        print(c.fatal, file=sys.stderr)
        return 2
    if (line := untrained(c.sites, c.metrics)) is not None:
        print(line, file=sys.stderr)
        return 2
    result = analyse(s, c, args.workdir, baseline, wall)
    result["baseline"] = baseline
    command = "python scripts/chaos.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = render(result, command)
    print(report)
    write_report(args.out / "chaos", report, result)
    return 0 if ok(result) else 1


def write_report(stem: Path, report: str, data: Any) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    say_written(stem.with_suffix(".json"), stem.with_suffix(".md"))


def ok(r: dict[str, Any]) -> bool:
    return not r["hangs"] and not r["replicas_not_identical"] and not r["checkpoints_unloadable"]


if __name__ == "__main__":
    raise SystemExit(main())
