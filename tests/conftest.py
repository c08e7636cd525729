"""Shared fixtures. Thread settings come first: torch must see them at import (see server/threads.py)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run in its interpreter on CPU tensors here (read when a kernel module is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import stdlib_operator_guard  # noqa: E402,F401  (records the stdlib `operator` before anything else)
from oracle import hf_oracle_session  # noqa: E402,F401  (fixture)


@pytest.fixture(scope="session", autouse=True)
def _stdlib_operator_stays_stdlib():
    yield
    stdlib_operator_guard.check()


@pytest.fixture(scope="session")
def model_path():
    from kvpilot.server.model_files import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gguf_file(model_path):
    from kvpilot.server.gguf_loader import GGUFFile

    return GGUFFile(model_path)


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory, model_path):
    """Tiny random models of each supported family (tests/checkpoint_factory.py): name -> (checkpoint
    directory, GGUF of the same weights)."""
    from checkpoint_factory import CASES, build_checkpoint, save_tokenizer, write_family_gguf

    tokenizer_dir = save_tokenizer(model_path, tmp_path_factory.mktemp("tokenizer"))
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, case in CASES.items():
        directory = build_checkpoint(case, root / name, tokenizer_dir)
        out[name] = (directory, write_family_gguf(directory, model_path, root / f"{name}.gguf"))
    return out


@pytest.fixture(scope="session")
def constrained_server(tmp_path_factory):
    """One `kvpilot serve` for the structured-output and tool-calling tests (their files share it)."""
    from server_harness import serve_for_tests

    yield from serve_for_tests(tmp_path_factory, "--max-model-len", "2048", "--kv-cache-memory", "256MiB")


@pytest.fixture(scope="session")
def constrained_client(constrained_server):
    from openai import OpenAI

    return OpenAI(base_url=constrained_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def lora_peft_case(hf_oracle_session, model_path, tmp_path_factory):  # noqa: F811
    """LoRA adapters made by peft (tests/lora_factory.py) and the oracle's greedy results on the oracle
    prompts: (adapter paths, peft's results per adapter, the base model's results)."""
    import hashlib

    from lora_factory import STEPS, peft_outputs
    from oracle import ORACLE_PROMPTS, OracleResult

    sha = hashlib.sha256(model_path.read_bytes()).hexdigest()
    prompt_ids = [hf_oracle_session.tokenizer(p).input_ids for p in ORACLE_PROMPTS]
    paths, results = peft_outputs(hf_oracle_session.model, sha, prompt_ids, STEPS, tmp_path_factory.mktemp("adapters"))
    base = [OracleResult(r.prompt_ids, r.tokens[:STEPS], r.topk[:STEPS], r.prompt_logprobs) for r in hf_oracle_session.run()]
    return paths, results, base
