"""The built wheel holds every sub-package of server/, kernels/, operator/ as kvpilot.*, and no
top-level `operator` (that name is the stdlib module)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"server": "kvpilot/server", "kernels": "kvpilot/kernels", "operator": "kvpilot/operator"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=240, cwd=build)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = out.glob("kvpilot-*.whl")
    return zipfile.ZipFile(whl)


def source_modules() -> set[str]:
    mods = set()
    for folder, prefix in FOLDERS.items():
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in py.parts:
                mods.add(f"{prefix}/{py.relative_to(ROOT / folder).as_posix()}")
    return mods


def test_wheel_has_every_module(wheel):
    in_wheel = {n for n in wheel.namelist() if n.endswith(".py")}
    missing = source_modules() - in_wheel
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    assert len(source_modules()) > 20  # the walk found the real tree


def test_wheel_has_kernel_sources(wheel):
    """The CPU attention kernel is compiled from its source at setup time, also from an installed wheel."""
    assert {"kvpilot/kernels/csrc/paged_attention_cpu.cpp", "kvpilot/kernels/csrc/layers_cpu.cpp"} <= set(wheel.namelist())


def test_wheel_has_the_engine_flag_snapshots(wheel):
    """The operator checks vLLM/SGLang extraArgs against them at run time: they ship with it."""
    snapshots = {f"kvpilot/operator/builders/engine_flags/{p.name}" for p in (ROOT / "operator" / "builders" / "engine_flags").glob("*.json")}
    assert len(snapshots) >= 2 and snapshots <= set(wheel.namelist())


def test_wheel_has_no_top_level_operator(wheel):
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert "operator" not in tops and "operator.py" not in tops
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvpilot"}


def test_no_tests_inside_packages():
    for folder in FOLDERS:
        found = [p for p in (ROOT / folder).rglob("*.py") if p.name.startswith("test_") or p.name == "conftest.py"]
        assert not found, found


def test_console_script(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    assert "kvpilot = kvpilot.server.cli:main" in wheel.read(ep).decode()
