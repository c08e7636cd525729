"""Writes the snapshot of one engine release's command-line flags that CI checks the builders against
(tests/test_operator_builders.py). Not run by CI, which installs no engine: run once per version bump,
in a throwaway virtual environment holding that engine's wheel (installed with --no-deps; the modules
its argument parser imports added one by one), and commit the JSON it writes:

    VLLM_TARGET_DEVICE=cpu python operator/builders/engine_flags/snapshot.py vllm operator/builders/engine_flags/
    python operator/builders/engine_flags/snapshot.py sglang operator/builders/engine_flags/

Recorded per flag: whether it takes a value, its choices when the parser restricts them, and whether
it is hidden or deprecated; for vLLM also the keys and methods of --speculative-config (a JSON value its
own parser never sees) and its quantization methods (--quantization is an unrestricted string there);
for SGLang the --speculative-algorithm names (also unrestricted by its parser).
VLLM_TARGET_DEVICE=cpu only lets vLLM resolve a platform on a machine without a GPU: its flags do
not depend on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from importlib.metadata import version
from pathlib import Path


def _flags(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """Every option string the parser accepts (its lookup table: hidden spellings included), each with
    whether it takes a value, its choices when restricted, and whether it is hidden from --help or
    deprecated (accepted for now: the builders must not emit it)."""
    deprecated = getattr(parser, "_deprecated", set())  # vLLM's FlexibleArgumentParser keeps its deprecated actions here
    out = {}
    for flag, action in parser._option_string_actions.items():
        if isinstance(action, argparse._HelpAction):
            continue
        out[flag] = {"takes_value": action.nargs != 0,
                     "choices": sorted(str(c) for c in action.choices) if action.choices is not None else None,
                     "hidden": flag not in action.option_strings, "deprecated": action in deprecated}
    return dict(sorted(out.items()))


def _literal_values(tp) -> list[str]:
    """Every string of a Literal, through unions and nested Literals."""
    if typing.get_origin(tp) is typing.Literal:
        return [v for arg in typing.get_args(tp) for v in ([arg] if isinstance(arg, str) else _literal_values(arg))]
    return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]


def vllm() -> dict:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.model_executor.layers.quantization import QuantizationMethods
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    hints = typing.get_type_hints(SpeculativeConfig)
    return {"flags": _flags(make_arg_parser(FlexibleArgumentParser())),
            "speculative_config": {"keys": sorted(f.name for f in dataclasses.fields(SpeculativeConfig)),
                                   "methods": sorted(set(_literal_values(hints["method"])))},
            "quantization_methods": sorted(set(_literal_values(QuantizationMethods)))}


def sglang() -> dict:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {"flags": _flags(parser), "speculative_algorithms": sorted(a.name for a in SpeculativeAlgorithm if a.name != "NONE")}


def main() -> int:
    engine, out = sys.argv[1], Path(sys.argv[2])
    snapshot = {"engine": engine, "version": version(engine), **{"vllm": vllm, "sglang": sglang}[engine]()}
    path = out / f"{engine}-{snapshot['version']}.json"
    path.write_text(json.dumps(snapshot, indent=1) + "\n")
    print(f"{path}: {len(snapshot['flags'])} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
