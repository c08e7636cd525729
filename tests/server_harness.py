"""Runs a real `kvpilot serve` subprocess on a loopback port for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


# `kvpilot serve` with the engine in the server's process, and with the engine core in its own
# (--engine-core-process): the server tests run in both.
SERVER_MODES = {"one-process": (), "core-process": ("--engine-core-process",)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_state() -> str:
    """Load and the busiest processes: what a start-up that stalled was competing with."""
    busiest = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,rss,etimes,stat,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return f"load average {os.getloadavg()}; busiest processes:\n" + "\n".join(line[:200] for line in busiest.splitlines()[:12])


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [str(Path(sys.executable).parent / "kvpilot"), "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--num-threads", "1", *args]
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout:g} s: {self.log()[-3000:]}\n{machine_state()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def terminate(self, timeout: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def rank_pids(server_pid: int) -> list[int]:
    """A server's rank processes (multiprocessing spawn children), in start order."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == server_pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(pids)


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed with prometheus_client's parser: {sample name + sorted labels: value}. Every engine
    family (kvpilot:) is checked against the declared ones (server/api/metrics.py FAMILIES, the docs'
    table): its kind and its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.server.api.metrics import FAMILIES

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        if fam.name.startswith("kvpilot:"):
            declared = FAMILIES.get(fam.name.removeprefix("kvpilot:"))
            assert declared is not None and fam.type == declared.kind, (fam.name, fam.type, declared)
            own = {"le"} if fam.type == "histogram" else set()
            assert all(set(s.labels) - own == {"model_name", *declared.labels} for s in fam.samples), (fam.name, fam.samples[:1])
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_until_freed(url: str, timeout: float = 20) -> bool:
    """Whether, within timeout, no request runs and no KV block is held (e.g. after an abort)."""
    def freed():
        m = metrics(url)
        return m["kvpilot:num_requests_running"] == 0 and m["kvpilot:kv_cache_usage_perc"] == 0.0

    deadline = time.monotonic() + timeout
    while not freed() and time.monotonic() < deadline:
        time.sleep(0.2)
    return freed()


def serve_for_tests(tmp_path_factory, *args: str, env: dict | None = None):
    """A fixture body: a ready `kvpilot serve` with these flags (its log in a temporary directory),
    terminated after the tests, which checks that it exits cleanly."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(*args, env=env, log_path=log).wait_ready()
    yield server
    assert server.terminate() == 0


@contextlib.contextmanager
def asgi_server(app):
    """An ASGI app (the gateway) served by uvicorn on a free loopback port in a thread: its URL, until
    the block ends."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True


def read_reply(s: socket.socket) -> str:
    """Everything a server sends before it closes (it may reset a connection whose body it did not read)."""
    reply = b""
    try:
        while chunk := s.recv(4096):
            reply += chunk
    except ConnectionResetError:
        pass
    s.close()
    return reply.decode()


def assert_half_sent_headers_are_cut(port: int, connections: int = 20, within: float = 5) -> None:
    """Connections whose headers never end are closed by the server (its header timeout is below `within`)."""
    socks = []
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        assert s.recv(1024) == b""  # closed by the server
        s.close()
    assert time.monotonic() - t0 < within


def assert_bodies_held_at_once_are_bounded(port: int, headers: bytes = b"") -> None:
    """Five 1 MB bodies held 300 KB short against a 2 MiB cap on bodies still arriving: some get 429
    with Retry-After, the others time out (408)."""
    socks = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"Content-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n" + b"{" + b" " * 700_000)
        socks.append(s)
    replies = [read_reply(s) for s in socks]
    busy = [r for r in replies if r.startswith("HTTP/1.1 429")]
    assert busy and all("server_busy" in r and "retry-after: 1" in r.lower() for r in busy), replies
    assert all(r.startswith(("HTTP/1.1 429", "HTTP/1.1 408")) for r in replies), replies
