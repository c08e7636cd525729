"""`kvpilot fetch-model SRC DEST`: download a model to DEST — one file (https://…/file.gguf,
hf://org/repo/path/file) or a whole checkpoint (hf://org/repo: the files the engine loads).

Run by the operator's init container (arguments as a list, never through a shell, as a non-root user)
and usable by hand. Each file is written to NAME.part and renamed when complete, so a half download
is never taken for a model; an interrupted download resumes from its .part with an HTTP Range
request, and the files of a checkpoint already complete are not fetched again (an init container
that restarts picks up where it stopped). Progress goes to stderr; every read has a timeout and so
does the whole; a size limit bounds what a source may make us write. hf:// resolves against
$HF_ENDPOINT (default https://huggingface.co) at $HF_REVISION (default main), with $HF_TOKEN when set.

The token goes only to the hub itself: never to another host a redirect names (the hub's file
redirects point at a CDN with signed URLs), never over plain http unless the hub is on loopback, and
an https -> http redirect is refused whatever the source. urllib alone would copy the header onto
every redirect.

`kvpilot serve MODEL` / `generate` with a hub repository id (ORG/REPO, ORG/REPO@REVISION,
hf://ORG/REPO[/FILE.gguf][@REVISION]) go through `hub_model` instead: huggingface_hub's snapshot_download
into the shared Hugging Face cache (HF_HOME, HF_HUB_CACHE), with its retries, its resumption of a
transfer cut mid-file and its progress bar, and only the files the engine reads. The same token rule
holds there (see _HubGuard). fetch-model keeps its own downloader: it writes plain files into DEST (a
claim), resumes from NAME.part across runs (an init container's restarts; huggingface_hub >= 1.x drops
its partial files when a process ends), bounds the bytes (--max-size) and reports the commit.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.server.model_source import ModelSource, parse_model_source

CHUNK = 1 << 20
# What a checkpoint directory needs (see server/checkpoint.py and server/tokenizer.py), top level only:
# never PyTorch pickles (.bin, .pt: code execution on load), training state or alternative formats.
CHECKPOINT_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "chat_template.jinja", "model.safetensors.index.json", "*.safetensors")
WEIGHT_PATTERNS = ("model.safetensors.index.json", "*.safetensors")
# What load_format=dummy reads of a checkpoint: its config and tokenizer, no weights.
CONFIG_PATTERNS = tuple(p for p in CHECKPOINT_PATTERNS if p not in WEIGHT_PATTERNS)


@dataclass(frozen=True, slots=True)
class RepoFiles:
    """Which top-level files of a hub repository a whole-repository source downloads, and which it must have."""

    patterns: tuple[str, ...]
    required: tuple[str, ...]   # patterns each matched by at least one file
    what: str                   # for the refusal: what the repository is not


CHECKPOINT = RepoFiles(CHECKPOINT_PATTERNS, ("config.json", "*.safetensors"),
                       "a safetensors checkpoint (needs config.json and *.safetensors at the top level; for a GGUF give hf://{repo}/FILE.gguf)")
# What an engine with load_format=dummy reads of a checkpoint (fetch-model --config-only).
CHECKPOINT_CONFIG = RepoFiles(CONFIG_PATTERNS, ("config.json",), "a checkpoint (needs config.json at the top level)")
# A PEFT LoRA adapter (server/adapters.py): never its pickled adapter_model.bin.
ADAPTER = RepoFiles(("adapter_config.json", "adapter_model.safetensors"), ("adapter_config.json", "adapter_model.safetensors"),
                    "a PEFT adapter (needs adapter_config.json and adapter_model.safetensors at the top level)")
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
    revisions: set[str] = field(default_factory=set)  # what the server says it sent: the hub's X-Repo-Commit, else an ETag

    def note_revision(self, response) -> None:
        """One download is one revision: a repository that moves to another commit half way (a push
        during a checkpoint's download) is an error, not a mix of two commits."""
        revision = response.headers.get("X-Repo-Commit") or response.headers.get("ETag")
        if revision:
            self.revisions.add(revision.strip('"'))
        if len(self.revisions) > 1:
            raise FetchError(f"{self.source}: the source changed during the download ({', '.join(sorted(self.revisions))}): run again")


@dataclass(frozen=True)
class Fetched:
    """What a download left at `path`: its bytes on disk and the revision the server named (an hf://
    source's commit), for a model cache's record."""

    path: Path
    bytes: int
    revision: str | None

    def summary(self) -> str:
        return json.dumps({"revision": self.revision, "bytes": self.bytes})


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Credentials:
    """Who may see HF_TOKEN: requests to the hub's own origin (scheme, host, port), and only over https
    unless the hub is on loopback. Decided per request, redirects included."""

    def __init__(self, token: str | None, hub: str | None):
        self.token, self.hub = token, _origin(hub) if hub else None
        if token and self.hub and self.hub[0] != "https" and not _is_loopback(self.hub[1]):
            raise FetchError(f"HF_TOKEN is set but HF_ENDPOINT ({self.hub[0]}://{self.hub[1]}) is plain {self.hub[0]} to a host that is "
                             "not loopback: the token would travel unencrypted (use an https endpoint, or unset HF_TOKEN)")

    def apply(self, request: urllib.request.Request) -> urllib.request.Request:
        # Unredirected: urllib's own redirect handling must never carry it on (see SafeRedirects).
        if self.token and _origin(request.full_url) == self.hub:
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        return request


class SafeRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) only, refuses https -> http, and re-decides the credentials for the
    new URL (the token only stays on a redirect within the hub's origin)."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new_scheme, old_scheme = urllib.parse.urlsplit(newurl).scheme.lower(), urllib.parse.urlsplit(req.full_url).scheme.lower()
        where = f"{new_scheme}://{urllib.parse.urlsplit(newurl).hostname}"  # never the path: signed URLs carry secrets
        if new_scheme not in ("http", "https"):
            raise FetchError(f"refusing a redirect to {where}: only http(s) is followed")
        if old_scheme == "https" and new_scheme != "https":
            raise FetchError(f"refusing a redirect from https to {where}: a downgrade to plain http")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        return self.credentials.apply(new) if new is not None else None


def _opener(credentials: Credentials) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(SafeRedirects(credentials))


def _hf_endpoint() -> tuple[str, str, Credentials]:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    return endpoint, os.environ.get("HF_REVISION", "main"), Credentials(os.environ.get("HF_TOKEN") or None, endpoint)


def source_url(source: str) -> tuple[str, Credentials]:
    """The URL to GET for a single-file source, and who may see the token on the way."""
    src = parse_model_source(source)
    if src.kind == "https":
        return src.url, Credentials(None, None)
    if src.kind == "hf" and src.path:
        endpoint, revision, credentials = _hf_endpoint()
        return f"{endpoint}/{src.name}/resolve/{revision}/{src.path}", credentials
    raise FetchError(f"{source}: only https://…/file.gguf and hf://org/repo[/file] sources are downloaded")


def repo_files(src: ModelSource, read_timeout: float, wanted: RepoFiles = CHECKPOINT) -> list[tuple[str, int | None]]:
    """The repository's top-level files that `wanted` names, with their sizes (hub API)."""
    endpoint, revision, credentials = _hf_endpoint()
    url = f"{endpoint}/api/models/{src.name}/tree/{urllib.parse.quote(revision, safe='')}"
    request = credentials.apply(urllib.request.Request(url, headers={"User-Agent": "kvpilot-fetch-model"}))
    try:
        with _opener(credentials).open(request, timeout=read_timeout) as r:
            entries = json.load(r)
    except urllib.error.HTTPError as e:
        raise FetchError(f"{src.raw}: listing the repository: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError, json.JSONDecodeError) as e:
        raise FetchError(f"{src.raw}: listing the repository: {getattr(e, 'reason', None) or e}") from None
    if not isinstance(entries, list):
        raise FetchError(f"{src.raw}: unexpected answer from the hub listing")
    files = [(e["path"], e.get("size")) for e in entries if isinstance(e, dict) and e.get("type") == "file" and isinstance(e.get("path"), str)
             and "/" not in e["path"] and any(fnmatch.fnmatchcase(e["path"], p) for p in wanted.patterns)]
    names = {name for name, _ in files}
    if not all(any(fnmatch.fnmatchcase(n, p) for n in names) for p in wanted.required):
        raise FetchError(f"{src.raw}: not {wanted.what.format(repo=src.name)}")
    return sorted(files)


def fetch(source: str, dest: Path, timeout: float = 1800, read_timeout: float = 60, max_bytes: int = DEFAULT_MAX_BYTES, log=sys.stderr,
          wanted: RepoFiles = CHECKPOINT) -> Fetched:
    """Download `source` to `dest` (a file, or for a whole hf:// repository a directory of the files `wanted` names)."""
    src = parse_model_source(source)
    dest = Path(dest)
    job = _Download(source, time.monotonic() + timeout, max_bytes, log)
    if src.kind == "hf" and not src.path:
        files = repo_files(src, read_timeout, wanted)
        known = sum(size or 0 for _, size in files)
        if known > max_bytes:
            raise FetchError(f"{source}: {known} bytes, more than the limit of {max_bytes}")
        endpoint, revision, credentials = _hf_endpoint()
        dest.mkdir(parents=True, exist_ok=True)
        for name, size in files:
            target = dest / name
            if target.is_file() and size is not None and target.stat().st_size == size:
                print(f"fetch-model: {name} already complete", file=log, flush=True)
                continue
            _download(job, f"{endpoint}/{src.name}/resolve/{revision}/{name}", credentials, target, read_timeout)
        print(f"fetch-model: {dest} complete ({len(files)} files)", file=log, flush=True)
        return Fetched(dest, sum((dest / name).stat().st_size for name, _ in files), _revision(job))
    url, credentials = source_url(source)
    _download(job, url, credentials, dest, read_timeout)
    return Fetched(dest, dest.stat().st_size, _revision(job))


def _revision(job: _Download) -> str | None:
    return next(iter(job.revisions), None)


def _download(job: _Download, url: str, credentials: Credentials, dest: Path, read_timeout: float) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    request = credentials.apply(urllib.request.Request(url, headers={"User-Agent": "kvpilot-fetch-model", **({"Range": f"bytes={have}-"} if have else {})}))
    try:
        with _opener(credentials).open(request, timeout=read_timeout) as response:
            job.note_revision(response)
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


# --- `kvpilot serve MODEL` / `generate` with a hub repository id: huggingface_hub ---

_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_HUB_MODEL = re.compile(rf"(?P<hf>hf://)?(?P<repo>{_PART}/{_PART})(?:/(?P<file>[A-Za-z0-9_.+-]+(?:/[A-Za-z0-9_.+-]+)*))?"
                        r"(?:@(?P<revision>[A-Za-z0-9_.+/-]+))?")


@dataclass(frozen=True, slots=True)
class HubModel:
    repo: str            # ORG/REPO
    file: str            # one GGUF in it (hf://ORG/REPO/FILE.gguf), "" for the whole repository
    revision: str | None  # @REVISION; None: $HF_REVISION, else main
    raw: str


def parse_hub_model(model: str) -> HubModel | None:
    """ORG/REPO, ORG/REPO@REVISION or hf://ORG/REPO[/FILE.gguf][@REVISION] as a HubModel, else None. A bundled
    name or an existing path wins over this reading (the caller checks those first), as in vLLM and transformers."""
    m = _HUB_MODEL.fullmatch(model)
    if not m or (m["file"] and not m["hf"]) or any(seg in (".", "..") for seg in re.split(r"[/@]", model.removeprefix("hf://"))):
        return None
    return HubModel(m["repo"], m["file"] or "", m["revision"], model)


class _HubGuard:
    """A request hook on huggingface_hub's httpx2 client, run before every request it sends, each hop of a
    redirect included (httpx2's Client._send_handling_redirects runs the request hooks per hop): the
    Authorization header stays only on requests to the hub's own origin (huggingface_hub would also keep it
    on redirects to huggingface.co / hf.co from a mirror, utils/_http.py _HUB_ORIGINS), and a hub reached
    over https is never left for plain http (httpx2 follows an https -> http redirect, only without the
    header). The plain-http-to-a-remote-hub refusal is Credentials' own, checked before any request."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    def __call__(self, request) -> None:
        scheme, host, port = _origin(str(request.url))
        hub = self.credentials.hub
        if hub and hub[0] == "https" and scheme != "https":
            raise FetchError(f"refusing a request to {scheme}://{host}: the hub is https, this would be a downgrade to plain {scheme}")
        if (scheme, host, port) != hub:
            request.headers.pop("authorization", None)


def _guard_hub_session(credentials: Credentials) -> None:
    """Every request huggingface_hub sends goes through _HubGuard. Its Xet transfers are turned off: they
    run in hf_xet's own (Rust) client, which is given the request's headers, the token with them, for a
    token-refresh URL the server names (file_download.xet_get): requests the guard would never see."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory  # its hooks: offline mode, request ids

    constants.HF_HUB_DISABLE_XET = True  # read when a download starts (utils._runtime.is_xet_available)

    def factory():
        client = default_client_factory()
        client.event_hooks = {**client.event_hooks, "request": [*client.event_hooks["request"], _HubGuard(credentials)]}
        return client

    huggingface_hub.set_client_factory(factory)


def _log_bar():
    """tqdm for huggingface_hub's bars when stderr is not a terminal (a server's log, a pod's): its own class
    hides them there. Every bar on line 0, so that a log gets no cursor movements between them."""
    if sys.stderr.isatty():
        return None
    from tqdm import tqdm

    class LogBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs.update(file=sys.stderr, position=0)
            kwargs.setdefault("mininterval", 1.0)
            super().__init__(*args, **kwargs)

    return LogBar


def _serve_files(hub: HubModel, names: list[str], weights: bool) -> list[str]:
    """What the engine reads of a repository: a safetensors checkpoint's files (CHECKPOINT_PATTERNS, top level;
    without `weights` its config and tokenizer only), else its one GGUF."""
    top = [n for n in names if "/" not in n]
    if "config.json" in top and (not weights or any(n.endswith(".safetensors") for n in top)):
        return sorted(n for n in top if any(fnmatch.fnmatchcase(n, p) for p in CHECKPOINT_PATTERNS if weights or p not in WEIGHT_PATTERNS))
    if not weights:
        raise FileNotFoundError(f"MODEL {hub.raw!r}: load_format=dummy makes a model from a checkpoint's config.json, and {hub.repo} has none "
                                "at the top level")
    ggufs = sorted(n for n in top if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise FileNotFoundError(f"MODEL {hub.raw!r}: {hub.repo} has {len(ggufs)} GGUF files ({', '.join(ggufs[:4])}{', …' if len(ggufs) > 4 else ''}): "
                                f"name one, as hf://{hub.repo}/FILE.gguf")
    raise FileNotFoundError(f"MODEL {hub.raw!r}: {hub.repo} is neither a safetensors checkpoint (config.json and *.safetensors at "
                            "the top level) nor a GGUF repository")


def _model_in(snapshot: Path, hub: HubModel, weights: bool) -> Path:
    if (snapshot / "config.json").is_file() and (not weights or any(snapshot.glob("*.safetensors"))):
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise FileNotFoundError(f"MODEL {hub.raw!r}: the cached snapshot {snapshot} holds no safetensors checkpoint and not one GGUF")


def hub_model(model: str, log=sys.stderr, weights: bool = True) -> Path:
    """The checkpoint directory (in the Hugging Face cache) or GGUF file of a hub repository id, downloaded
    by huggingface_hub unless cached: only the files the engine reads, from one commit; without `weights`
    (load_format=dummy), a checkpoint's config and tokenizer files alone. Raises
    FileNotFoundError (exit 2) for a repository, revision or file the hub does not have, or one not cached
    when HF_HUB_OFFLINE is set; FetchError (exit 1) when the download itself fails."""
    hub = parse_hub_model(model)
    if hub is None:
        raise FileNotFoundError(f"MODEL {model!r} is not a hub repository id (ORG/REPO, ORG/REPO@REVISION, hf://ORG/REPO[/FILE.gguf])")
    if hub.file and not hub.file.endswith(".gguf"):
        raise FileNotFoundError(f"MODEL {model!r}: one file of a repository is served only if it is a GGUF")
    try:
        import httpx2 as httpx  # huggingface_hub 2.x's client
    except ImportError:
        import httpx  # 1.x's
    import huggingface_hub as hf
    from huggingface_hub import constants, errors

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    revision = hub.revision or os.environ.get("HF_REVISION") or "main"
    _guard_hub_session(Credentials(hf.get_token(), endpoint))
    offline = constants.is_offline_mode()
    bar = _log_bar()
    where = f"{hub.repo} at {revision} on {endpoint}"
    try:
        if hub.file:
            return Path(hf.hf_hub_download(hub.repo, hub.file, revision=revision, endpoint=endpoint, tqdm_class=bar))
        if offline:  # what the cache holds: a checkpoint's files, else a GGUF repository's snapshot
            return _model_in(Path(hf.snapshot_download(hub.repo, revision=revision, endpoint=endpoint,
                                                       allow_patterns=list(CHECKPOINT_PATTERNS if weights else CONFIG_PATTERNS))), hub, weights)
        info = hf.HfApi(endpoint=endpoint).model_info(hub.repo, revision=revision)
        files = _serve_files(hub, [s.rfilename for s in info.siblings or []], weights)
        print(f"kvpilot: downloading {where} ({', '.join(files)}) into the Hugging Face cache {constants.HF_HUB_CACHE}", file=log, flush=True)
        # snapshot_download resolves the revision to one commit and takes every file from it
        return _model_in(Path(hf.snapshot_download(hub.repo, revision=revision, endpoint=endpoint, allow_patterns=files, tqdm_class=bar)), hub, weights)
    except errors.GatedRepoError:
        raise FileNotFoundError(f"MODEL {model!r}: {hub.repo} is gated on {endpoint}: accept its terms there and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(f"MODEL {model!r} is not a bundled model or an existing path, and the Hugging Face Hub ({endpoint}) has "
                                f"no repository {hub.repo} (a private one needs HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"MODEL {model!r}: {hub.repo} has no revision {revision!r} on {endpoint}") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        if offline:
            raise FileNotFoundError(f"MODEL {model!r}: HF_HUB_OFFLINE is set and {hub.repo} ({revision}) is not in the Hugging Face cache "
                                    f"{constants.HF_HUB_CACHE}: run once with the hub reachable, or give a local path") from None
        raise FetchError(f"{model}: {where}: {str(e).splitlines()[0]}") from None
    except errors.EntryNotFoundError:
        raise FileNotFoundError(f"MODEL {model!r}: {hub.repo} has no file {hub.file} at {revision}") from None
    except errors.HfHubHTTPError as e:
        raise FetchError(f"{model}: {where}: {str(e).splitlines()[0]}") from None
    except FileNotFoundError:
        raise
    except (httpx.HTTPError, OSError) as e:
        raise FetchError(f"{model}: {where}: {e} (run again: complete files are kept in the cache)") from None
