"""Prefix-cache block keys fit to leave the process: SHA-256 chains from a salt of the engine's identity,
the same in every process whatever PYTHONHASHSEED, different wherever cached K/V would differ."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvpilot.server.engine.block_manager import BlockManager, adapter_root, block_hash, cache_salt
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.sequence import Sequence

# A salt from string-valued fields (what Python's per-process string hashing would make differ), a
# LoRA adapter's root, three full blocks of four tokens: the key chain as hex, one key per line.
KEYS_SCRIPT = """
from kvpilot.server.engine.block_manager import BlockManager, cache_salt
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.sequence import Sequence
bm = BlockManager(8, 4, salt=cache_salt({"model": "abc", "dtype": "torch.float32", "speculative": ["eagle3", "def"]}),
                  adapter_fingerprint=lambda adapter: b"adapter-files-digest")
for adapter in (0, 7):
    seq = Sequence(0, "r", 0, list(range(100, 113)), SamplingParams(), adapter=adapter)
    bm.allocate(seq, 13)
    bm.cache_full_blocks(seq, 13)
    print(*(h.hex() for h in seq.block_hashes))
    bm.free_seq(seq)
"""


def test_keys_are_the_same_in_every_process():
    outputs = set()
    for seed in ("0", "1", "4242"):
        run = subprocess.run([sys.executable, "-c", KEYS_SCRIPT], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert run.returncode == 0, run.stderr
        outputs.add(run.stdout)
    assert len(outputs) == 1
    base, adapted = outputs.pop().split("\n")[:2]
    salt = cache_salt({"speculative": ["eagle3", "def"], "dtype": "torch.float32", "model": "abc"})  # key order does not matter
    first = block_hash(salt, (100, 101, 102, 103))
    assert base.split() == [first.hex(), block_hash(first, (104, 105, 106, 107)).hex(), block_hash(block_hash(first, (104, 105, 106, 107)),
                                                                                                  (108, 109, 110, 111)).hex()]
    assert adapted.split()[0] == block_hash(adapter_root(salt, b"adapter-files-digest"), (100, 101, 102, 103)).hex()
    assert not set(base.split()) & set(adapted.split())


def test_keys_separate_salts_adapters_and_chains():
    salts = [cache_salt({"model": "m", "block_size": 16, "kv_dtype": kv}) for kv in ("torch.bfloat16", "torch.float32")]
    assert salts[0] != salts[1] and len(salts[0]) == 32
    assert block_hash(salts[0], (1, 2)) != block_hash(salts[1], (1, 2))
    assert block_hash(salts[0], (1, 2)) != block_hash(salts[0], (2, 1))
    assert adapter_root(salts[0], b"a") != adapter_root(salts[0], b"b")
    with pytest.raises(Exception, match="argument out of range|required argument"):  # an async placeholder is never keyed
        block_hash(salts[0], (1, -1))


def test_caches_of_different_salts_share_nothing():
    """Two block managers of different identities: the same prompt is a hit in its own cache only."""
    a = BlockManager(8, 4, salt=cache_salt({"model": "a"}))
    b = BlockManager(8, 4, salt=cache_salt({"model": "b"}))
    for bm in (a, b):
        seq = Sequence(0, "r", 0, list(range(9)), SamplingParams())
        bm.allocate(seq, 9)
        bm.cache_full_blocks(seq, 9)
    assert not set(a.cached) & set(b.cached)
    assert len(a.match_prefix(Sequence(1, "r", 0, list(range(9)), SamplingParams()))) == 2


def test_model_fingerprint_follows_the_contents_not_the_place(model_path, tmp_path, family_checkpoints):
    from kvpilot.server.model_files import SAMPLE_WINDOWS, WINDOW_BYTES, model_fingerprint

    copy = tmp_path / "elsewhere.gguf"
    shutil.copyfile(model_path, copy)
    assert model_fingerprint(copy) == model_fingerprint(model_path)
    size = copy.stat().st_size
    step = (size - WINDOW_BYTES) // (SAMPLE_WINDOWS - 1)
    with copy.open("r+b") as f:  # one byte inside the eighth sampled window, deep in the weights
        f.seek(7 * step + 100)
        byte = f.read(1)
        f.seek(7 * step + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert model_fingerprint(copy) != model_fingerprint(model_path)
    qwen2, qwen3 = family_checkpoints["qwen2"][0], family_checkpoints["qwen3"][0]
    assert model_fingerprint(qwen2) != model_fingerprint(qwen3)
    moved = shutil.copytree(qwen2, tmp_path / "moved")
    assert model_fingerprint(moved) == model_fingerprint(qwen2)


def test_the_engine_salts_its_keys_with_what_its_kv_depends_on():
    from kvpilot.server.engine.block_manager import cache_salt as salt_of
    from kvpilot.server.llm import LLM
    from kvpilot.server.model_files import model_fingerprint

    engine = LLM(num_threads=1, show_progress=False, kv_cache_memory="16MiB").engine
    identity = engine._kv_identity()
    assert identity["model"] == model_fingerprint(engine.model_path)
    assert (identity["block_size"], identity["kv_dtype"], identity["quantization"]) == (engine.config.block_size, str(engine.worker.kv_dtype), "none")
    assert engine.block_manager.salt == salt_of(identity)
    bm = engine.block_manager
    seq = Sequence(0, "r", 0, list(range(40)), SamplingParams())
    bm.allocate(seq, 40)
    bm.cache_full_blocks(seq, 40)
    assert seq.block_hashes[0] == block_hash(salt_of(identity), tuple(range(bm.block_size)))
    bm.free_seq(seq)
