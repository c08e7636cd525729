"""`kvpilot fetch-model`: a real download over HTTP (hf:// through HF_ENDPOINT) and HTTPS (a local
certificate trusted through SSL_CERT_FILE), atomic rename, errors with non-zero exits, no shell."""

from __future__ import annotations

import hashlib
import json
import os
import socket
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

    def __init__(self, files: dict[str, bytes], cut: str | None = None, commits: dict[str, str] | None = None):
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
                if commits and name in commits:
                    self.send_header("X-Repo-Commit", commits[name])
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


@pytest.mark.timeout(120)
def test_config_only_fetches_what_a_dummy_model_reads(tmp_path):
    """--config-only (the operator's download for --load-format dummy): the config and tokenizer files, never a weight."""
    hub = FakeHub(CHECKPOINT)
    try:
        dest = tmp_path / "repo"
        r = fetch("hf://org/repo", str(dest), "--config-only", env=hub.env)
        assert r.returncode == 0, r.stderr
        assert {p.name for p in dest.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json"}
        assert not any(path.endswith((".safetensors", ".safetensors.index.json")) for path, _, _ in hub.seen)
        one_file = fetch("hf://org/repo/model.Q4_0.gguf", str(tmp_path / "x"), "--config-only", env=hub.env)
        assert one_file.returncode == 1 and "--config-only takes a whole checkpoint" in one_file.stderr and not (tmp_path / "x").exists()
    finally:
        hub.close()
    hub = FakeHub({"tokenizer.json": b"{}"})
    try:
        r = fetch("hf://org/repo", str(tmp_path / "c"), "--config-only", env=hub.env)
        assert r.returncode == 1 and "not a checkpoint (needs config.json" in r.stderr
    finally:
        hub.close()


# --- who sees HF_TOKEN (issue #34): redirects between two loopback "hosts", https with a test CA ---

class RecordingHost:
    """One loopback host (127.0.0.1 or 127.0.0.2), plain or TLS: `redirects` maps a path to (status,
    Location); other *.gguf paths serve PAYLOAD, /api/models/… a checkpoint listing; every request's
    path and Authorization header are recorded."""

    def __init__(self, address: str, tls: tuple[Path, Path] | None = None):
        seen = self.seen = []
        redirects = self.redirects = {}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append((self.path, self.headers.get("Authorization")))
                if self.path in redirects:
                    code, location = redirects[self.path]
                    self.send_response(code)
                    self.send_header("Location", location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.endswith(".gguf") or self.path.startswith("/api/models/"):
                    body = PAYLOAD if self.path.endswith(".gguf") else json.dumps(
                        [{"type": "file", "path": "config.json", "size": 2}, {"type": "file", "path": "model.safetensors", "size": 4}]).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((address, 0), Handler)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{address}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def redirect_file(self, name: str, to: str, code: int = 302) -> str:
        """hf://org/repo/NAME on this hub answers `code` with Location `to`; returns that source."""
        self.redirects[f"/org/repo/resolve/main/{name}"] = (code, to)
        return f"hf://org/repo/{name}"

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory):
    """A test CA and a server certificate it signed for 127.0.0.1 and 127.0.0.2: (CA file, (cert, key))."""
    d = tmp_path_factory.mktemp("ca")

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=kvpilot test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=loopback")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,IP:127.0.0.2\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.pem", "-days", "1",
            "-extfile", "san.ext")
    return d / "ca.pem", (d / "server.pem", d / "server.key")


