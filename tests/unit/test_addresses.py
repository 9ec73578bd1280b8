"""What counts as this machine in a Host or Origin header, and which secret files are their owner's alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.coord.server import Lighthouse
from stalwart.coord.tls import ExposedSecretError, check_private, is_loopback_authority, is_loopback_origin
from stalwart.data.plan import EpochPlan
from stalwart.errors import InsecureLighthouseError

LOOPBACK = ["localhost", "LocalHost:80", "localhost.", "127.0.0.1", "127.0.0.1:29510", "127.8.9.10:1", "[::1]",
            "[::1]:443", "[0:0:0:0:0:0:0:1]:8080"]  # fmt: skip
OTHERS = ["attacker.example", "attacker.example:29510", "localhost.attacker.example", "127.0.0.1.nip.io",
          "10.0.0.1:80", "[::2]:80", "[::1", "[::1]x", "127.0.0.1:x", "::1", "0.0.0.0", "", ":80", "[127.0.0.1]",
          "localhost:80:80", "evil.com#@localhost"]  # fmt: skip


@pytest.mark.parametrize("authority", LOOPBACK)
def test_loopback_hosts_are_this_machine(authority: str) -> None:
    assert is_loopback_authority(authority)
    assert is_loopback_origin(f"http://{authority}") and is_loopback_origin(f"https://{authority}")


@pytest.mark.parametrize("authority", OTHERS)
def test_other_hosts_are_not(authority: str) -> None:
    assert not is_loopback_authority(authority)
    assert not is_loopback_origin(f"http://{authority}")


@pytest.mark.parametrize("origin", ["null", "localhost", "file://localhost", "ftp://127.0.0.1", "http://x.example"])
def test_other_origins_are_not(origin: str) -> None:
    assert not is_loopback_origin(origin)


@given(name=st.text(max_size=30) | st.sampled_from(LOOPBACK + OTHERS), port=st.integers(0, 65535))
def test_a_name_with_a_port_is_loopback_exactly_when_the_name_without_one_is(name: str, port: int) -> None:
    bare = (not name.endswith("]") and ":" not in name) or (name.startswith("[") and name.endswith("]"))
    assert is_loopback_authority(f"{name}:{port}") == (bare and is_loopback_authority(name))


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
