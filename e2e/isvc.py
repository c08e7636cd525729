"""InferenceService helpers shared by the e2e tests: apply one, read it back, read a condition."""

from __future__ import annotations

import json

API_VERSION = "serving.kvpilot.dev/v1alpha1"


def apply_isvc(cluster, namespace: str, name: str, spec: dict) -> None:
    body = {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def get_isvc(cluster, namespace: str, name: str) -> dict | None:
    r = cluster.kubectl("get", "kvis", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def condition(obj: dict | None, type_: str) -> dict:
    return next((c for c in (obj or {}).get("status", {}).get("conditions", []) if c["type"] == type_), {})
