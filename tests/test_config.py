"""EngineConfig: one model for CLI, LLM(**kwargs) and the operator; torch-free imports."""

import json
import re
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


# --- vLLM's flag names and value spellings (issue #61) ---

def _serve_configs(args: list[str]):
    """(EngineConfig, ServerConfig) that `kvpilot serve ARGS` would run with (the CLI's path: parse, aliases, models)."""
    from kvpilot.server.cli import _positional_model, build_parser, resolve_vllm_aliases
    from kvpilot.server.config import ServerConfig, bare_switches

    parser = build_parser()
    ns = parser.parse_args(bare_switches(["serve", *args]))
    _positional_model(parser, ns)
    resolve_vllm_aliases(ns)
    engine = EngineConfig(**{k: getattr(ns, k) for k in EngineConfig.model_fields if getattr(ns, k, None) is not None})
    server = ServerConfig(**{k: getattr(ns, k) for k in ServerConfig.model_fields if getattr(ns, k, None) is not None})
    return engine, server


VLLM_SPELLINGS = [  # (vLLM's spelling, kvpilot's own)
    (["--dtype", "half"], ["--dtype", "float16"]),
    (["--dtype", "float"], ["--dtype", "float32"]),
    (["--async-scheduling"], ["--async-scheduling", "on"]),
    (["--no-async-scheduling"], ["--async-scheduling", "off"]),
    (["--kv-cache-memory-bytes", "2147483648"], ["--kv-cache-memory", "2GiB"]),
    (["--kv-cache-memory-bytes", "512M"], ["--kv-cache-memory", "512MiB"]),  # vLLM: upper case = binary
    (["--kv-cache-memory-bytes", "2g"], ["--kv-cache-memory", "2G"]),        # lower case = decimal
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 3}'],
     ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-max", "5", "--prompt-lookup-min", "3"]),
    (["--speculative-config", '{"method": "draft_model", "model": "/models/draft.gguf", "num_speculative_tokens": 2}'],
     ["--speculative-method", "draft", "--speculative-model", "/models/draft.gguf", "--num-speculative-tokens", "2"]),
    (["--speculative-config", '{"model": "/models/draft.gguf"}'], ["--speculative-method", "draft", "--speculative-model", "/models/draft.gguf"]),
    (["--speculative-config", '{"method": "eagle3", "model": "/heads/e3", "disable_by_batch_size": 8}'],
     ["--speculative-method", "eagle3", "--speculative-model", "/heads/e3", "--speculative-disable-batch-size", "8"]),
    (["-tp", "2", "--speculative-config", '{"model": "/models/draft.gguf", "draft_tensor_parallel_size": 1}'],
     ["--tensor-parallel-size", "2", "--speculative-method", "draft", "--speculative-model", "/models/draft.gguf",
      "--speculative-draft-tensor-parallel-size", "1"]),
    (["--speculative-config", '{"model": "/heads/eagle3-x", "draft_tensor_parallel_size": 1}'],  # vLLM's EAGLE examples' value
     ["--speculative-method", "eagle3", "--speculative-model", "/heads/eagle3-x", "--speculative-draft-tensor-parallel-size", "1"]),
    (["-tp", "2"], ["--tensor-parallel-size", "2"]),
    (["-q", "int8"], ["--quantization", "int8"]),
    (["--model", "org/repo", "--revision", "v2"], ["--model", "org/repo@v2"]),  # a hub repository id's revision
    (["--max-model-len", "32k"], ["--max-model-len", "32000"]),
    (["--max-model-len", "32K"], ["--max-model-len", "32768"]),
    (["--max-num-batched-tokens", "8K"], ["--max-num-batched-tokens", "8192"]),
    (["--model", "/models/x.gguf", "--tokenizer", "/models/x.gguf"], ["--model", "/models/x.gguf"]),
    (["--disable-prefix-caching"], ["--no-enable-prefix-caching"]),           # vLLM 0.33's spellings of the --no- forms
    (["--disable-chunked-prefill"], ["--no-enable-chunked-prefill"]),
    (["--spec-method", "draft_model", "--spec-model", "/models/d.gguf", "--spec-tokens", "3"],
     ["--speculative-method", "draft", "--speculative-model", "/models/d.gguf", "--num-speculative-tokens", "3"]),
    (["--device-memory-utilization", "0.5"], ["--gpu-memory-utilization", "0.5"]),
    (["--kv-offloading-size", "8", "--kv-offloading-backend", "native"], ["--kv-host-offload-size", "8GiB"]),
    (["--kv-offloading-size", "0.5"], ["--kv-host-offload-size", "512MiB"]),
]


