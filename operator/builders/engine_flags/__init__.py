"""What each pinned vLLM and SGLang release accepts on its command line: snapshots of their own argument
parsers (`<engine>-<version>.json`, written by snapshot.py in a throwaway environment: no engine is
installed here or in CI), and the check of a container's arguments against one.

The operator checks a service's `extraArgs` against the snapshot of the image it pins (a flag that
release does not have would crash-loop every pod: it is a Degraded condition instead); CI checks every
flag the builders emit (tests/test_operator_builders.py)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

SNAPSHOTS = Path(__file__).parent


@cache
def snapshot(engine: str, version: str) -> dict:
    path = SNAPSHOTS / f"{engine}-{version}.json"
    if not path.is_file():
        raise LookupError(f"no flag snapshot for {engine} {version}: write one with {SNAPSHOTS.name}/snapshot.py")
    return json.loads(path.read_text())


def image_version(image: str) -> str:
    """vllm/vllm-openai:v0.33.0 -> 0.33.0."""
    return image.rsplit(":", 1)[1].removeprefix("v")


def flag_problems(engine: str, version: str, args: list[str]) -> list[str]:
    """Why `args` would not parse, or would parse into something unintended, in that release: unknown
    flags, hidden or deprecated spellings, a value missing or given to a switch, a value outside the
    flag's choices, and (values the parsers take as free strings) vLLM's quantization methods and
    --speculative-config keys and method, SGLang's --speculative-algorithm."""
    snap, problems, i = snapshot(engine, version), [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            problems.append(f"{arg!r} is not a flag (a value with no flag before it)")
            continue
        name, eq, inline = arg.partition("=")
        flag = snap["flags"].get(name)
        if flag is None:
            problems.append(f"{name} is not a flag of {engine} {version}")
            if not eq and i < len(args) and not args[i].startswith("--"):
                i += 1  # its value, if it has one: one problem, not two
            continue
        if flag["hidden"] or flag["deprecated"]:
            problems.append(f"{name} is {'deprecated' if flag['deprecated'] else 'a hidden spelling'} in {engine} {version}")
        if not flag["takes_value"]:
            if eq:
                problems.append(f"{name} is a switch: it takes no value")
            continue
        if eq:
            value = inline
        elif i < len(args) and not args[i].startswith("--"):
            value, i = args[i], i + 1
        else:
            problems.append(f"{name} needs a value")
            continue
        problems += _value_problems(engine, version, snap, name, flag, value)
    return problems


def _value_problems(engine: str, version: str, snap: dict, name: str, flag: dict, value: str) -> list[str]:
    allowed = flag["choices"]
    if name == "--quantization" and "quantization_methods" in snap:
        allowed = snap["quantization_methods"]
    if name == "--speculative-algorithm" and "speculative_algorithms" in snap:
        allowed, value = snap["speculative_algorithms"], value.upper()
    if allowed is not None and value not in allowed:
        return [f"{name} {value}: {engine} {version} takes one of {', '.join(allowed)}"]
    if name == "--speculative-config" and "speculative_config" in snap:
        try:
            config = json.loads(value)
        except json.JSONDecodeError as e:
            return [f"--speculative-config is not JSON ({e})"]
        known = snap["speculative_config"]
        problems = [f"--speculative-config key {k!r} is not one of {engine} {version}'s" for k in config if k not in known["keys"]]
        if config.get("method") not in (None, *known["methods"]):
            problems.append(f"--speculative-config method {config['method']!r}: {engine} {version} takes one of {', '.join(known['methods'])}")
        return problems
    return []
