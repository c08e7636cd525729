"""`kvpilot serve --engine-core-process` (#45): the scheduler and model runner in a process of their own,
the API process making the text. The server tests run in both modes (test_server_api.py,
test_server_lifecycle.py); these are the split's own: HF equality under preemption, prefix hits,
stop strings ending a sequence that the core still runs, and the core dying mid-stream (LoRA over
HTTP runs in both modes in test_lora.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from oracle import ORACLE_PROMPTS, ORACLE_STEPS
from server_harness import SERVER_MODES, ServerProcess, metrics, serve_for_tests, wait_until_freed

CORE = SERVER_MODES["core-process"]


@pytest.fixture(scope="module")
def small_cache_server(tmp_path_factory):
    """24 blocks of 16 tokens for ten sequences that each grow to 70-110 tokens: preemption is certain
    (the same cache as test_engine_modes.py's preemption test)."""
    yield from serve_for_tests(tmp_path_factory, "--kv-cache-memory", str(25 * 737280), "--block-size", "16", "--max-num-seqs", "16", *CORE)


def complete(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json={"temperature": 0, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_equals_hf_with_preemption_through_the_core_process(small_cache_server, hf_oracle_session, model_path):
    from kvpilot.server.loading import open_model
    from kvpilot.server.tokenizer import IncrementalDetokenizer

    oracle = hf_oracle_session.run()
    _, tokenizer = open_model(model_path)

    def text_of(ids: list[int]) -> str:
        detok = IncrementalDetokenizer(tokenizer)
        for token in ids:
            detok.add(token)
        return detok.text + detok.flush()

    body = lambda prompt: {"prompt": prompt, "max_tokens": ORACLE_STEPS, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(ORACLE_PROMPTS)) as pool:  # all at once: they do not fit the cache together
        outs = list(pool.map(lambda p: complete(small_cache_server.url, body(p)), ORACLE_PROMPTS))
    texts = [o["choices"][0]["text"] for o in outs]
    expected = [text_of(r.tokens) for r in oracle]
    exact = sum(a == b for a, b in zip(texts, expected))
    assert exact >= len(oracle) - 1, [(i, a[:60], b[:60]) for i, (a, b) in enumerate(zip(texts, expected)) if a != b]
    assert all(o["usage"]["completion_tokens"] == ORACLE_STEPS for o in outs)
    m = metrics(small_cache_server.url)
    assert m["kvpilot:num_preemptions_total"] > 0
    assert wait_until_freed(small_cache_server.url)


def test_prefix_hit_through_the_core_process(small_cache_server):
    prompt = "A prefix long enough to fill several blocks of the cache: " + "one two three four five six seven eight " * 6
    first = complete(small_cache_server.url, {"prompt": prompt, "max_tokens": 8})
    before = metrics(small_cache_server.url)
    second = complete(small_cache_server.url, {"prompt": prompt, "max_tokens": 8})
    after = metrics(small_cache_server.url)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    hits = after["kvpilot:prefix_cache_hits_total"] - before["kvpilot:prefix_cache_hits_total"]
    assert hits >= 16 * ((first["usage"]["prompt_tokens"] - 1) // 16) > 0


def test_a_stop_string_ends_the_sequence_in_the_core_too(small_cache_server):
    """The API process finds stop strings; the sequence it ends must stop running in the core (its
    blocks freed at once), not run on to max_tokens."""
    url = small_cache_server.url
    full = complete(url, {"prompt": "1, 2, 3, 4,", "max_tokens": 12})["choices"][0]["text"]
    assert " 6" in full
    started = time.monotonic()
    cut = complete(url, {"prompt": "1, 2, 3, 4,", "max_tokens": 200, "ignore_eos": True, "stop": [" 6"]})["choices"][0]
    assert cut["text"] == full[: full.index(" 6")] and cut["finish_reason"] == "stop" and cut["stop_reason"] == " 6"
    assert wait_until_freed(url, timeout=5) and time.monotonic() - started < 15
    # n = 2, sampled: a stop string that only one sequence's text holds ends that one; the other runs on.
    kw = {"prompt": "My favourite animal is", "max_tokens": 16, "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True}
    a, b = (c["text"] for c in sorted(complete(url, kw)["choices"], key=lambda c: c["index"]))
    word = next(w for w in a.split() if w not in b and len(w) > 2)
    stopped = sorted(complete(url, {**kw, "stop": [word]})["choices"], key=lambda c: c["index"])
    assert stopped[0]["text"] == a[: a.index(word)] and stopped[0]["finish_reason"] == "stop"
    assert stopped[1]["text"] == b and stopped[1]["finish_reason"] == "length"
    assert wait_until_freed(url)


def test_a_dead_core_fails_open_streams_and_the_server_exits_non_zero(tmp_path):
    termination = tmp_path / "termination-log"
    termination.write_text("")
    s = ServerProcess("--kv-cache-memory", "64MiB", *CORE, env={"KVPILOT_TERMINATION_LOG": str(termination)},
                      log_path=tmp_path / "log").wait_ready()
    try:
        core = core_pid(s)
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 5:
                        os.kill(core, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine core process died" in error["message"] and error["type"] == "service_unavailable_error"
        assert s.proc.wait(30) != 0
        assert "engine core process died (exit code -9)" in termination.read_text()
        assert "engine core process died" in s.log()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def core_pid(server: ServerProcess) -> int:
    return int(subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout.split()[0])


def test_a_hung_core_fails_the_probes_only_while_requests_wait_on_it(tmp_path):
    """A stopped engine core (SIGSTOP) left /health and /ready at 200 while every request hung (issue
    #75). Idle, a stopped core is not a stalled one; with a request open and no sign of the core for
    --engine-stall-timeout-seconds, both probes answer 503 engine_stalled; resumed, it serves again."""
    s = ServerProcess("--kv-cache-memory", "64MiB", "--engine-stall-timeout-seconds", "3", *CORE, log_path=tmp_path / "log").wait_ready()
    core = core_pid(s)
    probe = lambda path: httpx.get(s.url + path, timeout=10)
    try:
        assert probe("/health").status_code == 200
        os.kill(core, signal.SIGSTOP)
        time.sleep(4)
        assert probe("/health").status_code == 200 and probe("/ready").status_code == 200  # idle: nothing waits on it
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(httpx.post(s.url + "/v1/completions", timeout=120, json={
            "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})))
        waiting.start()
        time.sleep(1)
        assert probe("/health").status_code == 200  # within the timeout
        deadline = time.monotonic() + 30
        while probe("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        health, ready = probe("/health"), probe("/ready")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled", health.text
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_stalled"
        assert not answers
        os.kill(core, signal.SIGCONT)
        waiting.join(60)
        assert answers and answers[0].status_code == 200, answers
        assert probe("/health").status_code == 200
    finally:
        os.kill(core, signal.SIGCONT)
        assert s.terminate() == 0


def test_the_core_exits_when_the_server_process_is_killed(tmp_path):
    """Killed mid-stream (SIGKILL: no drain, no Shutdown), the server leaves no engine core behind."""
    s = ServerProcess("--kv-cache-memory", "64MiB", *CORE, log_path=tmp_path / "log").wait_ready()
    core = core_pid(s)
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with pytest.raises(httpx.HTTPError), httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 10:
                s.proc.kill()
    s.proc.wait(10)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{core}").exists()


def test_a_core_that_cannot_load_is_a_clear_error(tmp_path):
    kvpilot = str(Path(sys.executable).parent / "kvpilot")
    missing = subprocess.run([kvpilot, "serve", *CORE, "--num-threads", "1", "--model", str(tmp_path / "nothing.gguf")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "the engine core failed to start" in missing.stderr and "nothing.gguf" in missing.stderr
