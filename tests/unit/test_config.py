import os

import pytest

from zeroband.config import ConfigError, load_config, parse_overrides


def test_overrides_parse_types():
    tree = parse_overrides(["--optim.lr", "3e-4", "--train.compile", "--data.path=x.jsonl", "--model.preset", "demo"])
    assert tree == {"optim": {"lr": 3e-4}, "train": {"compile": True}, "data": {"path": "x.jsonl"}, "model": {"preset": "demo"}}


def test_every_shipped_config_validates():
    from pathlib import Path

    configs = sorted(Path(__file__).parent.parent.parent.joinpath("configs").glob("*.toml"))
    assert len(configs) >= 6
    for path in configs:
        cfg = load_config(path)
        assert cfg.train.global_batch % cfg.train.micro_batch == 0


def test_override_wins_over_file():
    cfg = load_config("configs/demo.toml", ["--optim.lr", "1e-4", "--model.dim", "64", "--model.n_heads", "4"])
    assert cfg.optim.lr == 1e-4 and cfg.model.dim == 64 and cfg.model.n_layers == 4  # preset fills the rest


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--optim.lrr", "1"])
    assert "optim.lrr: unknown key" in str(e.value) and "did you mean optim.lr" in str(e.value)


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.steps", "many"])
    assert "train.steps" in str(e.value) and "'many'" in str(e.value)


def test_batch_not_divisible_by_micro_batch():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--train.global_batch", "10", "--train.micro_batch", "4"])
    assert "train.global_batch=10" in str(e.value) and "train.micro_batch=4" in str(e.value)


def test_batch_not_divisible_by_ranks_gives_fix():
    cfg = load_config(None, ["--train.global_batch", "12", "--train.micro_batch", "4"])
    cfg.check_world(3)
    with pytest.raises(ConfigError) as e:
        cfg.check_world(2)
    msg = str(e.value)
    assert "2 x 4 = 8" in msg and "multiple of 8" in msg and "[1, 3]" in msg


