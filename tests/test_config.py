"""EngineConfig: one model for CLI, LLM(**kwargs) and the operator; torch-free imports."""

import subprocess
import sys

import pytest

from kvpilot.server.config import EngineConfig, parse_size


def test_cli_roundtrip_non_defaults():
    c = EngineConfig(model="/models/x.gguf", served_model_name="x", max_model_len=4096, max_num_seqs=8,
                     max_num_batched_tokens=512, block_size=32, enable_prefix_caching=False,
                     enable_chunked_prefill=True, kv_cache_memory="256MiB", dtype="float16", seed=7, num_threads=1)
    args = c.to_cli_args()
    assert "--no-enable-prefix-caching" in args and "--max-num-seqs" in args
    assert EngineConfig.from_cli_args(args) == c


def test_cli_roundtrip_all_fields_explicit():
    c = EngineConfig()
    assert c.to_cli_args() == []
    full = c.to_cli_args(include_defaults=True)
    assert EngineConfig.from_cli_args(full) == c
    assert "--kv-cache-memory" in full and "--enable-chunked-prefill" in full


@pytest.mark.parametrize("text,value", [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1G", 10**9), ("1048576", 1048576), (4096, 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("kwargs,field", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"block_size": 0}, "block_size"), ({"dtype": "int3"}, "dtype"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"), ({"bogus": 1}, "bogus"),
    ({"max_model_len": 4096, "max_num_batched_tokens": 512, "enable_chunked_prefill": False}, "max_num_batched_tokens"),
    ({"kv_cache_dtype": "float8"}, "kv_cache_dtype"), ({"kv_cache_dtype": "float32", "dtype": "bfloat16"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "bfloat16", "dtype": "float16"}, "kv_cache_dtype"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_cli_flags_are_the_config_fields():
    from kvpilot.server.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for name in EngineConfig.model_fields:
        assert "--" + name.replace("_", "-") in help_text


@pytest.mark.parametrize("module", ["kvpilot.server.config", "kvpilot.operator", "kvpilot.server"])
def test_import_does_not_pull_torch(module):
    code = f"import sys, {module}; bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{module} imports {r.stdout.strip()} {r.stderr[-500:]}"


def test_lazy_exports():
    code = "import sys; from kvpilot.server import LLM, SamplingParams; print(LLM.__name__, SamplingParams.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["LLM", "SamplingParams"], r.stderr[-500:]


def test_thread_settings_applied_before_torch():
    code = ("from kvpilot.server.threads import configure_threads; configure_threads(1); import os, torch; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], torch.get_num_threads())")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.split() == ["PASSIVE", "20000", "1"], r.stderr[-500:]
