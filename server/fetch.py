"""`kvpilot fetch-model SRC DEST`: download one model file (https:// or hf://org/repo/file) to DEST.

Run by the operator's init container (arguments as a list, never through a shell, as a non-root user)
and usable by hand. The file is written to DEST.part and renamed when complete, so a half download is
never taken for a model; progress goes to stderr; every read has a timeout and so does the whole.
hf:// resolves against $HF_ENDPOINT (default https://huggingface.co) with $HF_TOKEN when set.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpilot.server.model_source import parse_model_source

CHUNK = 1 << 20


class FetchError(RuntimeError):
    pass


def source_url(source: str) -> tuple[str, dict[str, str]]:
    """The URL to GET for a single-file source, and its request headers."""
    src = parse_model_source(source)
    if src.kind == "https":
        return src.url, {}
    if src.kind == "hf" and src.path:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        token = os.environ.get("HF_TOKEN")
        return f"{endpoint}/{src.name}/resolve/{os.environ.get('HF_REVISION', 'main')}/{src.path}", ({"Authorization": f"Bearer {token}"} if token else {})
    raise FetchError(f"{source}: only a single file (https://…/file.gguf or hf://org/repo/file) can be fetched")


def fetch(source: str, dest: Path, timeout: float = 1800, read_timeout: float = 60, log=sys.stderr) -> Path:
    url, headers = source_url(source)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "kvpilot-fetch-model", **headers})
    try:
        with urllib.request.urlopen(request, timeout=read_timeout) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done, last_report = 0, 0.0
            while chunk := response.read(CHUNK):
                out.write(chunk)
                done += len(chunk)
                now = time.monotonic()
                if now > deadline:
                    raise FetchError(f"{source}: not complete after {timeout:g} s ({done} bytes)")
                if now - last_report >= 5 or (total and done == total):
                    last_report = now
                    share = f" of {total} ({100 * done / total:.0f}%)" if total else ""
                    print(f"fetch-model: {done} bytes{share}", file=log, flush=True)
            if total and done != total:
                raise FetchError(f"{source}: connection ended after {done} of {total} bytes")
    except urllib.error.HTTPError as e:
        part.unlink(missing_ok=True)
        raise FetchError(f"{source}: the server answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        part.unlink(missing_ok=True)
        raise FetchError(f"{source}: {getattr(e, 'reason', None) or e}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    part.replace(dest)
    print(f"fetch-model: {dest} complete ({done} bytes)", file=log, flush=True)
    return dest
