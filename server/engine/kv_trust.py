"""The trust between the engines of one prefill/decode pool (kv_transfer.py has the why): their
shared secret, and the MACs that sign what a prefill engine hands out and what crosses the transfer
port. torch-free: admission checks a decode request's params with it."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets

from kvpilot.server.engine.sampling_params import KVTransferParams

log = logging.getLogger("kvpilot.server.kv_transfer")
SECRET_ENV = "KVPILOT_KV_TRANSFER_SECRET"
MIN_SECRET_CHARS = 32


def transfer_secret(kv_role: str) -> bytes:
    """The pool's shared secret, from SECRET_ENV. Without it, an engine with kv_role both makes one up
    (and puts it into its environment, so an engine core process started from it has the same one): it
    hands off to itself alone. A prefill or a decode engine refuses to start: it would hand nothing off
    and only say so in a log line."""
    value = os.environ.get(SECRET_ENV)
    if not value:
        if kv_role != "both":
            raise ValueError(f"kv_role {kv_role} needs {SECRET_ENV}: a secret the prefill and decode engines of the pool share "
                             f"(at least {MIN_SECRET_CHARS} characters; the operator makes one per service)")
        value = os.environ[SECRET_ENV] = secrets.token_urlsafe(32)
        log.info("%s is not set: this engine (kv_role both) made up its own, and hands KV blocks off to itself alone", SECRET_ENV)
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{SECRET_ENV} must have at least {MIN_SECRET_CHARS} characters (got {len(value)})")
    return value.encode()


def mac(secret: bytes, *parts: bytes | memoryview) -> str:
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))  # lengths first: no two part lists hash alike
        digest.update(part)
    return digest.hexdigest()


def sign_params(secret: bytes, params: dict) -> str:
    """The signature of a prefill engine's hand-out: where to pull from and what."""
    names = ("remote_host", "remote_port", "remote_request_id", "remote_engine_id") + (("tp_size",) if params.get("tp_size") is not None else ())
    fields = [str(params[k]).encode() for k in names]  # (tp_size signed where given: params of engines before it still verify)
    return mac(secret, b"kv-transfer-params", *fields)


def params_verify(secret: bytes, params: KVTransferParams) -> bool:
    return isinstance(params.signature, str) and hmac.compare_digest(params.signature.encode(), sign_params(secret, params.as_dict()).encode())
