"""`kvpilot fetch-model`: a real download over HTTP (hf:// through HF_ENDPOINT) and HTTPS (a local
certificate trusted through SSL_CERT_FILE), atomic rename, errors with non-zero exits, no shell."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

KVPILOT = str(Path(sys.executable).parent / "kvpilot")
PAYLOAD = os.urandom(3 << 20) + b"GGUF-end"


class FileServer:
    def __init__(self, tls_dir: Path | None = None):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append((self.path, self.headers.get("Authorization")))
                if not self.path.endswith(".gguf"):
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(PAYLOAD)))
                self.end_headers()
                self.wfile.write(PAYLOAD)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls_dir:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(tls_dir / "cert.pem", tls_dir / "key.pem")
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def fetch(*args, env=None):
    return subprocess.run([KVPILOT, "fetch-model", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.timeout(120)
def test_hf_file_through_hf_endpoint_with_token(tmp_path):
    server = FileServer()
    try:
        dest = tmp_path / "models" / "model.Q4_0.gguf"
        r = fetch("hf://org/repo/sub/model.Q4_0.gguf", str(dest), env={"HF_ENDPOINT": f"http://127.0.0.1:{server.port}", "HF_TOKEN": "hf_secret"})
        assert r.returncode == 0, r.stderr
        assert dest.read_bytes() == PAYLOAD and not dest.with_name(dest.name + ".part").exists()
        assert server.seen == [("/org/repo/resolve/main/sub/model.Q4_0.gguf", "Bearer hf_secret")]
        assert "complete" in r.stderr and "hf_secret" not in r.stderr
        missing = fetch("hf://org/repo/nothing.bin", str(tmp_path / "x"), env={"HF_ENDPOINT": f"http://127.0.0.1:{server.port}"})
        assert missing.returncode == 1 and "HTTP 404" in missing.stderr and not (tmp_path / "x").exists()
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_https_file(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = FileServer(tmp_path)
    try:
        dest = tmp_path / "tiny.gguf"
        r = fetch(f"https://127.0.0.1:{server.port}/files/tiny.gguf", str(dest), env={"SSL_CERT_FILE": str(tmp_path / "cert.pem")})
        assert r.returncode == 0, r.stderr
        assert dest.read_bytes() == PAYLOAD
        untrusted = fetch(f"https://127.0.0.1:{server.port}/files/tiny.gguf", str(tmp_path / "y.gguf"))
        assert untrusted.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
    finally:
        server.close()


def test_refuses_sources_that_are_not_downloads(tmp_path):
    for bad in ('hf://org/repo/x";id;".gguf', "pvc://claim/model.gguf", "smollm2-135m"):
        r = fetch(bad, str(tmp_path / "out"))
        assert r.returncode in (1, 2) and ("error" in r.stderr or "fail" in r.stderr), (bad, r.stderr)
        assert not (tmp_path / "out").exists()


class FakeHub:
    """A hub endpoint on loopback: the tree listing of org/repo and its files. `cut` names a file whose
    first GET sends only half of it and drops the connection; later GETs honour Range."""

    def __init__(self, files: dict[str, bytes], cut: str | None = None):
        seen = self.seen = []
        cut_done = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
                if self.path == "/api/models/org/repo/tree/main":
                    listing = [{"type": "file", "path": n, "size": len(b)} for n, b in files.items()] + [{"type": "directory", "path": "onnx"}]
                    body = json.dumps(listing).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                name = self.path.removeprefix("/org/repo/resolve/main/")
                if name not in files:
                    self.send_response(404)
                    self.end_headers()
                    return
                data, start = files[name], 0
                if self.headers.get("Range"):
                    start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
                    self.send_response(206)
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if name == cut and not cut_done:
                    cut_done.append(True)
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.connection.close()
                    return
                self.wfile.write(data[start:])

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.env = {"HF_ENDPOINT": f"http://127.0.0.1:{self.server.server_address[1]}", "HF_TOKEN": "hf_secret"}
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


CHECKPOINT = {"config.json": b'{"architectures": ["Qwen3ForCausalLM"]}', "tokenizer.json": b"{}", "tokenizer_config.json": b"{}",
              "model-00001-of-00002.safetensors": os.urandom(2 << 20), "model-00002-of-00002.safetensors": os.urandom(1 << 20),
              "model.safetensors.index.json": b"{}", "pytorch_model.bin": b"pickle: never fetched", "README.md": b"# not needed"}


@pytest.mark.timeout(120)
def test_whole_checkpoint_resumes_and_skips_what_is_complete(tmp_path):
    hub = FakeHub(CHECKPOINT, cut="model-00001-of-00002.safetensors")
    try:
        dest = tmp_path / "Qwen3"
        first = fetch("hf://org/repo", str(dest), env=hub.env)
        assert first.returncode == 1 and "run again to resume" in first.stderr, first.stderr
        part = dest / "model-00001-of-00002.safetensors.part"
        assert part.stat().st_size == 1 << 20 and not (dest / "model-00001-of-00002.safetensors").exists()
        before = len(hub.seen)
        second = fetch("hf://org/repo", str(dest), env=hub.env)
        assert second.returncode == 0, second.stderr
        wanted = {n for n in CHECKPOINT if n.endswith((".json", ".safetensors"))}
        assert {p.name for p in dest.iterdir()} == wanted  # no .bin, no README, no .part left
        assert all((dest / n).read_bytes() == CHECKPOINT[n] for n in wanted)
        got = [(path.rsplit("/", 1)[-1], rng) for path, rng, _ in hub.seen[before:]]
        assert ("model-00001-of-00002.safetensors", f"bytes={1 << 20}-") in got  # resumed, not restarted
        assert "config.json" not in [name for name, _ in got]  # complete files are not fetched again
        assert all(auth == "Bearer hf_secret" for _, _, auth in hub.seen) and "hf_secret" not in first.stderr + second.stderr
    finally:
        hub.close()


@pytest.mark.timeout(120)
def test_size_limit_and_non_checkpoint_repos(tmp_path):
    hub = FakeHub(CHECKPOINT)
    try:
        r = fetch("hf://org/repo", str(tmp_path / "a"), "--max-size", "1MiB", env=hub.env)
        assert r.returncode == 1 and "more than the limit of 1048576" in r.stderr and not (tmp_path / "a").exists()
        r = fetch("hf://org/repo/model-00001-of-00002.safetensors", str(tmp_path / "b"), "--max-size", "1MiB", env=hub.env)
        assert r.returncode == 1 and "more than the limit" in r.stderr and not list(tmp_path.glob("b*"))
    finally:
        hub.close()
    hub = FakeHub({"config.json": b"{}", "model.Q4_0.gguf": b"GGUF"})
    try:
        r = fetch("hf://org/repo", str(tmp_path / "c"), env=hub.env)
        assert r.returncode == 1 and "not a safetensors checkpoint" in r.stderr and "hf://org/repo/FILE.gguf" in r.stderr
    finally:
        hub.close()
