"""Opening a model for the engine: its weights (GGUF file or checkpoint directory) and its tokenizer.
Used by the engine and by every tensor-parallel rank."""

from __future__ import annotations

import logging
from pathlib import Path

from kvpilot.server.config import EngineConfig
from kvpilot.server.model_files import resolve_model_path

log = logging.getLogger(__name__)


def open_model(path: Path, load_format: str = "auto", seed: int = 0):
    """A GGUF file or a checkpoint directory -> (its weights, with .config, the model's shape; its tokenizer).
    load_format dummy: a checkpoint directory's config.json with seeded random weights (server/dummy_weights.py)."""
    from kvpilot.server.checkpoint import CONFIG, Checkpoint, is_checkpoint_dir, read_json
    from kvpilot.server.gguf_loader import GGUFFile
    from kvpilot.server.tokenizer import Tokenizer

    if load_format == "dummy":
        from kvpilot.server.dummy_weights import DummyWeights

        dummy = DummyWeights.of(path, seed)  # (refuses a path without a config.json)
        hf = read_json(path / CONFIG)
        if hf.get("quantization_config"):
            log.warning("%s: load_format=dummy makes float weights; its config's quantization_config (%s) is not applied", path,
                        hf["quantization_config"].get("quant_method", "?"))
        return dummy, Tokenizer.from_checkpoint(path, hf.get("eos_token_id"))
    if is_checkpoint_dir(path):
        checkpoint = Checkpoint(path)
        return checkpoint, Tokenizer.from_checkpoint(path, checkpoint.hf_config.get("eos_token_id"))
    gguf = GGUFFile(path)
    return gguf, Tokenizer.from_gguf(gguf)


def draft_model(config: EngineConfig, tokenizer):
    """The draft model's weights, refused unless it shares the target's vocabulary token
    for token (verification compares token ids)."""
    weights, draft_tokenizer = open_model(resolve_model_path(config.speculative_model))
    if draft_tokenizer.vocabulary() != tokenizer.vocabulary():
        raise ValueError(f"speculative_model {config.speculative_model!r} does not share the model's tokenizer (its vocabulary differs)")
    return weights


def draft_split(config: EngineConfig, weights) -> bool:
    """Whether the draft model is split over the tensor-parallel ranks (else whole on rank 0): as
    speculative_draft_tensor_parallel_size says, unset: where its heads and FFN width divide as the
    target's must. Rank 0 and every other rank decide it alike from the same config and file."""
    from kvpilot.server.models.sharding import check_tensor_parallel, tensor_parallel_problems

    n, asked = config.tensor_parallel_size, config.speculative_draft_tensor_parallel_size
    if n == 1 or asked == 1:
        return False
    if asked == n:
        try:
            check_tensor_parallel(weights.config, n)
        except ValueError as e:
            raise ValueError(f"speculative_draft_tensor_parallel_size={n}: the draft model cannot be split ({e}); 1 keeps it whole on rank 0") from None
        return True
    return not tensor_parallel_problems(weights.config, n)