def test_seq_len_longer_than_model():
    with pytest.raises(ConfigError, match="data.seq_len=512 exceeds model.max_seq_len=256"):
        load_config(None, ["--data.seq_len", "512"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_config(None, ["--model.preset", "huge"])


def test_diloco_steps_must_end_on_outer_boundary():
    with pytest.raises(ConfigError, match="train.steps=30 is not a multiple of diloco.inner_steps=20"):
        load_config(None, ["--diloco.inner_steps", "20", "--train.steps", "30"])


def test_inner_outer_lr_schedule_needs_rounds_of_inner_steps():
    """Rounds of diloco.round_seconds end at each site's own step: one outer lr per site would split them."""
    with pytest.raises(ConfigError, match="diloco.outer_lr_schedule = 'inner' needs rounds of diloco.inner_steps") as e:
        load_config(None, ["--diloco.inner_steps", "2", "--train.steps", "4", "--diloco.round_seconds", "5",
                           "--diloco.outer_lr_schedule", "inner"])
    assert "Fix: set diloco.outer_lr_schedule = 'constant'" in str(e.value)


def test_rda_merge_is_refused_for_data_parallel_in_one_line():
    with pytest.raises(ConfigError, match="diloco.merge = 'rda' merges pseudo-gradients: it needs diloco.mode") as e:
        load_config(None, ["--diloco.merge", "rda", "--diloco.mode", "data_parallel", "--diloco.inner_steps", "20"])
    assert "Fix: diloco.merge = 'mean'" in str(e.value)
    assert load_config(None, ["--diloco.merge", "rda", "--diloco.inner_steps", "20"]).diloco.merge == "rda"


def test_diloco_none_drops_section():
    assert load_config("configs/150M.toml", ["--diloco", "none"]).diloco is None


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_site_identity_required_for_diloco(monkeypatch):
    from zeroband.world import world_from_env

    monkeypatch.delenv("ZEROBAND_SITE_RANK", raising=False)
    cfg = load_config("configs/demo_diloco.toml")
    with pytest.raises(ConfigError, match="ZEROBAND_SITE_RANK"):
        world_from_env(cfg)
    monkeypatch.setenv("ZEROBAND_SITE_RANK", "1")
    monkeypatch.setenv("ZEROBAND_SITE_COUNT", "3")
    world = world_from_env(cfg)
    assert (world.site_rank, world.site_count, world.dp_rank, world.dp_size) == (1, 3, 1, 3)
    cfg = load_config("configs/demo_diloco.toml", ["--sites.site_rank", "0", "--sites.site_count", "2"])
    assert (world_from_env(cfg).site_rank, world_from_env(cfg).site_count) == (0, 2)  # the config wins


def test_sites_section_holds_identity_store_and_transport():
    cfg = load_config("configs/demo_diloco.toml", ["--sites.store", "tcp://10.0.0.1:1234", "--sites.timeout_s", "30",
                                                   "--sites.insecure", "--sites.backend", "nccl"])
    assert (cfg.sites.store, cfg.sites.timeout_s, cfg.sites.insecure, cfg.sites.backend) == (
        "tcp://10.0.0.1:1234", 30.0, True, "nccl")
    with pytest.raises(ConfigError, match="sites: Value error, store='nowhere' must look like tcp://host:port"):
        load_config("configs/demo_diloco.toml", ["--sites.store", "nowhere"])
    with pytest.raises(ConfigError, match="site_rank=2 must be < site_count=2"):
        load_config(None, ["--sites.site_rank", "2", "--sites.site_count", "2"])


@pytest.mark.parametrize("key, value", [("store", '"tcp://h:1"'), ("host_store", "false"), ("secret_file", '"s"'),
                                        ("insecure", "true"), ("site_rank", "1"), ("site_count", "2"),
                                        ("backend", '"gloo"'), ("timeout_s", "30")])
def test_old_diloco_site_keys_are_refused_naming_the_new_key(tmp_path, key, value):
    toml = tmp_path / "old.toml"
    toml.write_text(f"[diloco]\ninner_steps = 2\n{key} = {value}\n")
    expected = f"diloco.{key} moved to sites.{key}: write [sites] {key} = {value} (or --sites.{key} on the command line)"
    for source in ((toml, None), ("configs/demo_diloco.toml", [f"--diloco.{key}", value.strip('"')])):
        with pytest.raises(ConfigError) as e:
            load_config(*source)
        assert str(e.value) == expected  # one line, nothing else


@pytest.mark.parametrize("source", ["toml", "cli"])
def test_old_bucket_size_key_is_refused_naming_piece_mb(tmp_path, source):
    toml = tmp_path / "old.toml"
    toml.write_text("[diloco]\ninner_steps = 2\nbucket_mb = 16\n")
    args = (toml, None) if source == "toml" else ("configs/demo_diloco.toml", ["--diloco.bucket_mb", "16"])
    with pytest.raises(ConfigError) as e:
        load_config(*args)
    assert str(e.value) == "diloco.bucket_mb is now diloco.piece_mb: write [diloco] piece_mb = 16 (or --diloco.piece_mb on the command line)"
    assert load_config("configs/demo_diloco.toml", ["--diloco.piece_mb", "16"]).diloco.piece_mb == 16


def test_python_dilococonfig_keeps_working_with_algorithm_keys_and_drops_a_store_with_a_warning():
    from zeroband.config import DilocoConfig

    cfg = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, nesterov=True, comm_dtype="fp32", inner_steps=1)
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.nesterov, cfg.comm_dtype, cfg.inner_steps) == (0.7, 0.9, True, "fp32", 1)
    with pytest.warns(DeprecationWarning, match=r"diloco.store moved to sites.store: write \[sites\] store ="):
        assert DilocoConfig(outer_lr=0.5, store="tcp://127.0.0.1:1").model_dump() == DilocoConfig(outer_lr=0.5).model_dump()
    with pytest.warns(DeprecationWarning, match="diloco.bucket_mb is now diloco.piece_mb"):
        assert DilocoConfig(bucket_mb=1.0).piece_mb == 1.0  # a renamed key keeps its value


