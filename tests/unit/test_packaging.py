"""The wheel installs one namespace, ``fleetlease``, and nothing beside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "transport", "persistence", "hostagent", "ops")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("fleetlease-*.whl")
    return built


def test_the_wheel_puts_nothing_but_fleetlease_into_site_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"fleetlease"}
    for pkg in PACKAGES:
        assert f"fleetlease/{pkg}/__init__.py" in names


def test_the_wheel_carries_the_migrations_and_the_console(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "fleetlease/persistence/migrations/env.py" in names
    assert any(n.startswith("fleetlease/persistence/migrations/versions/0001") for n in names)
    assert any(n.startswith("fleetlease/ops/web/templates/") for n in names)
    assert any(n.startswith("fleetlease/ops/web/static/") for n in names)


def test_the_entry_points_name_the_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (ep,) = [n for n in z.namelist() if n.endswith("entry_points.txt")]
        text = z.read(ep).decode()
    assert "fleetlease = fleetlease.ops.cli:main" in text
    for line in text.splitlines():
        if "=" in line:
            assert line.split("=", 1)[1].strip().startswith("fleetlease."), line


def test_every_subpackage_of_the_tree_is_in_the_wheel(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = (
        subprocess.run(
            ["git", "ls-files", "-z", *PACKAGES], cwd=REPO, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    inits = [n for n in tracked if n.endswith("/__init__.py") and "/migrations/" not in n]
    assert inits
    for init in inits:
        assert f"fleetlease/{init}" in names, f"{init} is not packaged (pyproject packages)"


@pytest.mark.parametrize("pkg", ["actors", "transport", "persistence", "hostagent"])
def test_each_package_names_its_public_surface_and_every_name_resolves(pkg: str) -> None:
    import importlib

    module = importlib.import_module(f"fleetlease.{pkg}")
    assert module.__doc__, f"fleetlease.{pkg} says what it holds"
    names = module.__all__
    assert names, f"fleetlease.{pkg} names its public surface"
    for name in names:
        assert getattr(module, name) is not None, name