@pytest.mark.timeout(120)
def test_token_is_dropped_on_a_cross_host_redirect_and_kept_within_the_hub(tmp_path):
    hub, other, other_port = RecordingHost("127.0.0.1"), RecordingHost("127.0.0.2"), RecordingHost("127.0.0.1")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_secret"}
    try:
        # the hub's resolve URL redirects to another host (as huggingface.co does to its CDN)
        cross = fetch(hub.redirect_file("a.gguf", other.url + "/cdn/a.gguf"), str(tmp_path / "a.gguf"), env=env)
        assert cross.returncode == 0, cross.stderr
        assert (tmp_path / "a.gguf").read_bytes() == PAYLOAD
        assert hub.seen == [("/org/repo/resolve/main/a.gguf", "Bearer hf_secret")]
        assert other.seen == [("/cdn/a.gguf", None)]
        # a redirect within the hub's own origin keeps it (a renamed repository)
        same = fetch(hub.redirect_file("b.gguf", "/moved/b.gguf", 301), str(tmp_path / "b.gguf"), env=env)
        assert same.returncode == 0, same.stderr
        assert hub.seen[-1] == ("/moved/b.gguf", "Bearer hf_secret")
        # the same address on another port is another origin
        port = fetch(hub.redirect_file("c.gguf", other_port.url + "/c.gguf", 307), str(tmp_path / "c.gguf"), env=env)
        assert port.returncode == 0 and other_port.seen == [("/c.gguf", None)], port.stderr
        assert "hf_secret" not in cross.stderr + same.stderr + port.stderr
    finally:
        for h in (hub, other, other_port):
            h.close()