def test_old_key_on_the_command_line_is_one_line_from_the_cli(capsys):
    from zeroband.cli import main as cli_main

    assert cli_main(["launch", "configs/demo_diloco.toml", "--sites", "2", "--diloco.store", "tcp://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "diloco.store moved to sites.store: write [sites] store =" in err, err


def test_every_command_line_form_of_a_secret_is_refused_without_echo(tmp_path):
    from zeroband.config import holds_secret, names_secret, refuse_secret_arguments

    secret = "cli-form-secret-0123456789"
    forms = [["--sites.secret", secret], [f"--sites.secret={secret}"], [f'--sites={{secret="{secret}"}}'],
             ["--sites", f'{{ "secret" = "{secret}" }}'], [f'--sites={{a.secret="{secret}"}}'],
             [f"--sites={{secret={secret}}}"], [f'--sites={{"secret": "{secret}"}}'], [f"--sites-secret={secret}"],
             [f"--sites.SECRET={secret}"], [f'--x=[{{secret="{secret}"}}]']]
    for form in forms:
        with pytest.raises(ConfigError, match="puts a secret on the command line") as e:
            load_config(None, form)
        assert secret not in str(e.value) and "ZEROBAND_SECRET" in str(e.value) and "0600" in str(e.value)
    # Where the secret is kept is not the secret: these pass.
    assert not names_secret("sites.secret_file") and not holds_secret({"sites": {"secret_file": "/s"}})
    refuse_secret_arguments(["train", "configs/demo.toml", "--sites.secret_file", "/run/zb.secret", "--name", "x"])
    # A config file that holds the secret must be 0600, like sites.secret_file.
    toml = tmp_path / "c.toml"
    toml.write_text(f'[sites]\nsecret = "{secret}"\n')
    toml.chmod(0o640)
    with pytest.raises(ConfigError, match="other users can read it") as e:
        load_config(toml)
    assert secret not in str(e.value)
    toml.chmod(0o600)
    assert load_config(toml).sites.secret == secret


def test_span_docs_has_a_default_and_a_one_line_error():
    assert load_config(None).data.span_docs == 64
    with pytest.raises(ConfigError, match=r"data.span_docs: Input should be greater than 0 \(got 0\)"):
        load_config(None, ["--data.span_docs", "0"])


def test_a_secret_file_is_read_only_if_it_is_a_regular_0600_file_of_this_user(tmp_path):
    """Issue 35: sites.secret_file (and the launcher's launch.secret, read alike) was used whoever
    owned it and through a symlink. Each refusal is one line naming the field and the fix."""
    from zeroband.config import read_secret_file

    good = tmp_path / "zb.secret"
    good.write_text("a-secret-of-enough-length-0123\n")
    good.chmod(0o600)
    assert read_secret_file(good) == "a-secret-of-enough-length-0123"
    link = tmp_path / "link.secret"
    link.symlink_to(good)
    with pytest.raises(ValueError, match="sites.secret_file .* is a symlink; point sites.secret_file at the file"):
        read_secret_file(link)
    good.chmod(0o640)
    with pytest.raises(ValueError, match=r"readable by other users \(mode 640\); run `chmod 600"):
        read_secret_file(good)
    good.chmod(0o600)
    os.mkfifo(tmp_path / "fifo", 0o600)  # not a regular file: refused without blocking on the open
    with pytest.raises(ValueError, match="is not a regular file"):
        read_secret_file(tmp_path / "fifo")
    # The launcher's launch.secret goes through the same checks (zeroband/tools/launch.py).
    from zeroband.config import validate_config
    from zeroband.tools.launch import local_secret_env

    cfg = validate_config({"name": "r", "output_dir": str(tmp_path), "diloco": {"inner_steps": 2}})
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "launch.secret").symlink_to(good)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ZEROBAND_SECRET", raising=False)
        with pytest.raises(ConfigError, match="is a symlink"):
            local_secret_env(cfg)
    if os.geteuid() != 0:
        pytest.skip("a file of another owner needs root to make (os.chown)")
    os.chown(good, 4242, -1)
    with pytest.raises(ValueError, match="owned by uid 4242, not by this user"):
        read_secret_file(good)


def test_etcd_access_settings_are_checked_one_line_per_bad_field(tmp_path):
    """Issue 35 item 3: how a run reaches an etcd cluster with TLS and auth (sites.etcd_*). Each bad
    field is one line naming it; an etcd:// store with a secret needs the settings."""
    from zeroband.config import validate_config
    from zeroband.store.client import etcd_access

    ca, cert, key, password = (tmp_path / n for n in ("ca.pem", "client.pem", "client-key.pem", "run.password"))
    for path in (ca, cert, key):
        path.write_text("pem")
    password.write_text("pw\n")
    password.chmod(0o600)
    store = "etcd://127.0.0.1:2379/zb"
    good = {"store": store, "etcd_ca_file": str(ca), "etcd_cert_file": str(cert), "etcd_key_file": str(key),
            "etcd_user": "run", "etcd_password_file": str(password)}

    def error(**sites: object) -> str:
        with pytest.raises(ConfigError) as e:
            validate_config({"name": "r", "output_dir": str(tmp_path), "diloco": {"inner_steps": 2}, "sites": sites})
        return str(e.value)

    cfg = validate_config({"name": "r", "output_dir": str(tmp_path), "sites": good})
    access = etcd_access(cfg.sites)
    assert (access.ca_file, access.user, access.password) == (str(ca), "run", "pw")
    assert "pw" not in repr(cfg.sites) and "etcd_password" not in cfg.sites.model_dump()
    missing = error(**{**good, "etcd_ca_file": str(tmp_path / "nope.pem"), "etcd_key_file": str(tmp_path / "no.pem")})
    assert "sites.etcd_ca_file: Value error, cannot be read" in missing and "sites.etcd_key_file: Value error" in missing
    assert len(missing.splitlines()) == 3  # the header and one line per bad field
    assert "go together" in error(**{**good, "etcd_key_file": None})
    assert "etcd_user and sites.etcd_password_file go together" in error(**{**good, "etcd_password_file": None})
    password.chmod(0o644)
    assert "sites.etcd_password_file" in error(**good) and "chmod 600" in error(**good)
    password.chmod(0o600)
    assert "needs etcd's access control" in error(store=store)  # a secret (not insecure) and no settings
    validate_config({"name": "r", "output_dir": str(tmp_path), "sites": {"store": store, "insecure": True}})
    assert "is not etcd://" in error(**{**good, "store": "tcp://127.0.0.1:1"})