@pytest.mark.parametrize("vllm,own", VLLM_SPELLINGS, ids=lambda a: " ".join(a)[:60])
def test_vllm_spelling_is_the_same_config(vllm, own):
    expected = EngineConfig.from_cli_args(own)
    assert expected != EngineConfig() or own == ["--model", "/models/x.gguf"]  # each row changes something
    assert EngineConfig.from_cli_args(vllm) == expected
    assert _serve_configs(vllm) == _serve_configs(own)


def test_vllm_spellings_in_python_too():
    assert EngineConfig(dtype="half") == EngineConfig(dtype="float16")
    assert EngineConfig(max_model_len="4K").max_model_len == 4096
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}) == \
        EngineConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=5)  # as vLLM's LLM
    assert EngineConfig(kv_cache_memory_bytes="4G") == EngineConfig(kv_cache_memory="4GiB")


def test_a_bare_switch_before_the_positional_model():
    assert _serve_configs(["--async-scheduling", "/models/x.gguf"]) == _serve_configs(["/models/x.gguf", "--async-scheduling", "on"])
    assert _serve_configs(["--async-scheduling", "off", "/models/x.gguf"])[0].async_scheduling == "off"


def test_enable_auto_tool_choice_needs_a_parser():
    assert _serve_configs(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == _serve_configs(["--tool-call-parser", "hermes"])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice: needs --tool-call-parser"):
        _serve_configs(["--enable-auto-tool-choice"])


@pytest.mark.parametrize("args,refusal", [
    (["--tokenizer", "/models/other"], "--tokenizer: not supported"),
    (["--revision", "main"], "--revision: only for a Hugging Face Hub repository id"),
    (["--model", "org/repo@v1", "--revision", "v2"], "--revision v2: the model names revision v1 already"),
    (["--kv-offloading-size", "8", "--kv-offloading-backend", "lmcache"], "--kv-offloading-backend: 'lmcache' not supported"),
    (["--kv-offloading-backend", "native"], "--kv-offloading-backend: needs --kv-offloading-size"),
    (["--spec-method", "mtp"], "--spec-method: 'mtp' not supported"),
    (["--speculative-config", '{"method": "ngram", "acceptance_method": "typical"}'], "--speculative-config: acceptance_method not supported"),
    (["--speculative-config", '{"method": "medusa", "model": "m"}'], "--speculative-config: method 'medusa' not supported"),
    (["--speculative-config", "ngram"], "--speculative-config: not JSON"),
    (["-tp", "2", "--speculative-config", '{"model": "/models/draft.gguf", "draft_tensor_parallel_size": 3}'],
     "speculative_draft_tensor_parallel_size=3: a draft model is split over all tensor_parallel_size=2 ranks or kept whole on rank 0 (1)"),
    (["--speculative-config", '{"model": "/heads/eagle3-x", "draft_tensor_parallel_size": 3}'],
     "speculative_draft_tensor_parallel_size=3 with speculative_method=eagle3: an EAGLE-3 head (one layer) runs whole on rank 0"),
    (["--speculative-config", '{"method": "ngram", "draft_tensor_parallel_size": 1}'],
     "speculative_draft_tensor_parallel_size is only used with speculative_method=draft or eagle3"),
    (["--kv-cache-memory-bytes", "1G", "--kv-cache-memory", "2GiB"], "--kv-cache-memory-bytes sets --kv-cache-memory"),
    (["--speculative-config", '{"method": "ngram"}', "--speculative-method", "draft"], "--speculative-config sets --speculative-method"),
])
def test_vllm_flags_kvpilot_cannot_honour_are_refused_by_name(args, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        _serve_configs(args)


def test_bad_values_are_errors_naming_the_flag(capsys):
    from pydantic import ValidationError

    from kvpilot.server.cli import main
    from kvpilot.server.config import flag_error

    with pytest.raises(ValidationError) as e:
        EngineConfig(max_num_seqs=0)
    assert flag_error(e.value) == "--max-num-seqs: must be >= 1"
    with pytest.raises(ValidationError) as e:
        EngineConfig(speculative_method="draft")
    assert flag_error(e.value) == "--speculative-method=draft needs --speculative-model (a model sharing the target's tokenizer)"
    assert main(["generate", "hi", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert "kvpilot: error: --max-num-seqs: must be >= 1" in err and "max_num_seqs" not in err and "pydantic" not in err
    with pytest.raises(SystemExit):
        main(["serve", "--dtype", "int3"])
    assert "argument --dtype: invalid choice: 'int3'" in capsys.readouterr().err


def test_config_file_then_command_line_overrides(tmp_path):
    from kvpilot.server.cli import build_parser, with_config_file

    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 8\ndtype: half\nenable_prefix_caching: false\nno-async-scheduling: true\n"
                      "speculative_config: {method: ngram, num_speculative_tokens: 3}\nkv-cache-memory: 256MiB\nport: 9000\n")
    argv = with_config_file(build_parser(), ["serve", "--config", str(config), "--max-num-seqs", "4"])
    engine, server = _serve_configs(argv[1:])
    assert (engine.max_num_seqs, engine.dtype, engine.enable_prefix_caching, engine.async_scheduling) == (4, "float16", False, "off")
    assert (engine.speculative_method, engine.num_speculative_tokens, engine.kv_cache_memory, server.port) == ("ngram", 3, 256 << 20, 9000)
    config.write_text("max-num-seqs: 8\nmax-num-sequences: 4\n")
    with pytest.raises(ValueError, match="max-num-sequences is no flag of kvpilot serve"):
        with_config_file(build_parser(), ["serve", "--config", str(config)])


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    from kvpilot.server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kvpilot {version('kvpilot')}"


def test_help_is_grouped_with_choices_and_one_default_each():
    from kvpilot.server.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    titles = {g.title for g in serve._action_groups}
    assert {"model", "cache", "scheduling", "speculative decoding", "LoRA", "server"} <= titles
    text = serve.format_help()
    assert "{auto,float32,float16,bfloat16,half,float}" in text and "{fcfs,priority}" in text
    assert "(default: 1GiB)" in " ".join(text.split())  # --kv-cache-memory, a size, written as one
    for action in serve._actions:
        if action.help and action.option_strings:
            assert action.help.count("(default:") <= 1, action.option_strings


def test_generation_config_defaults_reach_the_sampling_params(tmp_path):
    import json

    from kvpilot.server.api.protocol import ChatCompletionRequest, CompletionRequest
    from kvpilot.server.config import ServerConfig, generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 77,
         "do_sample": True, "eos_token_id": 2}))
    defaults = generation_defaults("auto", str(tmp_path))  # a checkpoint directory
    assert defaults == generation_defaults("auto", str(tmp_path / "model.gguf")) == generation_defaults(str(tmp_path), None)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = chat.with_defaults(defaults).params()  # max_new_tokens: a cap applied once the prompt's length is known (over HTTP below)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, None)
    nulled = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=None)
    assert nulled.with_defaults(defaults).params().temperature == 0.6  # an explicit null is unset, as vLLM reads it
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0, top_k=0, max_completion_tokens=5)
    p = given.with_defaults(defaults).params()
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.0, 0, 0.9, 5)  # what a request sets wins
    completion = CompletionRequest(prompt="hi").with_defaults(defaults).params()
    assert completion.temperature == 0.6 and completion.max_tokens == 16  # completions' own default stays (vLLM's)
    for bad in ({"temperature": "hot"}, {"top_p": float("nan")}, [1]):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="--generation-config"):
            generation_defaults("auto", str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                                 "repetition_penalty": 1.1, "max_new_tokens": 77}))
    assert generation_defaults("vllm", str(tmp_path)) == {}  # --generation-config vllm: none
    p = chat.with_defaults(generation_defaults("vllm", str(tmp_path))).params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, None)
    assert ServerConfig(generation_config=str(tmp_path)).generation_config == str(tmp_path)
    with pytest.raises(ValueError, match="generation_config"):
        ServerConfig(generation_config=str(tmp_path / "missing"))


