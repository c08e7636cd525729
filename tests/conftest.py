"""Shared fixtures. Thread settings come first: torch must see them at import (see server/threads.py)."""

import gc
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NIXL's UCX (prefill/decode tests): over the loopback device only (its TCP transport would use every interface)
os.environ.setdefault("UCX_NET_DEVICES", "lo")
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


@pytest.fixture
def row_invariant_gguf_kernels(monkeypatch):
    """Pins the C++ GGUF kernels to their AVX2 path where the CPU has better ones. The AVX-512 paths depend on
    a call's row count — AMX tiles from gguf_amx_min_rows rows on (both operands split into bfloat16s), a
    factored float path at one or two rows —, so a row's outputs can differ in the last bits between a big
    batch and a small one; the AVX2 path does the same arithmetic per row at any count. Tests that compare a
    row across batch sizes (a prefix hit against its miss, a row alone against it in a batch) use this."""
    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.quantized import GGUF_ISA_ENV

    if cpu_extension.require().gguf_linear_isa() in ("amx", "avx512-vnni", "avx512"):
        monkeypatch.setenv(GGUF_ISA_ENV, "avx2")


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


_module_rss: list[tuple[str, int]] = []  # (test module, the pytest process's RSS after it, bytes)
COLLECT_ABOVE = 3 << 30  # RSS (bytes) past which a test's end runs a full collection


def _rss() -> int:
    with open("/proc/self/statm") as f:  # Linux, as CI: resident pages are the second field
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _collect_when_big():
    """Engines a test left in reference cycles (a spy on a runner's method holds the runner) wait for a
    full collection, ~1 GiB each: a module of such tests reached 8.6 GiB and, beside the other worker,
    the OOM killer. Collected after any test that leaves the process above COLLECT_ABOVE (most leave it
    below: no cost there)."""
    yield
    if _rss() > COLLECT_ABOVE:
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _collect_after_each_module(request):
    """Each module's engines go when it ends, even those a cycle holds (a full collection is ~0.1 s: per
    module, not per test), and the RSS left after it is recorded: a suite that outgrows the machine
    names the modules that grew it (in the terminal summary), instead of dying to the OOM killer."""
    yield
    gc.collect()
    _module_rss.append((request.module.__name__, _rss()))


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its modules' RSS to the controller, which prints the summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["module_rss"] = _module_rss


def pytest_testnodedown(node, error):
    """On the pytest-xdist controller: a worker's modules' RSS (each worker is its own process)."""
    _worker_rss.append((node.gateway.id, getattr(node, "workeroutput", {}).get("module_rss", [])))  # none from a worker that died


_worker_rss: list[tuple[str, list[tuple[str, int]]]] = []


def pytest_terminal_summary(terminalreporter):
    for worker, rss in _worker_rss or [("pytest process", _module_rss)]:
        if len(rss) < 2:
            continue
        growth = sorted(((after - before, name) for (_, before), (name, after) in zip(rss, rss[1:])), reverse=True)
        peak = max(size for _, size in rss)
        terminalreporter.write_line(f"memory: {worker} RSS {peak / 2**30:.1f} GiB at most after a module; most growth: "
                                    + ", ".join(f"{name} {delta / 2**20:+.0f} MiB" for delta, name in growth[:5]))
