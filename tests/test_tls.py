"""HTTPS on `kvpilot serve` with vLLM's flags, as KServe's LLMInferenceService template passes them:
a test CA, requests verified against it, a certificate rotated under the running server
(--enable-ssl-refresh), and bad files refused at start with the flag named."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpilot.server.config import ServerConfig
from server_harness import free_port

KVPILOT = str(Path(sys.executable).parent / "kvpilot")


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=cwd, timeout=30)


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Path:
    """A test CA's directory (ca.pem, ca.key), where issue() writes what it signs."""
    d = tmp_path_factory.mktemp("ca")
    openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
            "-out", "ca.pem", "-days", "1", "-subj", "/CN=kvpilot test CA", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                               "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    return d


def issue(ca: Path, cn: str, serial: int) -> tuple[bytes, bytes]:
    """A server certificate for 127.0.0.1 with a key of its own, signed by the test CA: (certificate PEM, key PEM)."""
    openssl(ca, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{cn}.key", "-out", f"{cn}.csr",
            "-subj", f"/CN={cn}")
    openssl(ca, "x509", "-req", "-in", f"{cn}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", str(serial), "-days", "1",
            "-extfile", "san.ext", "-out", f"{cn}.pem")
    return (ca / f"{cn}.pem").read_bytes(), (ca / f"{cn}.key").read_bytes()


