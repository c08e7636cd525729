"""Response ids of the Responses API (api/responses.py), which kvpilot-gateway reads too (without the
server's other imports): `resp_<pod tag>_<32 random hex>` on a pod, where the tag — 8 hex digits of a
hash of the pod's IP address (POD_IP, set by the operator) — lets the gateway send a continuation
(previous_response_id) or a GET back to the pod that stored the response; `resp_<32 random hex>` elsewhere."""

from __future__ import annotations

import hashlib
import os
import uuid

RESPONSE_ID_PREFIX = "resp_"


def pod_tag(address: str) -> str:
    return hashlib.sha256(address.encode()).hexdigest()[:8]


def new_response_id() -> str:
    address = os.environ.get("POD_IP")
    return f"{RESPONSE_ID_PREFIX}{pod_tag(address) + '_' if address else ''}{uuid.uuid4().hex}"


def id_pod_tag(response_id: str) -> str | None:
    """The pod tag a response id carries, if any."""
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    parts = response_id[len(RESPONSE_ID_PREFIX):].split("_")
    return parts[0] if len(parts) == 2 and len(parts[0]) == 8 else None
