"""Generates the InferenceService CRD, and its reference page, from the pydantic models (crd_types.py).

    python -m kvpilot.operator.crd_gen [--check]     # writes (or checks) crds/, charts/kvpilot/crds/ and docs/crd-reference.md
    python -m kvpilot.operator.crd_gen --apply CRD.yaml   # the chart's pre-upgrade hook: the cluster's CRD replaced by its

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
REFERENCE = ROOT / "docs" / "crd-reference.md"
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
            if rest.get("default") is None and resolved.get("type") == "object":  # optional object: absent means unset, not {}
                resolved.pop("default", None)
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
        elif key == "additionalProperties" and (value is False or (value is True and schema.get("x-kubernetes-preserve-unknown-fields"))):
            continue  # a structural schema prunes unknown fields itself (or, marked so, keeps them)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020 (pydantic) -> OpenAPI v3.0: a bound plus a boolean flag
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out and "default" not in out and not out.get("required"):
        # The API server checks a default against the object's CEL rules as it is written: with rules, the
        # fields they read carry their own defaults in it.
        out["default"] = {k: sub["default"] for k, sub in out["properties"].items() if sub.get("default") not in (None, {})} \
            if "x-kubernetes-validations" in out else {}
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
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.source", "description": "Where the weights come from"},
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine", "description": "kvpilot, vllm or sglang"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready pods (of a disaggregated service: decode pods)"},
        {"name": "Status", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason",
         "description": "Why Ready is what it is: Serving, ScaledToZero, NoReadyPods, or what keeps pods from running"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas", "description": "Pods that exist"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas", "description": "Pods the autoscaler wants"},
        {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.readyReplicas",
         "description": "A disaggregated service's ready prefill pods (empty when it is not)"},
        {"name": "PrefillDesired", "type": "integer", "jsonPath": ".status.prefill.desiredReplicas", "priority": 1,
         "description": "Prefill pods the autoscaler wants"},
        {"name": "KV", "type": "string", "jsonPath": ".status.lastMetrics.kvCacheUtilization", "description": "Mean KV-cache utilization"},
        {"name": "Queue", "type": "string", "jsonPath": ".status.lastMetrics.queueDepth", "description": "Mean waiting requests per pod"},
        {"name": "Adapters", "type": "integer", "jsonPath": ".status.adapterCount", "description": "LoRA adapters in spec.adapters (per-adapter pods: kubectl describe)"},
        {"name": "ColdStart", "type": "number", "jsonPath": ".status.lastColdStart.totalSeconds", "priority": 1,
         "description": "The newest engine pod's start, created to Ready, seconds (phases: kubectl describe)"},
        {"name": "URL", "type": "string", "jsonPath": ".status.endpoint", "priority": 1,
         "description": "The in-cluster OpenAI API base URL (kubectl get -o wide)"},
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


def _type(schema: dict) -> str:
    kind = schema.get("type", "object" if "properties" in schema else "any")
    if kind == "array":
        return f"[]{_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map[string]{_type(schema['additionalProperties'])}"
    return kind


def _constraints(schema: dict) -> str:
    out = []
    if "enum" in schema:
        out.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    for key, sign in (("minimum", ">"), ("maximum", "<")):
        if key in schema:
            exclusive = schema.get("exclusive" + key.capitalize(), False) is True
            out.append(f"{sign}{'' if exclusive else '='} {schema[key]}")
    for key, what in (("minLength", "length >="), ("maxLength", "length <="), ("minItems", "items >="), ("maxItems", "items <=")):
        if key in schema:
            out.append(f"{what} {schema[key]}")
    if "pattern" in schema:
        out.append(f"pattern `{schema['pattern']}`")
    out += [f"CEL `{rule['rule']}`: {rule['message']}" for rule in schema.get("x-kubernetes-validations", [])]
    return "; ".join(out)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _rows(schema: dict, path: str, required: set[str]) -> list[str]:
    rows = []
    for name, sub in schema.get("properties", {}).items():
        field = f"{path}.{name}"
        default = f"`{sub['default']}`" if "default" in sub and sub["default"] != {} else ""
        rows.append(f"| `{field}`{' (required)' if name in required else ''} | {_type(sub)} | {_cell(default)} | "
                    f"{_cell(_constraints(sub))} | {_cell(sub.get('description', ''))} |")
        nested = sub.get("items", sub) if sub.get("type") == "array" else sub
        if "properties" in nested:
            rows += _rows(nested, field + ("[]" if sub.get("type") == "array" else ""), set(nested.get("required", [])))
    return rows


def render_reference() -> str:
    """docs/crd-reference.md: every field of spec and status with its type, default, bounds, CEL rules
    and description, read from the same schema as the CRD (so the two cannot disagree)."""
    version = crd()["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]["properties"]
    spec, status = root["spec"], root["status"]
    header = "| field | type | default | constraints | description |\n|---|---|---|---|---|"
    lines = [
        "<!-- Generated from operator/crd_types.py by `make crds`. Do not edit: a test fails when it is stale. -->",
        f"# {KIND} reference (`{GROUP}/{VERSION}`)", "",
        f"{spec['description']} Short names: `kvis`, `kvisvc`. The scale subresource acts on `.spec.replicas`.", "",
        "Rules over the whole spec (CEL, checked by the API server):", "",
        *[f"- `{r['rule']}`: {r['message']}" for r in spec.get("x-kubernetes-validations", [])], "",
        "## spec", "", header, *_rows(spec, "spec", set(spec.get("required", []))), "",
        "## status", "", "Written by the operator only.", "", header, *_rows(status, "status", set()), "",
        "## `kubectl get kvis` columns", "", "| column | from | meaning |", "|---|---|---|",
        *[f"| {c['name'].upper()} | `{c['jsonPath']}` | {_cell(c.get('description', ''))} |" for c in version["additionalPrinterColumns"]], "",
    ]
    return "\n".join(lines)


def outputs() -> dict[Path, str]:
    text = render()
    return {**{p: text for p in OUTPUTS}, REFERENCE: render_reference()}


def apply_crd(path: Path) -> None:
    """Replace the cluster's CRD with a file's (the chart's pre-upgrade hook: Helm installs CRDs on first install only). A
    replace, not a server-side apply: what the new copy leaves out (a property, a default, a reworded CEL rule) must go, and
    the first install's fields are owned by another manager, which an apply would leave in place."""
    from kubernetes import client, dynamic

    from kvpilot.operator.kube import load_config

    load_config()
    obj = yaml.safe_load(path.read_text())
    if obj.get("kind") != "CustomResourceDefinition" or obj["metadata"]["name"] != f"{PLURAL}.{GROUP}":
        raise SystemExit(f"{path}: not the {PLURAL}.{GROUP} CustomResourceDefinition")
    crds = dynamic.DynamicClient(client.ApiClient()).resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    current = crds.get(name=obj["metadata"]["name"])  # (absent: Helm's install makes it; with --skip-crds, kubectl apply crds/ first)
    obj["metadata"]["resourceVersion"] = current.metadata.resourceVersion
    replaced = crds.replace(body=obj)
    print(f"replaced {obj['metadata']['name']} (resourceVersion {replaced.metadata.resourceVersion})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if the files differ from what the models generate")
    ap.add_argument("--apply", type=Path, metavar="CRD.yaml", help="replace the cluster's CRD with this file's instead")
    args = ap.parse_args(argv)
    if args.apply:
        apply_crd(args.apply)
        return 0
    files = outputs()
    stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run make crds)", file=sys.stderr)
        return 1 if stale else 0
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