def served_certificate(port: int, ca: Path) -> tuple[str, int]:
    """The (common name, serial) of the certificate a new connection is given, verified against the test CA."""
    context = ssl.create_default_context(cafile=str(ca / "ca.pem"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        cert = tls.getpeercert()
    return dict(pair[0] for pair in cert["subject"])["commonName"], int(cert["serialNumber"], 16)


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:g} s: {what}")


@pytest.mark.timeout(240)
def test_kserve_template_args_serve_https_and_a_rotated_certificate_is_served_without_restart(ca, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"  # KServe mounts them at /etc/ssl/certs/tls.{crt,key}
    first_cert, first_key = issue(ca, "kvpilot-one", 1001)
    cert.write_bytes(first_cert)
    key.write_bytes(first_key)
    port, log = free_port(), tmp_path / "server.log"
    # The template's arguments (`vllm serve MODEL --served-model-name NAME --port 8000 --disable-log-requests --enable-ssl-refresh
    # --ssl-certfile ... --ssl-keyfile ...`: no --host), plus one torch thread for the test machine; in a pod (KUBERNETES_SERVICE_HOST
    # set) an unset --host binds every interface, as vLLM does, where the kubelet's probes come.
    args = ["smollm2-135m", "--served-model-name", "tls-model", "--port", str(port), "--disable-log-requests", "--enable-ssl-refresh",
            "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--num-threads", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([KVPILOT, "serve", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    verified = ssl.create_default_context(cafile=str(ca / "ca.pem"))
    base = f"https://127.0.0.1:{port}"
    try:
        def ready():
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                return httpx.get(base + "/ready", verify=verified, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 150, "the server ready over HTTPS")
        with httpx.Client(base_url=base, verify=verified, timeout=30) as client:
            assert client.get("/health").text == "ok" and client.get("/ready").text == "ready"
            assert client.get("/v1/models").json()["data"][0]["id"] == "tls-model"
            done = client.post("/v1/completions", json={"model": "tls-model", "prompt": "Hello", "max_tokens": 2})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on the port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted without the CA
            httpx.get(base + "/health", timeout=5)
        assert "ready at https://0.0.0.0" in log.read_text()
        assert '"endpoint": "completions"' not in log.read_text()  # --disable-log-requests: no line per request
        assert served_certificate(port, ca) == ("kvpilot-one", 1001)

        # A rotation, written in place as a Secret's new data (the certificate first: a moment where the pair does not match).
        second_cert, second_key = issue(ca, "kvpilot-two", 2002)
        cert.write_bytes(second_cert)
        key.write_bytes(second_key)
        wait_for(lambda: served_certificate(port, ca) == ("kvpilot-two", 2002), 15, "the new certificate served")
        assert httpx.get(base + "/health", verify=verified, timeout=10).text == "ok"
        assert "TLS certificate reloaded" in log.read_text()

        # A rotation that does not load (a certificate without its key) keeps the previous pair, and is logged.
        third_cert, third_key = issue(ca, "kvpilot-three", 3003)
        logged = len(log.read_text())
        cert.write_bytes(third_cert)
        wait_for(lambda: "do not load" in log.read_text()[logged:], 15, "the bad rotation logged")
        assert served_certificate(port, ca) == ("kvpilot-two", 2002)
        assert httpx.get(base + "/health", verify=verified, timeout=10).text == "ok"
        key.write_bytes(third_key)  # completed: served from then on
        wait_for(lambda: served_certificate(port, ca) == ("kvpilot-three", 3003), 15, "the completed rotation served")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]


@pytest.mark.timeout(120)
def test_a_missing_certificate_file_is_exit_2_naming_the_flag(tmp_path):
    missing = tmp_path / "missing.crt"
    r = subprocess.run([KVPILOT, "serve", "--model", "smollm2-135m", "--port", str(free_port()), "--num-threads", "1",
                        "--ssl-certfile", str(missing), "--ssl-keyfile", str(tmp_path / "missing.key")],
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"kvpilot: error: --ssl-certfile {missing}: no such file" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


@pytest.mark.timeout(60)
def test_bad_tls_files_are_errors_naming_their_flag(ca, tmp_path):
    from kvpilot.server.api.app import load_tls

    def error(**files) -> str:
        with pytest.raises(ValueError) as e:
            load_tls(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ServerConfig(**{k: str(v) for k, v in files.items()}))
        return str(e.value)

    good_cert, good_key = issue(ca, "kvpilot-files", 4004)
    _, other_key = issue(ca, "kvpilot-other", 5005)
    (tmp_path / "tls.crt").write_bytes(good_cert)
    (tmp_path / "other.key").write_bytes(other_key)
    (tmp_path / "garbage.crt").write_text("not a certificate\n")
    assert error(ssl_certfile=tmp_path / "tls.crt", ssl_keyfile=tmp_path / "nope.key") == f"--ssl-keyfile {tmp_path / 'nope.key'}: no such file"
    assert error(ssl_certfile=tmp_path / "garbage.crt", ssl_keyfile=tmp_path / "other.key").startswith(
        f"--ssl-certfile {tmp_path / 'garbage.crt'}: not a PEM certificate")
    assert error(ssl_certfile=tmp_path / "tls.crt", ssl_keyfile=tmp_path / "other.key").startswith(
        f"--ssl-keyfile {tmp_path / 'other.key'}: not the PEM private key of --ssl-certfile's certificate")
    assert error(ssl_certfile=tmp_path / "tls.crt").startswith(f"--ssl-certfile {tmp_path / 'tls.crt'}: holds no PEM private key")
    (tmp_path / "good.key").write_bytes(good_key)
    openssl(tmp_path, "pkey", "-in", "good.key", "-aes256", "-passout", "pass:secret", "-out", "encrypted.key")
    assert "is encrypted" in error(ssl_certfile=tmp_path / "tls.crt", ssl_keyfile=tmp_path / "encrypted.key")  # not a prompt on stdin
    assert error(ssl_certfile=tmp_path / "tls.crt", ssl_keyfile=tmp_path / "good.key", ssl_ca_certs=tmp_path / "garbage.crt").startswith(
        f"--ssl-ca-certs {tmp_path / 'garbage.crt'}: not PEM certificates")
    # a good set loads: the certificate and key in one file too (no --ssl-keyfile), and client CAs
    (tmp_path / "both.pem").write_bytes(good_cert + good_key)
    load_tls(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ServerConfig(ssl_certfile=str(tmp_path / "both.pem"), ssl_ca_certs=str(ca / "ca.pem")))


@pytest.mark.timeout(30)
def test_tls_flags_without_a_certificate_are_refused():
    for values, message in [({"ssl_keyfile": "k.pem"}, "ssl_keyfile: only with ssl_certfile"),
                            ({"enable_ssl_refresh": True, "ssl_ca_certs": "ca.pem"}, "ssl_ca_certs, enable_ssl_refresh: only with ssl_certfile"),
                            ({"ssl_certfile": "c.pem", "ssl_cert_reqs": 2}, "ssl_cert_reqs=2 needs ssl_ca_certs"),
                            ({"ssl_certfile": "c.pem", "ssl_ca_certs": "ca.pem", "ssl_cert_reqs": 3}, "less than or equal to 2")]:
        with pytest.raises(ValueError, match=message):
            ServerConfig(**values)
    assert ServerConfig(ssl_certfile="c.pem", ssl_ca_certs="ca.pem", ssl_cert_reqs="2").ssl_cert_reqs == ssl.CERT_REQUIRED  # as the flag gives it