def test_chat_template_is_a_file_or_a_template(tmp_path):
    from kvpilot.server.config import ServerConfig, load_chat_template

    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == load_chat_template("{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="not a file and not a Jinja template"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_and_generation_config_reach_the_server(tmp_path):
    """--chat-template replaces the model's template and --generation-config's defaults apply to requests over HTTP
    (the bundled model, in process)."""
    import json

    from fastapi.testclient import TestClient

    from kvpilot.server.api.app import build_app, create_state
    from kvpilot.server.config import ServerConfig

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4000, "temperature": 0.0}))
    config = EngineConfig(kv_cache_memory="16MiB", num_threads=1, max_num_seqs=2, max_model_len=512)
    state = create_state(config,
                         ServerConfig(chat_template="{{ messages[0]['content'] }} says the template", generation_config=str(tmp_path)),
                         show_progress=False)
    try:
        client = TestClient(build_app(state))
        rendered = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]}).json()
        plain = client.post("/tokenize", json={"prompt": "Hello says the template"}).json()
        assert rendered["tokens"][-4:] == plain["tokens"][-4:] and rendered["count"] == plain["count"]
        # max_new_tokens 4000 is past the context (336 tokens: this KV cache's): a cap at what the prompt leaves, not a 400 (vLLM's)
        long_prompt = "word " * 300
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_prompt}], "ignore_eos": True}).json()
        assert chat["choices"][0]["finish_reason"] == "length", chat
        assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == state.serving.max_model_len < 4000
        # the capacity the operator works out from what it knows of the model (kv_layout.py), the file's layout
        from kvpilot.server.gguf_loader import GGUFFile
        from kvpilot.server.kv_layout import KVLayout, capacity_tokens
        from kvpilot.server.model_files import BUNDLED, resolve_model_path

        layout = BUNDLED["smollm2-135m"].kv_layout
        assert KVLayout.of(GGUFFile(resolve_model_path("smollm2-135m")).config) == layout
        assert capacity_tokens(layout, config) == state.serving.max_model_len == 336
        given = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}).json()
        assert given["usage"]["completion_tokens"] == 3
    finally:
        state.engine.stop()
        state.serving.pool.shutdown()


