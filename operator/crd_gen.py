"""Generates the InferenceService CRD from the pydantic models (crd_types.py).

    python -m kvpilot.operator.crd_gen [--check]     # writes (or checks) crds/ and charts/kvpilot/crds/

The OpenAPI v3 schema is made structural: $refs inlined, Optional[X] becomes X (absent = unset),
titles dropped, objects with only defaulted fields default to {} so nested defaults apply.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpilot.operator.crd_types import GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec, InferenceServiceStatus

ROOT = Path(__file__).resolve().parents[1]
OUTPUTS = [ROOT / "crds" / f"{GROUP}_{PLURAL}.yaml", ROOT / "charts" / "kvpilot" / "crds" / f"{GROUP}_{PLURAL}.yaml"]
_DROP = {"title", "examples"}


def _structural(schema: dict, defs: dict) -> dict:
    if "$ref" in schema:
        target = copy.deepcopy(defs[schema["$ref"].split("/")[-1]])
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in schema:  # Optional[X] -> X
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if len(options) == 1:
            resolved = _structural({**options[0], **rest}, defs)
            if resolved.get("default") == {}:  # optional object: absent means unset, not {}
                resolved.pop("default")
            return resolved
        raise ValueError(f"unions are not structural: {schema}")
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP or key == "$defs":
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        elif key == "default" and value is None:
            continue
        elif key == "additionalProperties" and value is False:
            continue  # a structural schema prunes unknown fields itself
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020 (pydantic) -> OpenAPI v3.0: a bound plus a boolean flag
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out and "default" not in out and not out.get("required"):
        out["default"] = {}
    return out


def object_schema(model) -> dict:
    raw = model.model_json_schema(by_alias=True, mode="validation", ref_template="#/$defs/{model}")
    return _structural(raw, raw.get("$defs", {}))


def crd() -> dict:
    spec = object_schema(InferenceServiceSpec)
    status = object_schema(InferenceServiceStatus)
    status.pop("default", None)
    spec.pop("default", None)
    spec["description"] = InferenceServiceSpec.__doc__.strip().splitlines()[0]
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready pods"},
        {"name": "Status", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason",
         "description": "Why Ready is what it is: Serving, ScaledToZero, NoReadyPods, or what keeps pods from running"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas", "description": "Pods that exist"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas", "description": "Pods the autoscaler wants"},
        {"name": "KV", "type": "string", "jsonPath": ".status.lastMetrics.kvCacheUtilization", "description": "Mean KV-cache utilization"},
        {"name": "Queue", "type": "string", "jsonPath": ".status.lastMetrics.queueDepth", "description": "Mean waiting requests per pod"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "annotations": {"kvpilot.dev/generated-by": "kvpilot.operator.crd_gen (make crds)"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": ["kvis", "kvisvc"], "categories": ["kvpilot"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "InferenceService serves an LLM with kvpilot (or vLLM/SGLang) engine pods, autoscaled on KV-cache utilization and queue depth.",
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
                                   "spec": spec, "status": status},
                    "required": ["spec"],
                }},
            }],
        },
    }


def render() -> str:
    header = "# Generated from operator/crd_types.py by `make crds`. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if the files differ from what the models generate")
    args = ap.parse_args(argv)
    text = render()
    stale = [p for p in OUTPUTS if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run make crds)", file=sys.stderr)
        return 1 if stale else 0
    for p in OUTPUTS:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
