"""docs/coming-from-vllm.md: each flag of `vllm serve` in the vLLM release the operator pins (the snapshot of its own
argument parser, operator/builders/engine_flags/vllm-<version>.json) with kvpilot's equivalent, read off kvpilot's own
`serve` parser, so the page says what the parser does. `python -m kvpilot.server.vllm_compat` writes the page;
tests/test_docs.py checks the committed one is what this writes. Not imported by the engine."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "coming-from-vllm.md"

# What a flag of kvpilot's own means differently from vLLM's, or why a flag of vLLM's has no equivalent.
NOTES: dict[str, str] = {
    "--config": "the same YAML mapping of flag names (dashes or underscores) to values; command-line flags override it",
    "--load-format": "auto and dummy (a checkpoint directory's config.json with seeded random weights, as vLLM's); vLLM's other "
                     "formats (pt, safetensors, npcache, tensorizer, bitsandbytes…) are not: the format is the model file's own",
    "--dtype": "half = float16, float = float32, as in vLLM; auto = float32 on CPU, bfloat16 on CUDA",
    "--async-scheduling": "bare = on, as in vLLM; kvpilot also takes `--async-scheduling` auto, on or off and its default is auto "
                          "(on for CUDA or with pipeline stages, unless n-gram lookups run)",
    "--kv-cache-dtype": "auto, fp8 (= fp8_e4m3), and kvpilot's float32 and bfloat16; fp8_e5m2 is not supported",
    "--kv-cache-memory-bytes": "vLLM's 1k = 1000 and 1K = 1024 are kept; on a GPU, the KV cache's size (instead of "
                               "`--gpu-memory-utilization`'s share), as in vLLM",
    "--speculative-config": "methods ngram, draft_model (= draft) and eagle3; keys method, model, num_speculative_tokens, "
                            "prompt_lookup_max, prompt_lookup_min, draft_tensor_parallel_size (a draft model: 1 keeps it whole on rank 0, "
                            "the tensor-parallel size splits it as the target; unset: split where it fits; eagle3: 1) (and the older "
                            "disable_by_batch_size); any other key or method is an "
                            "error. As in vLLM: without method, it is inferred from model (ngram; a name with eagle3: eagle3; "
                            "otherwise draft_model); for ngram, prompt_lookup_min or _max alone sets both, and neither is 5 and 5",
    "--spec-method": "ngram, draft_model (= draft) and eagle3",
    "--kv-events-config": "the same keys; events in vLLM 0.32's wire format with kvpilot's own block keys (the token ids they carry "
                          "are the request's); mediums GPU (the KV cache), CPU (host tier), STORAGE (disk tier)",
    "--kv-transfer-config": "kv_connector KVPilotTiersConnector (host and disk tiers) and KVPilotNixlConnector (prefill/decode) only",
    "--tokenizer": "only the model's own tokenizer: accepted when it names the model itself; any other value is an error",
    "--generation-config": "auto (the generation_config.json beside the checkpoint or GGUF), vllm (none) or a directory; "
                           "temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) become "
                           "the defaults of requests that do not set them",
    "--chat-template": "a file or the template itself",
    "--enable-auto-tool-choice": "requires `--tool-call-parser`, as in vLLM, and changes nothing else: kvpilot answers tool_choice "
                                 "auto with the parser set (without either flag, with the chat template's format)",
    "--enable-log-requests": "kvpilot logs requests by default (vLLM 0.33 does not); `--disable-log-requests` turns it off",
    "--tool-call-parser": "hermes and llama3_json; unset: the one the chat template writes",
    "--reasoning-parser": "qwen3 and deepseek_r1",
    "--lora-modules": "the name=path form (not JSON)",
    "--api-key": "one key (or the environment variable KVPILOT_API_KEY)",
    "--served-model-name": "one name",
    "--quantization": "kvpilot's methods: auto, none, gguf, int8, int4, gptq, awq, compressed-tensors, fp8",
    "--max-model-len": "vLLM's 32k / 32K spellings are accepted",
    "--max-num-batched-tokens": "vLLM's 8k / 8K spellings are accepted",
    "--log-level": "debug, info, warning, error",
    "--trust-remote-code": "no remote code is run: the architectures are kvpilot's own",
    "--download-dir": "`kvpilot fetch-model` downloads; the operator's model cache shares one download between pods",
    "--pipeline-parallel-size": "the same (`-pp`): consecutive layers per stage, tensor parallelism inside each; async scheduling keeps a "
                                "step per stage in flight; not with draft or EAGLE-3 speculation, nor a kv_role; one node (no Ray)",
    "--nnodes": "kvpilot's `--group-size`: the pods of a group, the ranks split evenly over them",
    "--node-rank": "kvpilot's `--group-rank` (LeaderWorkerSet's LWS_WORKER_INDEX)",
    "--master-addr": "kvpilot's `--group-leader` (LWS_LEADER_ADDRESS), on the pods other than the leader",
    "--master-port": "kvpilot's `--group-port`",
    "--headless": "kvpilot's `serve-worker` subcommand: a group's pod other than the leader (/health and /ready, no API)",
    "--cpu-offload-gb": "`--kv-host-offload-size` is a host tier of the prefix cache, not weight offload",
    "--kv-offloading-size": "GiB of host memory for offloaded KV blocks: kvpilot's host tier of the prefix cache",
    "--kv-offloading-backend": "native only (lmcache is not supported); needs `--kv-offloading-size`",
    "--uvicorn-log-level": "`--log-level` sets kvpilot's",
}
POSITIONAL = "MODEL"  # vLLM's `vllm serve MODEL` (its model_tag): no option string, so not in the snapshot


def pinned_snapshot() -> tuple[str, dict]:
    """(version, flags) of the vLLM release the operator pins."""
    from kvpilot.operator.builders.engine_flags import image_version, snapshot
    from kvpilot.operator.builders.engines import PINNED_IMAGES

    version = image_version(PINNED_IMAGES["vllm"])
    return version, snapshot("vllm", version)["flags"]


def vllm_flags() -> tuple[str, list[str]]:
    """(version, the flags `vllm serve --help` shows): the positional MODEL first, then the option strings that are not hidden."""
    version, flags = pinned_snapshot()
    return version, [POSITIONAL, *sorted(f for f, info in flags.items() if not info["hidden"])]


def kvpilot_serve_parser() -> argparse.ArgumentParser:
    from kvpilot.server.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["serve"]


def equivalent(flag: str, serve: argparse.ArgumentParser) -> str:
    from kvpilot.server.config import VLLM_ALIASES

    note = NOTES.get(flag)
    if flag == POSITIONAL:
        positional = any(not a.option_strings for a in serve._actions)
        return "`kvpilot serve MODEL`" if positional else "`--model MODEL` (a positional model is not supported)"
    action = serve._option_string_actions.get(flag)
    if action is None:
        return "not supported" + (f" ({note})" if note else "")
    alias = VLLM_ALIASES.get(action.dest)
    if alias is not None and alias.maps_to.startswith("not supported"):  # parsed only to refuse it with the reason
        return f"not supported: an error at start ({note})"
    text = f"`{flag}`"
    canonical = "--" + action.dest.replace("_", "-")  # kvpilot's own spelling of what the flag sets
    if alias is not None:
        if alias.maps_to:  # "": no flag of kvpilot's is the same, the note says what it does
            text += " = " + ", ".join(f"`{f.strip()}`" for f in alias.maps_to.split(","))
    elif isinstance(action, argparse.BooleanOptionalAction):
        pass  # kvpilot's own switch (--X and --no-X)
    elif action.const is False:
        text += f" = `--no-{canonical[2:]}`"
    elif isinstance(action.const, str) and flag != canonical:
        text += f" = `{canonical} {action.const}`"
    elif flag != canonical:
        text += f" = `{canonical}`"
    return text + (f": {note}" if note else "")


def render_page() -> str:
    serve = kvpilot_serve_parser()
    version, flags = vllm_flags()
    rows = [(flag, equivalent(flag, serve)) for flag in flags]
    supported = sum(not text.startswith("not supported") for _, text in rows)
    snapshot_path = f"../operator/builders/engine_flags/vllm-{version}.json"
    out = [
        "# Coming from vLLM",
        "",
        "`kvpilot serve` takes vLLM's spelling of every flag it has an equivalent of: the same names (`--max-num-seqs`, "
        "`--kv-cache-dtype`, `--enable-prefix-caching`, `--tensor-parallel-size`/`-tp`, …), vLLM's values (`--dtype half`, "
        "a bare `--async-scheduling`, `--max-model-len 32k`) and vLLM's flags that kvpilot spells otherwise, which parse to the "
        "same configuration as kvpilot's own (`--kv-cache-memory-bytes 2147483648` is `--kv-cache-memory 2GiB`; "
        "`--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'` is "
        "`--speculative-method ngram --num-speculative-tokens 4 --prompt-lookup-max 4 --prompt-lookup-min 4`). `--config FILE.yaml` reads flags from a YAML mapping, as "
        "vLLM's does, and the flags on the command line override it.",
        "",
        "A flag kvpilot does not support is an error at start (`unrecognized arguments`), never accepted and ignored; so is "
        "a value it cannot honour, named by its flag (`--max-num-seqs: must be >= 1`). `kvpilot serve --help` shows the flags "
        "in groups (model, cache, scheduling, speculative decoding, LoRA, TLS, server, …) with their choices and defaults.",
        "",
        f"Below: each of the {len(rows)} flags `vllm serve --help` shows in vLLM {version}, the release the operator pins "
        f"(the list is [the snapshot of its argument parser]({snapshot_path})), with kvpilot's equivalent; {supported} have one. "
        "This page is generated (`python -m kvpilot.server.vllm_compat`) and a test checks it is current.",
        "",
        f"| vLLM {version} | kvpilot |",
        "| --- | --- |",
    ]
    out += [f"| `{flag}` | {text} |" for flag, text in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    PAGE.write_text(render_page())
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
