"""What counts as this machine in a Host or Origin header, and which secret files are their owner's alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.coord.server import InsecureLighthouseError, Lighthouse
from stalwart.coord.tls import ExposedSecretError, check_private
from stalwart.data.plan import EpochPlan


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
def test_a_secret_file_of_its_owner_alone_is_accepted(tmp_path: Path, mode: int) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(mode)
    check_private(secret, "--token-file")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644, 0o666])
def test_a_secret_file_others_may_read_is_refused_naming_it_its_mode_and_the_fix(tmp_path: Path, mode: int) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(mode)
    with pytest.raises(ExposedSecretError, match=rf"--tls-key {secret} .*mode {mode:04o}.*chmod 600 {secret}"):
        check_private(secret, "--tls-key")


def test_a_network_address_without_tls_is_refused_unless_insecure() -> None:
    plan = EpochPlan(64, 8, seed=0)
    with pytest.raises(InsecureLighthouseError, match=r"'10\.1\.2\.3'.*TLS.*--tls-cert/--tls-key.*--insecure"):
        Lighthouse(plan, host="10.1.2.3", token="t")
    with pytest.raises(InsecureLighthouseError, match=r"'0\.0\.0\.0'.*no token.*--insecure"):
        Lighthouse(plan, host="0.0.0.0")
    assert Lighthouse(plan, host="10.1.2.3", token="t", insecure=True).host == "10.1.2.3"