def test_config_file_list_flag_does_not_take_the_positional_model(tmp_path):
    """A list flag last in --config's file (lora_modules: [...]) must not take `serve MODEL`'s MODEL for one of its values:
    the file's flags go after the subcommand's positionals, as vLLM inserts them."""
    from kvpilot.server.cli import build_parser, with_config_file

    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 8\nlora_modules: [a=/x]\n")
    for argv in (["serve", "/models/x.gguf", "--config", str(config)], ["serve", "--config", str(config), "/models/x.gguf"],
                 ["serve", "--port", "9000", "/models/x.gguf", "--config", str(config)]):
        ns = _serve_namespace(with_config_file(build_parser(), argv))
        assert (ns.model, ns.lora_modules, ns.max_num_seqs) == ("/models/x.gguf", ["a=/x"], "8"), argv
    ns = _serve_namespace(with_config_file(build_parser(), ["generate", "/models/x.gguf", "hi", "--config", str(config)]))
    assert (ns.model, ns.prompt, ns.lora_modules) == ("/models/x.gguf", "hi", ["a=/x"])


def _serve_namespace(argv):
    from kvpilot.server.cli import _positional_model, build_parser
    from kvpilot.server.config import bare_switches

    parser = build_parser()
    ns = parser.parse_args(bare_switches(argv))
    _positional_model(parser, ns)
    return ns


def test_config_file_switch_strings_and_nested_config(tmp_path):
    from kvpilot.server.cli import build_parser, with_config_file

    config = tmp_path / "serve.yaml"
    config.write_text('enable-prefix-caching: "false"\nenable_log_requests: "True"\n')
    ns = _serve_namespace(with_config_file(build_parser(), ["serve", "/models/x.gguf", "--config", str(config)]))
    assert (ns.model, ns.enable_prefix_caching, ns.enable_log_requests) == ("/models/x.gguf", False, True)
    config.write_text('enable-prefix-caching: "maybe"\n')
    with pytest.raises(ValueError, match="enable-prefix-caching is a switch: true or false, not 'maybe'"):
        with_config_file(build_parser(), ["serve", "/models/x.gguf", "--config", str(config)])
    config.write_text("config: other.yaml\n")
    with pytest.raises(ValueError, match="sets config \\(a config file naming another is not supported\\)"):
        with_config_file(build_parser(), ["serve", "--config", str(config)])


def test_pyyaml_is_an_engine_dependency():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"pyyaml\b", d, re.IGNORECASE) for d in project["optional-dependencies"]["engine"])


@pytest.mark.parametrize("spec,fields", [
    ({"method": "ngram", "prompt_lookup_max": 3}, {"prompt_lookup_min": 3, "prompt_lookup_max": 3}),   # vLLM mirrors the one given
    ({"method": "ngram", "prompt_lookup_min": 6}, {"prompt_lookup_min": 6, "prompt_lookup_max": 6}),
    ({"method": "ngram"}, {"prompt_lookup_min": 5, "prompt_lookup_max": 5}),                          # vLLM's defaults
    ({"model": "[ngram]", "num_speculative_tokens": 3}, {"speculative_method": "ngram", "num_speculative_tokens": 3}),
    ({"model": "/heads/Qwen3-8B_eagle3"}, {"speculative_method": "eagle3", "speculative_model": "/heads/Qwen3-8B_eagle3"}),
    ({"model": "/models/draft.gguf"}, {"speculative_method": "draft", "speculative_model": "/models/draft.gguf"}),
])
def test_speculative_config_means_what_vllm_makes_of_it(spec, fields):
    config = EngineConfig.from_cli_args(["--speculative-config", json.dumps(spec)])
    assert {k: getattr(config, k) for k in fields} == fields


