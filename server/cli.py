"""`kvpilot` command line: `generate` (offline, one prompt), `serve` (the HTTP server), `fetch-model`,
`make-draft` (a layer-truncated copy of a GGUF, a draft model for speculative decoding) and `train-eagle`
(an EAGLE-3 head trained on CPU).

Engine flags come from EngineConfig (one flag per field), so they mean the same everywhere.
"""

from __future__ import annotations

import argparse
import sys

from kvpilot.server.config import (
    VLLM_ALIASES,
    EngineConfig,
    ServerConfig,
    add_model_args,
    bare_switches,
    config_file_args,
    flag_error,
    parse_size,
    resolve_aliases,
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvpilot")
    except PackageNotFoundError:
        return "unknown"


def _engine_config(ns: argparse.Namespace) -> EngineConfig:
    values = {k: getattr(ns, k) for k in EngineConfig.model_fields if getattr(ns, k, None) is not None}
    return EngineConfig(**values)


def _hub_model(ns: argparse.Namespace) -> None:
    """MODEL as a Hugging Face Hub repository id: downloaded (or found in the Hugging Face cache) before
    anything loads, so that a missing repository is exit 2 at once; the engine gets the local path and the
    API's model name stays the id (vLLM's)."""
    from kvpilot.server.model_files import default_served_name, is_hub_model, resolve_model_path

    if ns.model and is_hub_model(ns.model):
        ns.served_model_name = ns.served_model_name or default_served_name(ns.model)
        ns.model = str(resolve_model_path(ns.model, weights=getattr(ns, "load_format", None) != "dummy"))


def _generate(ns: argparse.Namespace) -> int:
    _hub_model(ns)
    config = _engine_config(ns)
    from kvpilot.server.engine.llm_engine import LLMEngine
    from kvpilot.server.engine.sampling_params import SamplingParams

    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=config.seed)
    prompt = ns.prompt
    if not ns.raw and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request(prompt, params)
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].text_delta)
            sys.stdout.flush()
            finish = out.outputs[0].finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from kvpilot.server.threads import configure_threads

    _hub_model(ns)
    configure_threads(ns.num_threads)  # before torch and the server load
    from kvpilot.server.api.app import run_server

    return run_server(ns)


def _serve_worker(ns: argparse.Namespace) -> int:
    from kvpilot.server.threads import configure_threads

    _hub_model(ns)
    config = _engine_config(ns)
    if config.group_rank == 0:
        raise ValueError("serve-worker runs a group's pod other than its leader: --group-rank 1 or more (the leader runs serve)")
    configure_threads(config.num_threads)
    from kvpilot.server.config import ServerConfig
    from kvpilot.server.engine.parallel import serve_group_pod

    host = ns.host or ServerConfig(host=None).bind_host
    return serve_group_pod(config, host, ns.port)