@pytest.mark.timeout(120)
def test_checkpoint_listing_redirect_drops_the_token(tmp_path):
    """Every request the fetcher makes follows the rule, the hub API's listing included."""
    hub, other = RecordingHost("127.0.0.1"), RecordingHost("127.0.0.2")
    hub.redirects["/api/models/org/repo/tree/main"] = (302, other.url + "/api/models/listing")
    try:
        fetch("hf://org/repo", str(tmp_path / "ckpt"), env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_secret"})
        assert hub.seen[0] == ("/api/models/org/repo/tree/main", "Bearer hf_secret")
        assert other.seen == [("/api/models/listing", None)]
        # the files then come from the hub itself, with the token
        assert hub.seen[1:] and all(auth == "Bearer hf_secret" for _, auth in hub.seen[1:])
    finally:
        hub.close()
        other.close()


@pytest.mark.timeout(120)
def test_https_hub_never_downgrades_and_drops_the_token_across_hosts(tmp_path, test_ca):
    ca, cert = test_ca
    hub, tls_other, plain_other = RecordingHost("127.0.0.1", cert), RecordingHost("127.0.0.2", cert), RecordingHost("127.0.0.2")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_secret", "SSL_CERT_FILE": str(ca)}
    try:
        ok = fetch(hub.redirect_file("ok.gguf", tls_other.url + "/cdn/ok.gguf"), str(tmp_path / "ok.gguf"), env=env)
        assert ok.returncode == 0, ok.stderr
        assert hub.seen[-1][1] == "Bearer hf_secret" and tls_other.seen == [("/cdn/ok.gguf", None)]
        down = fetch(hub.redirect_file("down.gguf", plain_other.url + "/cdn/down.gguf"), str(tmp_path / "down.gguf"), env=env)
        assert down.returncode == 1 and "refusing a redirect from https to http://127.0.0.2" in down.stderr, down.stderr
        assert plain_other.seen == [] and not list(tmp_path.glob("down*"))
        # an https:// model source never gets the token, and is not downgraded either
        direct = fetch(f"{hub.url}/files/direct.gguf", str(tmp_path / "direct.gguf"), env=env)
        assert direct.returncode == 0 and hub.seen[-1] == ("/files/direct.gguf", None), direct.stderr
        hub.redirects["/files/moved.gguf"] = (302, plain_other.url + "/moved.gguf")
        moved = fetch(f"{hub.url}/files/moved.gguf", str(tmp_path / "moved.gguf"), env=env)
        assert moved.returncode == 1 and "downgrade" in moved.stderr and plain_other.seen == []
        assert "hf_secret" not in ok.stderr + down.stderr + direct.stderr + moved.stderr
    finally:
        for h in (hub, tls_other, plain_other):
            h.close()


def test_token_is_never_sent_over_plain_http_to_a_non_loopback_hub(tmp_path):
    # refused before any connection is opened (the name would not even resolve)
    r = fetch("hf://org/repo/model.gguf", str(tmp_path / "m.gguf"), env={"HF_ENDPOINT": "http://hub.invalid", "HF_TOKEN": "hf_secret"})
    assert r.returncode == 1 and "would travel unencrypted" in r.stderr and "hf_secret" not in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(120)
def test_the_fetch_summary_names_the_commit_and_a_moving_repository_is_refused(tmp_path):
    """What a model cache's loader leaves in its termination message: the commit the hub named
    (X-Repo-Commit) and the bytes; a repository whose files come from two commits (a push during the
    download) is an error, not a mix."""
    wanted = {n for n in CHECKPOINT if n.endswith((".json", ".safetensors"))}
    hub = FakeHub(CHECKPOINT, commits={n: "c0ffee" for n in CHECKPOINT})
    log = tmp_path / "termination-log"
    try:
        log.write_text("")
        ok = fetch("hf://org/repo", str(tmp_path / "a"), env={**hub.env, "KVPILOT_TERMINATION_LOG": str(log)})
        assert ok.returncode == 0, ok.stderr
        assert json.loads(log.read_text()) == {"revision": "c0ffee", "bytes": sum(len(CHECKPOINT[n]) for n in wanted)}
    finally:
        hub.close()
    moved = FakeHub(CHECKPOINT, commits={n: "c0ffee" if n != "tokenizer.json" else "beef42" for n in CHECKPOINT})
    try:
        log.write_text("")
        bad = fetch("hf://org/repo", str(tmp_path / "b"), env={**moved.env, "KVPILOT_TERMINATION_LOG": str(log)})
        assert bad.returncode == 1 and "the source changed during the download (beef42, c0ffee)" in bad.stderr, bad.stderr
        assert log.read_text().startswith("kvpilot: fetch failed: hf://org/repo: the source changed")
    finally:
        moved.close()


# --- `kvpilot serve ORG/REPO` (issue #61): huggingface_hub against a local hub ---

COMMIT = hashlib.sha1(b"kvpilot test commit").hexdigest()


class HfHub:
    """A hub on loopback that answers what huggingface_hub asks: GET /api/models/ORG/REPO/revision/REV (the
    commit and the file names), GET /api/models/ORG/REPO/tree/COMMIT (sizes), HEAD and GET
    /ORG/REPO/resolve/REV/FILE (X-Repo-Commit, ETag, Content-Length; GET honours Range), 404 RepoNotFound
    for another repository. `cut`: that file's first GET sends half and drops the connection. `redirect`:
    FILE -> the URL its resolve answers 302 to (a CDN; the metadata on the 302, as the real hub sends it).
    `cdn`: files served at /cdn/FILE. Every request: (method, path, Range, Authorization)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], cut: str | None = None, redirect: dict[str, str] | None = None,
                 cdn: dict[str, bytes] | None = None, address: str = "127.0.0.1", tls: tuple[Path, Path] | None = None):
        seen = self.seen = []
        cut_done = []
        redirect, cdn = redirect or {}, cdn or {}

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code, headers=(), body=b""):
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _answer(self):
                path = self.path.split("?", 1)[0]
                seen.append((self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
                parts = path.strip("/").split("/")
                if parts[0] == "cdn" and path.removeprefix("/cdn/") in cdn:
                    return self._file(cdn[path.removeprefix("/cdn/")], path)
                api = parts[0] == "api" and parts[1] == "models"
                repo = "/".join(parts[2:4] if api else parts[0:2])
                files = repos.get(repo)
                if files is None:
                    return self._send(404, [("X-Error-Code", "RepoNotFound"), ("X-Error-Message", "Repository not found")])
                rev = parts[5] if api else parts[3] if len(parts) > 3 else ""
                if rev not in ("main", COMMIT):
                    return self._send(404, [("X-Error-Code", "RevisionNotFound"), ("X-Error-Message", "Invalid rev id")])
                if api and parts[4] == "revision":
                    return self._send(200, [("Content-Type", "application/json")], json.dumps(
                        {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]}).encode())
                if api and parts[4] == "tree":
                    return self._send(200, [("Content-Type", "application/json")], json.dumps(
                        [{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()} for n, b in files.items()]).encode())
                name = "/".join(parts[4:])
                if parts[2:3] != ["resolve"] or name not in files:
                    return self._send(404, [("X-Error-Code", "EntryNotFound"), ("X-Error-Message", "Entry not found")])
                meta = [("X-Repo-Commit", COMMIT), ("ETag", f'"{hashlib.sha256(files[name]).hexdigest()}"')]
                if name in redirect:
                    return self._send(302, [*meta, ("Location", redirect[name]), ("X-Linked-Size", str(len(files[name]))),
                                            ("X-Linked-Etag", f'"{hashlib.sha256(files[name]).hexdigest()}"')])
                self._file(files[name], name, meta)

            def _file(self, data, name, meta=()):
                start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0]) if self.headers.get("Range") else 0
                self.send_response(206 if start else 200)
                for k, v in meta:
                    self.send_header(k, v)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if name == cut and not cut_done:
                    cut_done.append(True)
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data[start:])

            do_GET = do_HEAD = _answer  # noqa: N815

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((address, 0), Handler)
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{address}:{self.server.server_address[1]}"
        self.env = {"HF_ENDPOINT": self.url, "HF_TOKEN": "hf_secret", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def tiny_checkpoint():
    """A servable Llama checkpoint in memory, random weights, with a byte-level tokenizer of 256 tokens and
    an end token: ~27 MB of safetensors (more than huggingface_hub's 10 MiB read chunk, so that a transfer
    cut at half has written a chunk to resume from), and files the engine does not read."""
    import numpy as np
    from safetensors.numpy import save
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>"])
    hidden, inter, layers, v = 256, 2560, 3, len(vocab)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": v, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
              "bos_token_id": None, "eos_token_id": v - 1, "torch_dtype": "float32"}
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": np.ones(hidden, np.float32), p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                    p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(hidden // 2, hidden),
                    p + "self_attn.v_proj.weight": w(hidden // 2, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden), p + "mlp.down_proj.weight": w(hidden, inter)}
    return {"config.json": json.dumps(config).encode(), "tokenizer.json": tk.to_str().encode(),
            "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}).encode(),
            "model.safetensors": save(tensors), "pytorch_model.bin": b"pickle: never fetched", "README.md": b"# not needed",
            "onnx/model.onnx": b"not read"}


def kvpilot(*args, env=None, timeout=120):
    return subprocess.run([KVPILOT, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.timeout(180)
def test_serve_a_hub_repo_id_positionally_resumed_with_a_progress_bar(tmp_path, tiny_checkpoint):
    """`kvpilot serve org/tiny`: the engine's files only, into HF_HOME's cache, the transfer cut at half
    resumed with a Range request, a progress bar in the log, the token only to the hub; the API's model
    name is the id; then the cached copy serves with HF_HUB_OFFLINE=1."""
    import httpx

    from server_harness import ServerProcess

    hub = HfHub({"org/tiny": tiny_checkpoint}, cut="model.safetensors")
    env = {**hub.env, "HF_HOME": str(tmp_path / "hf")}
    server = ServerProcess("org/tiny", "--kv-cache-memory", "16MiB", env=env, log_path=tmp_path / "server.log")
    try:
        server.wait_ready(120)
        r = httpx.post(server.url + "/v1/completions", json={"model": "org/tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "org/tiny" and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert server.terminate() == 0, server.log()[-3000:]
    log = server.log()
    weights = [(method, rng) for method, path, rng, _ in hub.seen if path.endswith("/model.safetensors") and method == "GET"]
    half = len(tiny_checkpoint["model.safetensors"]) // 2
    assert len(weights) == 2 and weights[0][1] is None, weights
    assert weights[1][1].startswith("bytes=") and 0 < int(weights[1][1][6:-1]) <= half, weights  # resumed, not restarted
    assert "Trying to resume download" in log
    assert "100%" in log and "Fetching 4 files" in log, log[-3000:]  # tqdm's bar, though the log is no terminal
    fetched = {path.rsplit("/", 1)[-1] for method, path, _, _ in hub.seen if "/resolve/" in path}
    assert fetched == {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}  # never the .bin, README, onnx/
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == tiny_checkpoint["model.safetensors"]
    assert all(auth == "Bearer hf_secret" for *_, auth in hub.seen) and "hf_secret" not in log
    # offline, from the cache: no request at all
    before = len(hub.seen)
    offline = kvpilot("generate", "org/tiny", "Hi", "--max-tokens", "2", "--num-threads", "1", "--kv-cache-memory", "16MiB",
                      env={**env, "HF_HUB_OFFLINE": "1"})
    hub.close()
    assert offline.returncode == 0, offline.stderr[-3000:]
    assert len(hub.seen) == before


@pytest.mark.timeout(180)
def test_a_dummy_model_of_a_hub_repo_downloads_its_config_and_tokenizer_only(tmp_path, tiny_checkpoint):
    """`--load-format dummy` with a hub id (a capacity test of a model not downloaded): the config and
    tokenizer files, never the weights; the Python API the same; a repository without a config.json is
    exit 2 before any file is fetched."""
    hub = HfHub({"org/tiny": tiny_checkpoint, "org/ggufs": {"model.Q4_0.gguf": b"GGUF" * 1000}})
    env = {**hub.env, "HF_HOME": str(tmp_path / "hf")}
    try:
        r = kvpilot("generate", "org/tiny", "Hi", "--load-format", "dummy", "--max-tokens", "3", "--num-threads", "1",
                    "--kv-cache-memory", "16MiB", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "[finish_reason=length]" in r.stderr
        fetched = {path.rsplit("/", 1)[-1] for method, path, _, _ in hub.seen if "/resolve/" in path}
        assert fetched == {"config.json", "tokenizer.json", "tokenizer_config.json"}, fetched
        api = subprocess.run([sys.executable, "-c", "import sys; from kvpilot.server import LLM, SamplingParams; "
                              "llm = LLM(model='org/tiny', load_format='dummy', seed=5, num_threads=1, kv_cache_memory='16MiB', show_progress=False); "
                              "print(len(llm.generate('Hi', SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids))"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert api.returncode == 0 and api.stdout.split()[-1] == "2", api.stderr[-3000:]
        assert not any(path.endswith(".safetensors") for _, path, _, _ in hub.seen)
        seen = len(hub.seen)
        gguf = kvpilot("generate", "org/ggufs", "Hi", "--load-format", "dummy", env=env)
        assert gguf.returncode == 2, gguf.stderr[-3000:]
        assert "load_format=dummy makes a model from a checkpoint's config.json, and org/ggufs has none" in gguf.stderr
        assert not any("/resolve/" in path for _, path, _, _ in hub.seen[seen:])  # not the GGUF either
    finally:
        hub.close()


def test_hub_repo_errors_are_exit_2_naming_the_argument(tmp_path):
    hub = HfHub({"org/tiny": {"config.json": b"{}", "a.gguf": b"GGUF", "b.gguf": b"GGUF"}})
    env = {**hub.env, "HF_HOME": str(tmp_path / "hf")}
    try:
        missing = kvpilot("serve", "org/nope", env=env)
        assert missing.returncode == 2, missing.stderr
        assert "MODEL 'org/nope'" in missing.stderr and "no repository org/nope" in missing.stderr
        revision = kvpilot("serve", "org/tiny@v9", env=env)
        assert revision.returncode == 2 and "has no revision 'v9'" in revision.stderr, revision.stderr
        two = kvpilot("generate", "org/tiny", "Hi", env=env)
        assert two.returncode == 2 and "2 GGUF files (a.gguf, b.gguf): name one, as hf://org/tiny/FILE.gguf" in two.stderr, two.stderr
        requests = len(hub.seen)
        offline = kvpilot("serve", "hf://org/tiny", env={**env, "HF_HUB_OFFLINE": "1"})
        assert offline.returncode == 2, offline.stderr
        assert "MODEL 'hf://org/tiny': HF_HUB_OFFLINE is set and org/tiny (main) is not in the Hugging Face cache" in offline.stderr
        assert len(hub.seen) == requests  # offline: not one request
        both = kvpilot("serve", "org/tiny", "--model", "org/other", env=env)
        assert both.returncode == 2 and "argument MODEL: 'org/tiny' and --model 'org/other' name different models" in both.stderr
        assert "hf_secret" not in missing.stderr + revision.stderr + two.stderr + offline.stderr
    finally:
        hub.close()


RESOLVE = "import sys; from kvpilot.server.fetch import hub_model; print(hub_model(sys.argv[1]))"


@pytest.mark.timeout(120)
def test_hub_downloads_keep_the_token_on_the_hub(tmp_path):
    """huggingface_hub's path follows fetch-model's rule: the CDN a resolve redirects to never sees the token."""
    cdn = HfHub({}, cdn={"a.gguf": PAYLOAD}, address="127.0.0.2")
    hub = HfHub({"org/q": {"a.gguf": PAYLOAD}}, redirect={"a.gguf": cdn.url + "/cdn/a.gguf"})
    try:
        r = subprocess.run([sys.executable, "-c", RESOLVE, "hf://org/q/a.gguf"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **hub.env, "HF_HOME": str(tmp_path / "hf")})
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).read_bytes() == PAYLOAD
        assert [(m, p, a) for m, p, _, a in hub.seen] == [("HEAD", "/org/q/resolve/main/a.gguf", "Bearer hf_secret")]
        assert [(m, p, a) for m, p, _, a in cdn.seen] == [("GET", "/cdn/a.gguf", None)]
        assert "hf_secret" not in r.stderr
        remote = kvpilot("generate", "org/q", "Hi", env={"HF_ENDPOINT": "http://hub.invalid", "HF_TOKEN": "hf_secret", "HF_HUB_OFFLINE": "0",
                                                         "HF_HOME": str(tmp_path / "hf")})
        assert remote.returncode == 1 and "would travel unencrypted" in remote.stderr and "hf_secret" not in remote.stderr
    finally:
        hub.close()
        cdn.close()


def test_the_hub_guard_drops_the_token_off_the_hub_and_refuses_downgrades():
    """The request hook on huggingface_hub's client, hop by hop: the token only to the hub's origin (not
    huggingface.co from a mirror, not another port), and no plain http once the hub is https."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
    from kvpilot.server.fetch import Credentials, FetchError, _HubGuard

    guard = _HubGuard(Credentials("hf_secret", "https://hub.example:8443"))

    def sent(url):
        request = httpx.Request("GET", url, headers={"Authorization": "Bearer hf_secret"})
        guard(request)
        return request.headers.get("authorization")

    assert sent("https://hub.example:8443/org/repo/resolve/main/x") == "Bearer hf_secret"
    for other in ("https://cdn.example/x", "https://hub.example/x", "https://huggingface.co/org/repo", "https://hub.example:8444/x"):
        assert sent(other) is None, other
    with pytest.raises(FetchError, match="downgrade to plain http"):
        sent("http://cdn.example/x")
    from huggingface_hub.utils._runtime import is_xet_available

    from kvpilot.server.fetch import _guard_hub_session

    _guard_hub_session(Credentials("hf_secret", "https://hub.example:8443"))
    assert not is_xet_available()  # hf_xet's client is given the token for a URL the server names: never used
    loopback = _HubGuard(Credentials("hf_secret", "http://127.0.0.1:8080"))
    request = httpx.Request("GET", "http://127.0.0.2:8080/cdn/x", headers={"Authorization": "Bearer hf_secret"})
    loopback(request)
    assert "authorization" not in request.headers


@pytest.mark.timeout(120)
def test_an_https_hub_is_never_left_for_plain_http(tmp_path, test_ca):
    """huggingface_hub alone follows an https hub's redirect to a plain-http CDN (without the token);
    kvpilot refuses it, as fetch-model does."""
    ca, cert = test_ca
    plain_cdn = HfHub({}, cdn={"a.gguf": PAYLOAD}, address="127.0.0.2")
    hub = HfHub({"org/q": {"a.gguf": PAYLOAD}}, redirect={"a.gguf": plain_cdn.url + "/cdn/a.gguf"}, tls=cert)
    try:
        r = kvpilot("generate", "hf://org/q/a.gguf", "Hi", env={**hub.env, "SSL_CERT_FILE": str(ca), "HF_HOME": str(tmp_path / "hf")})
        assert r.returncode == 1 and "refusing a request to http://127.0.0.2: the hub is https" in r.stderr, r.stderr[-3000:]
        assert [(m, a) for m, _, _, a in hub.seen] == [("HEAD", "Bearer hf_secret")] and plain_cdn.seen == []
        assert "hf_secret" not in r.stderr
    finally:
        hub.close()
        plain_cdn.close()
