"""A replica as a group of pods (the engine's side of LeaderWorkerSet groups): `kvpilot serve` as the
leader and `kvpilot serve-worker` as the other pod, here two processes on loopback (a pod each), the
two pipeline stages one per pod. The group serves HF's greedy tokens; the worker pod answers /ready
once the group joined; a pod that dies stops the leader with its cause; a pod that never comes is
named when the leader gives up waiting; a worker pod without a leader stops with that cause."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from oracle import ORACLE_PROMPTS
from server_harness import ServerProcess, free_port

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
GROUP = ("--pipeline-parallel-size", "2", "--group-size", "2", "--kv-cache-memory", "16MiB")


def serve_worker(group_port: int, health_port: int, log: Path, termination: Path, *extra: str) -> subprocess.Popen:
    """The group's pod 1 (its own process group: killing it kills its ranks, as a container's end does)."""
    termination.write_text("")  # (written where the kubelet provides the file)
    return subprocess.Popen([KVPILOT, "serve-worker", "--host", "127.0.0.1", "--port", str(health_port), "--num-threads", "1", *GROUP,
                             "--group-rank", "1", "--group-leader", "127.0.0.1", "--group-port", str(group_port), *extra],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "KVPILOT_TERMINATION_LOG": str(termination)})


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.timeout(240)
def test_a_group_of_two_pods_serves_hf_greedy_and_stops_when_a_pod_dies(tmp_path, hf_oracle_session):
    from kvpilot.server.loading import open_model
    from kvpilot.server.model_files import resolve_model_path

    oracle = hf_oracle_session.run()
    group_port, health_port = free_port(), free_port()
    (tmp_path / "leader-termination").write_text("")
    leader = ServerProcess(*GROUP, "--group-port", str(group_port), log_path=tmp_path / "leader.log",
                           env={"KVPILOT_TERMINATION_LOG": str(tmp_path / "leader-termination")})
    worker = serve_worker(group_port, health_port, tmp_path / "worker.log", tmp_path / "worker-termination")
    try:
        leader.wait_ready()
        health = f"http://127.0.0.1:{health_port}"
        deadline = time.monotonic() + 30  # (the worker's own server may bind a moment after the leader is ready)
        while time.monotonic() < deadline and not _answers(health + "/ready"):
            time.sleep(0.2)
        assert httpx.get(health + "/ready", timeout=5).status_code == 200 and httpx.get(health + "/health", timeout=5).status_code == 200
        _, tokenizer = open_model(resolve_model_path("smollm2-135m"))  # the engine's: the oracle's ids decoded as the server decodes
        for i in (0, 3, 4):  # English and numbers: the oracle's ids decode to the text the server streams
            r = httpx.post(leader.url + "/v1/completions", json={"prompt": ORACLE_PROMPTS[i], "max_tokens": 16, "temperature": 0,
                                                                "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tokenizer.decode(oracle[i].tokens[:16]), i
        os.killpg(worker.pid, signal.SIGKILL)  # the worker pod and its rank
        assert leader.proc.wait(40) == 70
        message = (tmp_path / "leader-termination").read_text()
        assert message.startswith("group pod 1 of 2 (ranks 1-1) stopped answering: no heartbeat"), message
    finally:
        leader.terminate()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_pod_that_never_joins_is_named_and_a_pod_without_its_leader_stops(tmp_path):
    (tmp_path / "termination").write_text("")
    leader = ServerProcess(*GROUP, "--group-port", str(free_port()), "--group-join-timeout", "5", log_path=tmp_path / "leader.log",
                           env={"KVPILOT_TERMINATION_LOG": str(tmp_path / "termination")})
    assert leader.proc.wait(60) == 70
    assert (tmp_path / "termination").read_text().startswith("ranks [1] of 2 (pods [1]) did not join the group"), leader.log()[-2000:]
    worker = serve_worker(free_port(), free_port(), tmp_path / "worker.log", tmp_path / "worker-termination", "--group-join-timeout", "3")
    try:
        assert worker.wait(60) == 70
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
    assert (tmp_path / "worker-termination").read_text().startswith("group pod 1: could not reach the group's leader at 127.0.0.1:")


def test_group_settings_are_refused_where_they_do_not_fit():
    from kvpilot.server.config import EngineConfig

    with pytest.raises(ValueError, match="group_size=2 must divide the 3 ranks"):
        EngineConfig(tensor_parallel_size=3, group_size=2)
    with pytest.raises(ValueError, match="group_rank=1 needs group_leader"):
        EngineConfig(pipeline_parallel_size=2, group_size=2, group_rank=1)
    with pytest.raises(ValueError, match="for a group of pods"):
        EngineConfig(group_leader="10.0.0.1")
    r = subprocess.run([KVPILOT, "serve-worker", *GROUP], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--group-rank 1 or more" in r.stderr
