"""A loopback stand-in for the Hugging Face hub: repositories' files at /{repo}/resolve/main/{name}
(with the hub's X-Repo-Commit header) and its listing at /api/models/{repo}/tree/main. The checkpoint
and model cache tests and the cold-start benchmark count what it served."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "3f0e4c2a9b7d1e5f6a8b9c0d1e2f3a4b5c6d7e8f"


class LoopbackHub:
    """`repos`: repository ("org/name") -> its files (name in the repository -> the file served).
    `requests`: every path asked for; `downloads`: the file paths served."""

    def __init__(self, repos: dict[str, dict[str, Path]]):
        self.requests: list[str] = []
        self.downloads: list[str] = []
        requests, downloads = self.requests, self.downloads
        listings = {f"/api/models/{repo}/tree/main": json.dumps([{"type": "file", "path": name, "size": path.stat().st_size}
                                                                 for name, path in files.items()]).encode() for repo, files in repos.items()}
        served = {f"/{repo}/resolve/main/{name}": path for repo, files in repos.items() for name, path in files.items()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                requests.append(self.path)
                if self.path in listings:
                    body = listings[self.path]
                elif self.path in served:
                    downloads.append(self.path)
                    body = served[self.path].read_bytes()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                if self.path in served:
                    self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def smol_hub(model: Path) -> LoopbackHub:
    """The bundled GGUF as hf://org/smol/smol.gguf and, a second source of the same bytes, hf://org/smol/copy.gguf."""
    return LoopbackHub({"org/smol": {"smol.gguf": model, "copy.gguf": model}})
