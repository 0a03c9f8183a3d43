import pytest

from zeroband.config import ConfigError, load_config, parse_overrides


def test_overrides_parse_types():
    tree = parse_overrides(["--optim.lr", "3e-4", "--train.compile", "--data.path=x.jsonl", "--model.preset", "demo"])
    assert tree == {"optim": {"lr": 3e-4}, "train": {"compile": True}, "data": {"path": "x.jsonl"}, "model": {"preset": "demo"}}


def test_every_shipped_config_validates():
    from pathlib import Path

    configs = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.toml"))
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
