"""The images `make images` built (a phase of `make test` before pytest), as shipped: non-root, the
operator's without torch, the engine's with a C compiler (Triton compiles at run time) and with its
prebuilt CPU kernels loading and matching the torch references at every level this CPU runs (and
present, compiled for their level and refused by name at the levels above it).
The full path — operator, gateway and engine pods from these images — is e2e/test_quickstart.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from e2e.pod_runner import podman
from kvpilot.kernels import cpu_extension

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
ENGINE, OPERATOR = f"kvpilot/engine:{VERSION}", f"kvpilot/operator:{VERSION}"


def run(image: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`argv` in a throwaway container of `image`: no network, read-only root, as the image's user."""
    flags = [f for k, v in (env or {}).items() for f in ("-e", f"{k}={v}")]
    return subprocess.run([*podman(), "run", "--rm", "--network", "none", "--read-only", *flags, "--entrypoint", argv[0], image, *argv[1:]],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def built():
    for image in (ENGINE, OPERATOR):
        assert subprocess.run([*podman(), "image", "exists", image], timeout=60).returncode == 0, f"{image} not built: run `make images`"


@pytest.mark.parametrize("image", [ENGINE, OPERATOR])
def test_images_run_as_the_non_root_user(image):
    assert subprocess.run([*podman(), "image", "inspect", "--format", "{{.Config.User}}", image],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip() == "65532:65532"
    assert run(image, "id", "-u").stdout.strip() == "65532"


def test_operator_image_has_no_torch_and_both_entry_points():
    r = run(OPERATOR, "python", "-c", "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('kopf') is not None)")
    assert r.stdout.split() == ["True", "True"], r.stderr
    assert "--hold-timeout-seconds" in run(OPERATOR, "kvpilot-gateway", "--help").stdout


def test_engine_image_keeps_a_c_compiler_for_triton():
    r = run(ENGINE, "python", "-c", "import shutil, triton; print(shutil.which('gcc') is not None, triton.__version__)")
    assert r.returncode == 0 and r.stdout.split()[0] == "True", r.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("level", cpu_extension.X86_LEVELS)
def test_engine_image_kernels_load_prebuilt_and_match_the_references(level):
    """Each level's prebuilt kernels: on a level this CPU runs, loaded from the image (nothing compiled)
    and equal to the torch references; on a level above it (x86-64-v4 on an AVX2-only CPU), present in
    the image, compiled to AVX-512 code (zmm registers), and refused here by name rather than run into
    an illegal instruction."""
    env = {cpu_extension.LEVEL_ENV: level}
    if level not in cpu_extension.supported_levels():
        where = run(ENGINE, "python", "-c", f"from kvpilot.kernels import cpu_extension as c; print(c.find_prebuilt({level!r}))")
        assert where.returncode == 0 and where.stdout.strip().startswith("/opt/kvpilot/kernels/cpu-" + level), where.stdout + where.stderr
        so = where.stdout.strip()
        code = run(ENGINE, "sh", "-c", f"objdump -d --no-show-raw-insn {so} | grep -c zmm")
        assert int(code.stdout.strip() or 0) > 100, code.stdout + code.stderr
        refused = run(ENGINE, "python", "-m", "kvpilot.kernels.cpu_extension", "--check", env=env)
        assert refused.returncode == 1 and f"{cpu_extension.LEVEL_ENV}={level!r}: this CPU runs" in refused.stderr, refused.stderr[-2000:]
        return
    r = run(ENGINE, "python", "-m", "kvpilot.kernels.cpu_extension", "--check", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    assert report["level"] == level and report["file"].startswith("/opt/kvpilot/kernels/cpu-" + level), report
    assert "compiling" not in r.stderr  # found in the image: nothing was built at run time
    assert max(report["max_abs_error"].values()) < 1e-4, report
