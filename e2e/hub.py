"""A loopback stand-in for the Hugging Face hub serving one GGUF file, as `hf://org/smol/smol.gguf` and
`hf://org/smol/copy.gguf` (with the hub's X-Repo-Commit header): model cache tests and the cold-start
benchmark count its downloads."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "3f0e4c2a9b7d1e5f6a8b9c0d1e2f3a4b5c6d7e8f"


class FileHub:
    """/org/smol/resolve/main/{smol,copy}.gguf: the bundled GGUF, with the hub's X-Repo-Commit; counts full GETs."""

    def __init__(self, path: Path):
        self.downloads: list[str] = []
        downloads, data = self.downloads, path.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path not in ("/org/smol/resolve/main/smol.gguf", "/org/smol/resolve/main/copy.gguf"):
                    self.send_response(404)
                    self.end_headers()
                    return
                downloads.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
