"""The example systemd units of docs/systemd/ pass ``systemd-analyze verify``
(skipped where systemd-analyze is not installed); their exposure score from
``systemd-analyze security --offline`` is printed, not asserted."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "docs" / "systemd"
ANALYZE = shutil.which("systemd-analyze")
#: Keys of newer systemd versions (254) that older ones ignore with a warning.
NEWER_KEYS = re.compile(r"Unknown key '(RestartSteps|RestartMaxDelaySec)'")

pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def installed(unit: Path, into: Path) -> Path:
    """The unit with ExecStart pointing at this environment's ``fleetlease``
    (verify checks that the command exists)."""
    binary = Path(sys.executable).with_name("fleetlease")
    if not binary.exists():
        pytest.skip(f"no fleetlease script next to {sys.executable}")
    text = unit.read_text().replace("/usr/local/bin/fleetlease", str(binary))
    out = into / unit.name
    out.write_text(text)
    return out


@pytest.mark.parametrize("name", ["fleetlease-serve.service", "fleetlease-agent.service"])
def test_the_example_unit_verifies(name: str, tmp_path: Path) -> None:
    assert ANALYZE is not None
    unit = installed(UNITS / name, tmp_path)
    text = unit.read_text()
    for key in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes"):
        assert key in text
    assert "Restart=always" in text and "RestartSec=" in text
    done = subprocess.run(
        [ANALYZE, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if line.strip() and not NEWER_KEYS.search(line)
    ]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr
    security = subprocess.run(
        [ANALYZE, "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = security.stdout.strip().splitlines()
    print(f"{name}: {lines[-1] if lines else security.stderr.strip()}")


def test_the_agent_takes_its_credential_from_a_file_not_its_environment() -> None:
    text = (UNITS / "fleetlease-agent.service").read_text()
    assert "LoadCredential=host.credential:" in text
    assert "--token-file %d/host.credential" in text
    assert "FLEETLEASE_TOKEN" not in text