def test_speculative_config_ngram_defaults_leave_kvpilots_own_flags():
    config = EngineConfig.from_cli_args(["--speculative-config", '{"method": "ngram"}', "--prompt-lookup-max", "3"])
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)


@pytest.mark.parametrize("spec,refusal", [
    ('{"method": ["x"]}', "--speculative-config: method must be a string"),
    ('{"method": "ngram", "prompt_lookup_max": "3"}', "--speculative-config: prompt_lookup_max must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "--speculative-config: num_speculative_tokens must be an integer"),
    ('{"num_speculative_tokens": 2}', '--speculative-config: needs "method"'),
    ('{"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}', "--speculative-config: method 'eagle' (vLLM's method for model"),
])
def test_speculative_config_bad_types_are_value_errors(spec, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        EngineConfig.from_cli_args(["--speculative-config", spec])


@pytest.mark.parametrize("args,refusal", [
    (["--kv-offloading-size", "inf"], "--kv-offloading-size: must be a finite positive number of GiB"),
    (["--kv-offloading-size", "nan"], "--kv-offloading-size: must be a finite positive number of GiB"),
    (["--kv-offloading-size", "-1"], "--kv-offloading-size: must be a finite positive number of GiB"),
    (["--kv-transfer-config", '{"kv_connector": "KVPilotNixlConnector", "kv_connector_extra_config": {"port": 1e999}}'],
     "kv_connector_extra_config port must be an integer"),
    (["--kv-transfer-config", '{"kv_connector": "KVPilotNixlConnector", "kv_connector_extra_config": {"timeout": [1]}}'],
     "kv_connector_extra_config timeout must be a finite number"),
    (["--kv-transfer-config", '{"kv_connector": "KVPilotTiersConnector", "kv_connector_extra_config": {"host_size": [1]}}'],
     "not a size"),
])
def test_odd_numbers_are_value_errors_naming_the_flag(args, refusal):
    from kvpilot.server.config import flag_error

    with pytest.raises(ValueError) as e:  # not OverflowError or TypeError (a traceback)
        EngineConfig.from_cli_args(args)
    assert refusal in flag_error(e.value)


def test_flag_error_leaves_file_names_alone():
    from pydantic import ValidationError

    from kvpilot.server.config import ServerConfig, flag_error

    with pytest.raises(ValidationError) as e:
        ServerConfig(generation_config="/no/such/generation_config")
    message = flag_error(e.value)
    assert message.startswith("--generation-config: ") and "(with generation_config.json)" in message
    assert "/no/such/generation_config'" in message and "--generation-config.json" not in message
    with pytest.raises(ValidationError) as e:
        ServerConfig(allow_runtime_lora=True)
    assert "--allow-runtime-lora needs --lora-dir" in flag_error(e.value)


def test_auto_tool_choice_off_is_refused_and_tokenizer_is_no_model_flag():
    from kvpilot.server.vllm_compat import equivalent, kvpilot_serve_parser

    with pytest.raises(ValueError, match="--no-enable-auto-tool-choice: not supported"):
        _serve_configs(["--no-enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    serve = kvpilot_serve_parser()
    assert "requires `--tool-call-parser`" in equivalent("--enable-auto-tool-choice", serve)
    assert " = " not in equivalent("--enable-auto-tool-choice", serve) and " = " not in equivalent("--tokenizer", serve)
    assert "only the model's own tokenizer" in equivalent("--tokenizer", serve)
    assert "by default (vLLM 0.33 does not)" in equivalent("--enable-log-requests", serve)
    assert "Hub repository id (ORG/REPO[@REVISION]" in EngineConfig.model_fields["model"].description


def test_kv_cache_memory_bytes_on_a_gpu_is_the_kv_cache_size():
    config = EngineConfig.from_cli_args(["--kv-cache-memory-bytes", "1G", "--device", "cuda"])
    assert (config.kv_cache_memory, config.device) == (1 << 30, "cuda")
    from kvpilot.server.vllm_compat import kvpilot_serve_parser

    assert "on a GPU, the KV cache's size" in kvpilot_serve_parser()._option_string_actions["--kv-cache-memory-bytes"].help