def _fetch_model(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpilot.server.engine.termination import write_termination_message
    from kvpilot.server.fetch import CHECKPOINT, CHECKPOINT_CONFIG, FetchError, fetch
    from kvpilot.server.model_source import parse_model_source

    if ns.config_only and ((src := parse_model_source(ns.source)).kind != "hf" or src.path):
        raise FetchError(f"{ns.source}: --config-only takes a whole checkpoint (hf://org/repo), not one file")
    fetched = fetch(ns.source, Path(ns.dest), timeout=ns.timeout, max_bytes=parse_size(ns.max_size),
                    wanted=CHECKPOINT_CONFIG if ns.config_only else CHECKPOINT)
    # A model cache's loader Job: the operator reads what was fetched from the pod's termination message.
    write_termination_message(fetched.summary())
    return 0


def _make_draft(ns: argparse.Namespace) -> int:
    from kvpilot.server.gguf_loader import write_truncated
    from kvpilot.server.model_files import resolve_model_path

    path = write_truncated(resolve_model_path(ns.model), ns.dest, ns.layers)
    print(f"wrote {path} ({ns.layers} layers of {ns.model})", file=sys.stderr)
    return 0


def _train_eagle(ns: argparse.Namespace) -> int:
    from kvpilot.server.eagle_training import train_eagle

    train_eagle(ns.dest, ns.model, ns.prompts, ns.max_tokens, ns.draft_vocab, ns.epochs, ns.seed, ns.threads, ns.quantization,
                ns.written_prompts, log=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


MODEL_HELP = ("the model, as vLLM's `serve MODEL` (or --model): a bundled name, a GGUF file, a checkpoint directory, or a Hugging Face "
              "Hub repository id (ORG/REPO, ORG/REPO@REVISION, hf://ORG/REPO[/FILE.gguf][@REVISION]) downloaded into the Hugging Face "
              "cache (HF_HOME) unless there, with HF_TOKEN and HF_ENDPOINT")


def _positional_model(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """`serve MODEL` / `generate MODEL PROMPT`: the positional MODEL is --model; both given must agree."""
    given = getattr(ns, "model_arg", None)
    if hasattr(ns, "model_arg"):
        del ns.model_arg
    if given is None:
        return
    if getattr(ns, "model", None) is not None and ns.model != given:
        parser.error(f"argument MODEL: {given!r} and --model {ns.model!r} name different models (give one)")
    ns.model = given


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot", description="kvpilot inference engine")
    parser.add_argument("--version", action="version", version=f"kvpilot {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("model_arg", nargs="?", metavar="MODEL", help=MODEL_HELP)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    gen.add_argument("--config", metavar="FILE.yaml", help=CONFIG_HELP)
    add_model_args(gen, EngineConfig)
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help=MODEL_HELP)
    serve.add_argument("--config", metavar="FILE.yaml", help=CONFIG_HELP)
    add_model_args(serve, EngineConfig)
    add_model_args(serve, ServerConfig)
    serve.set_defaults(func=_serve)
    worker = sub.add_parser("serve-worker", help="run one pod of a serving group other than its leader (--group-rank, --group-leader): "
                                                 "its share of the ranks, and /health and /ready")
    worker.add_argument("model_arg", nargs="?", metavar="MODEL", help=MODEL_HELP)
    worker.add_argument("--config", metavar="FILE.yaml", help=CONFIG_HELP)
    worker.add_argument("--host", default=None, help="address /health and /ready are served on (default: 0.0.0.0 in a pod, else 127.0.0.1)")
    worker.add_argument("--port", type=int, default=8000, help="port of /health and /ready (default: 8000)")
    add_model_args(worker, EngineConfig)
    worker.set_defaults(func=_serve_worker)
    fetch = sub.add_parser("fetch-model", help="download a model file (https://…/file.gguf, hf://org/repo/file) or a whole "
                                               "checkpoint (hf://org/repo) to DEST; an interrupted download resumes when run again")
    fetch.add_argument("source")
    fetch.add_argument("dest", help="the file to write, or for hf://org/repo the directory (files are written as NAME.part, then renamed)")
    fetch.add_argument("--timeout", type=float, default=1800, help="seconds for the whole download (default: 1800)")
    fetch.add_argument("--max-size", default="256GiB", help="refuse sources larger than this (default: 256GiB)")
    fetch.add_argument("--config-only", action="store_true", help="of a whole checkpoint (hf://org/repo), its config and tokenizer "
                                                                   "files only: what --load-format dummy reads")
    fetch.set_defaults(func=_fetch_model)
    draft = sub.add_parser("make-draft", help="write a draft model for speculative decoding: the first LAYERS blocks of a GGUF")
    draft.add_argument("model", help="bundled model name or GGUF path")
    draft.add_argument("dest", help="the GGUF file to write")
    draft.add_argument("--layers", type=int, required=True, help="decoder blocks to keep")
    draft.set_defaults(func=_make_draft)
    eagle = sub.add_parser("train-eagle", help="train an EAGLE-3 head for a model on CPU, from text the model writes itself (no network)")
    eagle.add_argument("dest", help="the head's directory to write (config.json, model.safetensors, TRAINING.json)")
    eagle.add_argument("--model", default="smollm2-135m", help="bundled model name, GGUF file or checkpoint directory")
    eagle.add_argument("--prompts", type=int, default=1500, help="prompts the model answers (of the 6,515 made in kvpilot.server.eagle_training)")
    eagle.add_argument("--written-prompts", type=int, default=1500,
                       help="requests the model writes itself from its chat template's opening of a user turn (0: none)")
    eagle.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    eagle.add_argument("--draft-vocab", type=int, default=8192, help="the head's vocabulary: the model's most frequent choices")
    eagle.add_argument("--epochs", type=int, default=8)
    eagle.add_argument("--seed", type=int, default=0)
    eagle.add_argument("--threads", type=int, default=2, help="torch threads (fixed: the same command writes the same head)")
    eagle.add_argument("--quantization", default="auto", help="the model's weight format while it writes and is read (the one it is served in)")
    eagle.set_defaults(func=_train_eagle)
    return parser


CONFIG_HELP = ("vLLM's: flags from a YAML mapping of flag names (dashes or underscores) to values (true: the switch, false: its "
               "--no- form, a list: its values); flags on the command line override it")


def with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with the flags of its --config FILE.yaml inserted right after the subcommand and the positionals that follow
    it (vLLM's `[subcommand, model_tag, *config_args, *rest]`), so those given on the command line (later) override them
    and a list flag at the file's end (lora_modules: [...]) cannot take the positional MODEL for one of its values; a key
    that is no flag of the subcommand is an error naming it."""
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"] + [a[len("--config="):] for a in argv if a.startswith("--config=")]
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if not paths or command is None:
        return argv
    sub = parser._subparsers._group_actions[0].choices.get(argv[command])
    added: list[str] = []
    switches = {flag for flag, action in sub._option_string_actions.items() if action.nargs == 0} if sub is not None else set()
    for path in paths:
        flags = config_file_args(path, switches)
        for flag in flags:
            if flag.startswith("--") and sub is not None and flag not in sub._option_string_actions:
                raise ValueError(f"--config {path}: {flag[2:]} is no flag of kvpilot {argv[command]}")
        added += flags
    at = command + 1
    while at < len(argv) and not argv[at].startswith("-"):  # `serve MODEL`, `generate MODEL PROMPT`: the config goes after them
        at += 1
    return [*argv[:at], *added, *argv[at:]]


def resolve_vllm_aliases(ns: argparse.Namespace) -> argparse.Namespace:
    """vLLM's flags without a field of their own (config.VLLM_ALIASES) set the fields they mean, in place."""
    values = {k: v for k, v in vars(ns).items() if v is not None}
    for model in (EngineConfig, ServerConfig):
        values = resolve_aliases(values, model)
    for name in VLLM_ALIASES:
        if hasattr(ns, name):
            delattr(ns, name)
    for name, value in values.items():
        setattr(ns, name, value)
    return ns


def main(argv: list[str] | None = None) -> int:
    from kvpilot.server.fetch import FetchError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = with_config_file(parser, argv)
    except ValueError as e:
        parser.error(str(e))
    ns = parser.parse_args(bare_switches(argv))
    _positional_model(parser, ns)
    try:
        return resolve_vllm_aliases(ns).func(ns)
    except (ValueError, FileNotFoundError) as e:
        from kvpilot.server.engine.termination import write_termination_message

        message = flag_error(e)  # a pydantic ValidationError in the flags' terms: "--max-num-seqs: must be >= 1"
        print(f"kvpilot: error: {message}", file=sys.stderr)
        write_termination_message(f"kvpilot: error: {message}")  # what the pod's status shows (Kubernetes' termination message)
        return 2
    except FetchError as e:
        from kvpilot.server.engine.termination import write_termination_message

        print(f"kvpilot: fetch failed: {e}", file=sys.stderr)
        write_termination_message(f"kvpilot: fetch failed: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
