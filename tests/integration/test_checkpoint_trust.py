"""Checkpoints are data: a crafted one that would run code is refused before anything is unpickled.

DCP metadata is a pickle, so a sha256 manifest proves nothing against whoever wrote it: only a
signature under the run's secret, or the checkpoint being the run's own, lets it load.
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
import torch

from tests.helpers import _args, _main, _train, tiny_overrides
from tests.multiproc import run_ranks
from zeroband.checkpoint import MANIFEST, CheckpointError, sha256_file, step_dir, verify_trusted

SECRET = "checkpoint-trust-test-secret-7f3a9c"

ENV = {"ZEROBAND_SECRET": SECRET}


class _RunsCode:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def signed(corpus, tmp_path_factory) -> dict:
    """A 4-step run that saved signed checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("signed")
    tree = tiny_overrides(corpus, out, train={"steps": 4}, checkpoint={"interval": 2})
    [result] = run_ranks(_train, 1, (tree,), env=ENV)
    return {"tree": tree, "losses": result["losses"], "root": out / "t" / "checkpoints"}


def _rehash(path: Path) -> None:
    """What an attacker does: make every size and sha256 in the manifest match the files again."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        entry.update(bytes=(path / name).stat().st_size, sha256=sha256_file(path / name))
    (path / MANIFEST).write_text(json.dumps(manifest))


def _craft(src: Path, dst: Path, marker: Path) -> Path:
    """A copy of a real checkpoint whose pickles run code, with a recomputed manifest."""
    shutil.copytree(src, dst)
    payload = pickle.dumps(_RunsCode(marker))
    (dst / "dcp" / ".metadata").write_bytes(payload)
    for rank_file in dst.glob("rank_*.pt"):
        rank_file.write_bytes(payload)
    _rehash(dst)
    return dst


def _resume_error(tree: dict, path: Path, env: dict) -> str:
    tree = {**tree, "checkpoint": {**tree["checkpoint"], "resume": str(path)}}
    code, err = run_ranks(_main, 1, (_args(tree),), env=env)[0]
    assert code == 2 and "Traceback" not in err, err
    return err


def test_signed_checkpoint_round_trips(signed, corpus, tmp_path):
    step2 = step_dir(signed["root"], 2)
    manifest = json.loads((step2 / MANIFEST).read_text())
    assert manifest["signature"]["alg"] == "hmac-sha256" and SECRET not in (step2 / MANIFEST).read_text()
    # Signed, it loads even from outside the run's own directory, and resumes exactly.
    moved = shutil.copytree(step2, tmp_path / "elsewhere" / step2.name)
    tree = tiny_overrides(corpus, tmp_path / "b", train={"steps": 4}, checkpoint={"interval": 2, "resume": str(moved)})
    [resumed] = run_ranks(_train, 1, (tree,), env=ENV)
    assert resumed["losses"] == signed["losses"][2:]
    own = torch.load(step2 / "rank_00000.pt", weights_only=True)  # plain data only
    assert isinstance(own["rng"]["numpy"]["keys"], torch.Tensor)


@pytest.mark.slow
def test_crafted_checkpoint_is_refused_by_resume_and_export(signed, tmp_path):
    marker = tmp_path / "code-ran"
    evil = _craft(step_dir(signed["root"], 4), tmp_path / "evil" / "step_000000004", marker)
    # No secret: a signed checkpoint (the signature copied along) is not loaded unverified...
    assert "is signed and no secret is at hand" in _resume_error(signed["tree"], evil, {})
    # With the secret: the signature copied along no longer matches the manifest...
    assert "signature does not verify" in _resume_error(signed["tree"], evil, ENV)
    # ...and without one the manifest is unsigned, which a run with a secret refuses.
    manifest = json.loads((evil / MANIFEST).read_text())
    del manifest["signature"]
    (evil / MANIFEST).write_text(json.dumps(manifest))
    assert "is not signed but the run has a secret" in _resume_error(signed["tree"], evil, ENV)
    # ...and an unsigned one from outside the run's directory is not loaded without a deliberate act.
    assert "outside this run's checkpoint directory" in _resume_error(signed["tree"], evil, {})
    # export refuses it the same way, in one line.
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(signed["tree"]))
    out = subprocess.run([sys.executable, "-m", "zeroband", "export", str(config), "--checkpoint", str(evil)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "zeroband export:" in out.stderr and "is not signed" in out.stderr
    # And rank_*.pt alone is read as data: weights_only refuses the code.
    with pytest.raises(pickle.UnpicklingError):
        torch.load(evil / "rank_00000.pt", weights_only=True)
    # Even the deliberate act (allow_unsigned) runs no code: DCP is read without pickle's power.
    tree = {**signed["tree"], "checkpoint": {**signed["tree"]["checkpoint"], "allow_unsigned": True}}
    assert "refusing to unpickle" in _resume_error(tree, evil, {})
    only_rank = shutil.copytree(step_dir(signed["root"], 4), tmp_path / "only_rank")
    (only_rank / "rank_00000.pt").write_bytes(pickle.dumps(_RunsCode(marker)))
    _rehash(only_rank)
    assert "holds more than tensors and plain values" in _resume_error(tree, only_rank, {})
    assert not marker.exists()
    pickle.loads(pickle.dumps(_RunsCode(tmp_path / "control")))  # the payload is live when unpickled
    assert (tmp_path / "control").exists()


def test_tampered_manifest_is_refused(signed, tmp_path):
    original = step_dir(signed["root"], 4)
    verify_trusted(original, SECRET.encode(), None)  # signed: trusted anywhere
    with pytest.raises(CheckpointError, match="signature does not verify"):
        verify_trusted(original, b"another-secret-of-enough-length", None)
    bumped = shutil.copytree(original, tmp_path / "bumped")
    manifest = json.loads((bumped / MANIFEST).read_text())
    manifest["step"] = 400  # any edit of a signed field
    (bumped / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="signature does not verify"):
        verify_trusted(bumped, SECRET.encode(), signed["root"])
    swapped = shutil.copytree(original, tmp_path / "swapped")
    victim = next((swapped / "dcp").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    _rehash(swapped)  # the hashes match the new bytes, the signature no longer matches the manifest
    with pytest.raises(CheckpointError, match="signature does not verify"):
        verify_trusted(swapped, SECRET.encode(), signed["root"])
    added = shutil.copytree(original, tmp_path / "added")
    (added / "dcp" / "__0.metadata").write_bytes(pickle.dumps(_RunsCode(tmp_path / "marker")))
    with pytest.raises(CheckpointError, match="not listed in the manifest"):
        verify_trusted(added, SECRET.encode(), signed["root"])


def test_a_signed_checkpoint_resumes_only_its_own_run_and_site(signed, corpus, tmp_path):
    """Issue 35: signatures did not name the run or site, so run A's signed checkpoint (the
    launcher's launch.secret may sign many runs) loaded as run B's. The manifest names its owner
    under the signature: a resume takes only its own run and site, an export any site of its run."""
    from zeroband.checkpoint import Owner, manifest_mac, signing_key

    original = step_dir(signed["root"], 4)
    assert json.loads((original / MANIFEST).read_text())["owner"] == {"run": "t", "site": 0}
    for owner in (Owner("t", 0), Owner("t")):
        verify_trusted(original, SECRET.encode(), None, owner=owner)
    with pytest.raises(CheckpointError, match="signed for run 't' site 0, not for run 't' site 1"):
        verify_trusted(original, SECRET.encode(), None, owner=Owner("t", 1))
    # One that names no owner (signed by hand, or before owners were named) is no run's.
    ownerless = shutil.copytree(original, tmp_path / "ownerless")
    manifest = json.loads((ownerless / MANIFEST).read_text())
    del manifest["owner"]
    manifest["signature"]["mac"] = manifest_mac(signing_key(SECRET.encode()), manifest)
    (ownerless / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="signed for no run"):
        verify_trusted(ownerless, SECRET.encode(), None, owner=Owner("t"))
    # The real resume: run "b", same secret, pointed at run "t"'s checkpoint.
    other = tiny_overrides(corpus, tmp_path / "b", name="b", train={"steps": 4}, checkpoint={"interval": 2})
    assert "signed for run 't' site 0, not for run 'b' site 0" in _resume_error(other, original, ENV)


def test_export_names_a_signature_failure(signed, tmp_path):
    """Issue 35: a tampered signed checkpoint made `zeroband export` say "no complete checkpoint
    ... train first"; it now says why the checkpoint was refused."""
    from zeroband.config import validate_config
    from zeroband.export import export
    from zeroband.trust.secret import RunSecret

    root = shutil.copytree(signed["root"], tmp_path / "checkpoints")
    for step in (2, 4):
        manifest = json.loads((step_dir(root, step) / MANIFEST).read_text())
        manifest["step"] += 100  # any edit of a signed field
        (step_dir(root, step) / MANIFEST).write_text(json.dumps(manifest))
    cfg = validate_config({**signed["tree"], "checkpoint": {**signed["tree"]["checkpoint"], "dir": str(root)}})
    with pytest.raises(CheckpointError, match=r"can be exported: .*step_000000004: manifest signature does not "
                                              r"verify under the run's secret .*\(and 1 more\)"):
        export(cfg, None, tmp_path / "hf", secret=RunSecret(SECRET.encode(), "the test"))
