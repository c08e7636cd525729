"""`kvpilot fetch-model SRC DEST`: download a model to DEST — one file (https://…/file.gguf,
hf://org/repo/path/file) or a whole checkpoint (hf://org/repo: the files the engine loads).

Run by the operator's init container (arguments as a list, never through a shell, as a non-root user)
and usable by hand. Each file is written to NAME.part and renamed when complete, so a half download
is never taken for a model; an interrupted download resumes from its .part with an HTTP Range
request, and the files of a checkpoint already complete are not fetched again (an init container
that restarts picks up where it stopped). Progress goes to stderr; every read has a timeout and so
does the whole; a size limit bounds what a source may make us write. hf:// resolves against
$HF_ENDPOINT (default https://huggingface.co) at $HF_REVISION (default main), with $HF_TOKEN when set.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvpilot.server.model_source import ModelSource, parse_model_source

CHUNK = 1 << 20
# What a checkpoint directory needs (see server/checkpoint.py and server/tokenizer.py), top level only:
# never PyTorch pickles (.bin, .pt: code execution on load), training state or alternative formats.
CHECKPOINT_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "chat_template.jinja", "model.safetensors.index.json", "*.safetensors")
DEFAULT_MAX_BYTES = 256 << 30


class FetchError(RuntimeError):
    pass


@dataclass
class _Download:
    source: str
    deadline: float
    max_bytes: int
    log: object
    written: int = 0  # bytes written by this run, over all files


def _hf_endpoint() -> tuple[str, str, dict[str, str]]:
    token = os.environ.get("HF_TOKEN")
    return (os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"), os.environ.get("HF_REVISION", "main"),
            {"Authorization": f"Bearer {token}"} if token else {})


def source_url(source: str) -> tuple[str, dict[str, str]]:
    """The URL to GET for a single-file source, and its request headers."""
    src = parse_model_source(source)
    if src.kind == "https":
        return src.url, {}
    if src.kind == "hf" and src.path:
        endpoint, revision, headers = _hf_endpoint()
        return f"{endpoint}/{src.name}/resolve/{revision}/{src.path}", headers
    raise FetchError(f"{source}: only https://…/file.gguf and hf://org/repo[/file] sources are downloaded")


def checkpoint_files(src: ModelSource, read_timeout: float) -> list[tuple[str, int | None]]:
    """The repository's top-level files that a checkpoint needs, with their sizes (hub API)."""
    endpoint, revision, headers = _hf_endpoint()
    url = f"{endpoint}/api/models/{src.name}/tree/{urllib.parse.quote(revision, safe='')}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "kvpilot-fetch-model", **headers}), timeout=read_timeout) as r:
            entries = json.load(r)
    except urllib.error.HTTPError as e:
        raise FetchError(f"{src.raw}: listing the repository: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as e:
        raise FetchError(f"{src.raw}: listing the repository: {getattr(e, 'reason', None) or e}") from None
    if not isinstance(entries, list):
        raise FetchError(f"{src.raw}: unexpected answer from the hub listing")
    files = [(e["path"], e.get("size")) for e in entries if isinstance(e, dict) and e.get("type") == "file" and isinstance(e.get("path"), str)
             and "/" not in e["path"] and any(fnmatch.fnmatchcase(e["path"], p) for p in CHECKPOINT_PATTERNS)]
    names = {name for name, _ in files}
    if not any(n.endswith(".safetensors") for n in names) or "config.json" not in names:
        raise FetchError(f"{src.raw}: not a safetensors checkpoint (needs config.json and *.safetensors at the top level; "
                         f"for a GGUF give hf://{src.name}/FILE.gguf)")
    return sorted(files)


def fetch(source: str, dest: Path, timeout: float = 1800, read_timeout: float = 60, max_bytes: int = DEFAULT_MAX_BYTES, log=sys.stderr) -> Path:
    """Download `source` to `dest` (a file, or for a whole hf:// repository a directory)."""
    src = parse_model_source(source)
    dest = Path(dest)
    job = _Download(source, time.monotonic() + timeout, max_bytes, log)
    if src.kind == "hf" and not src.path:
        files = checkpoint_files(src, read_timeout)
        known = sum(size or 0 for _, size in files)
        if known > max_bytes:
            raise FetchError(f"{source}: {known} bytes, more than the limit of {max_bytes}")
        endpoint, revision, headers = _hf_endpoint()
        dest.mkdir(parents=True, exist_ok=True)
        for name, size in files:
            target = dest / name
            if target.is_file() and size is not None and target.stat().st_size == size:
                print(f"fetch-model: {name} already complete", file=log, flush=True)
                continue
            _download(job, f"{endpoint}/{src.name}/resolve/{revision}/{name}", headers, target, read_timeout)
        print(f"fetch-model: {dest} complete ({len(files)} files)", file=log, flush=True)
        return dest
    url, headers = source_url(source)
    _download(job, url, headers, dest, read_timeout)
    return dest


def _download(job: _Download, url: str, headers: dict[str, str], dest: Path, read_timeout: float) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "kvpilot-fetch-model", **headers, **({"Range": f"bytes={have}-"} if have else {})})
    try:
        with urllib.request.urlopen(request, timeout=read_timeout) as response:
            resumed = have and response.status == 206
            done = have if resumed else 0
            total = int(response.headers.get("Content-Length") or 0) + done
            if total > job.max_bytes:
                part.unlink(missing_ok=True)
                raise FetchError(f"{job.source}: {dest.name} is {total} bytes, more than the limit of {job.max_bytes}")
            if have:
                print(f"fetch-model: {dest.name}: " + (f"resuming at {have} bytes" if resumed else "the server does not resume; starting over"),
                      file=job.log, flush=True)
            last_report = 0.0
            with open(part, "ab" if resumed else "wb") as out:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    job.written += len(chunk)
                    if job.written > job.max_bytes or done > job.max_bytes:
                        part.unlink(missing_ok=True)
                        raise FetchError(f"{job.source}: more than the limit of {job.max_bytes} bytes")
                    now = time.monotonic()
                    if now > job.deadline:
                        raise FetchError(f"{job.source}: not complete in time ({dest.name}: {done} bytes)")
                    if now - last_report >= 5 or (total and done == total):
                        last_report = now
                        share = f" of {total} ({100 * done / total:.0f}%)" if total else ""
                        print(f"fetch-model: {dest.name}: {done} bytes{share}", file=job.log, flush=True)
            if total and done != total:
                raise FetchError(f"{job.source}: connection ended after {done} of {total} bytes of {dest.name} (run again to resume)")
    except urllib.error.HTTPError as e:
        part.unlink(missing_ok=True)
        raise FetchError(f"{job.source}: {dest.name}: the server answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:  # kept: the next run resumes from the .part file
        raise FetchError(f"{job.source}: {dest.name}: {getattr(e, 'reason', None) or e} (run again to resume)") from None
    part.replace(dest)
    print(f"fetch-model: {dest} complete ({done} bytes)", file=job.log, flush=True)
