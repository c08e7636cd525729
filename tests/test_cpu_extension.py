"""The C++ CPU kernels are built per x86-64 level and picked at run time, never keyed on the host's flags."""

import pytest

from kvpilot.kernels import cpu_extension

V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "sse2"}
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize("flags,levels", [
    (V4, ["x86-64-v2", "x86-64-v3", "x86-64-v4"]),
    (V3 | {"avx512f"}, ["x86-64-v2", "x86-64-v3"]),  # AVX-512F alone is not v4
    (V3 - {"fma"}, ["x86-64-v2"]),
    ({"sse2"}, ["x86-64"]),
])
def test_levels_follow_the_cpu_flags(monkeypatch, flags, levels):
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: flags)
    assert cpu_extension.supported_levels() == levels
    monkeypatch.delenv(cpu_extension.LEVEL_ENV, raising=False)
    assert cpu_extension.level() == levels[-1]


def test_other_architectures_build_for_the_compilers_default(monkeypatch):
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "aarch64")
    assert cpu_extension.supported_levels() == ["generic"]
    assert cpu_extension._march("generic") == []


def test_a_lower_level_can_be_forced_but_not_a_higher_one(monkeypatch):
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: V3)
    monkeypatch.setenv(cpu_extension.LEVEL_ENV, "x86-64-v2")
    assert cpu_extension.level() == "x86-64-v2"
    monkeypatch.setenv(cpu_extension.LEVEL_ENV, "x86-64-v4")
    with pytest.raises(RuntimeError, match="this CPU runs x86-64-v2, x86-64-v3"):
        cpu_extension.level()


def test_build_key_names_the_level_and_not_the_host(monkeypatch):
    keys = {cpu_extension.build_key(lvl) for lvl in cpu_extension.X86_LEVELS}
    assert len(keys) == 3 and all(k.startswith(f"cpu-{lvl}-") for k, lvl in zip(sorted(keys), cpu_extension.X86_LEVELS))
    before = cpu_extension.build_key("x86-64-v3")
    monkeypatch.setattr(cpu_extension, "_cpu_flags", lambda: {"sse2"})
    assert cpu_extension.build_key("x86-64-v3") == before


def test_prebuilt_directory_is_preferred(monkeypatch, tmp_path):
    """An image's KVPILOT_KERNELS_DIR wins over the cache: the module found there is what loads."""
    lvl = cpu_extension.level()
    built = cpu_extension.require(lvl)  # this host's build (compiled once into the cache)
    image_dir = tmp_path / cpu_extension.build_key(lvl)
    image_dir.mkdir()
    (image_dir / f"{cpu_extension.module_name(lvl)}.so").symlink_to(built.__file__)
    monkeypatch.setenv(cpu_extension.PREBUILT_ENV, str(tmp_path))
    assert cpu_extension.find_prebuilt(lvl) == image_dir / f"{cpu_extension.module_name(lvl)}.so"


def test_kernels_at_this_cpus_level_match_the_references():
    report = cpu_extension.check()
    assert report["level"] == cpu_extension.supported_levels()[-1]
    assert max(report["max_abs_error"].values()) < 1e-4, report
