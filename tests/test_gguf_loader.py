"""GGUF loading: dequantization bit-equal to the `gguf` package, the Q/K row permutation, clear errors."""

import numpy as np
import pytest
import torch

from gguf_factory import K_QUANT_LAYOUT, k_quant_blocks, write_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def reference(gguf_file, name: str) -> np.ndarray:
    import gguf

    t = gguf_file.tensors[name]
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


@pytest.mark.parametrize("kind", TYPES)
def test_dequantize_bit_equal_to_gguf(tmp_path, kind):
    from kvpilot.server.gguf_loader import GGUFFile

    rng = np.random.default_rng(0)
    data = (rng.standard_normal((7, 96)) * 3).astype(np.float32)  # odd row count, several 32-blocks per row
    f = GGUFFile(write_gguf(tmp_path / "t.gguf", {"w": (data, kind)}))
    ours = f.tensor("w", torch.float32).numpy()
    ref = reference(f, "w")
    assert ours.shape == ref.shape == data.shape
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32)), f"{kind}: not bit-equal"
    if kind != "F32":  # a real lossy round trip, not a copy of the input
        assert not np.array_equal(ours, data)


@pytest.mark.parametrize("kind", list(K_QUANT_LAYOUT))
def test_k_quants_dequantize_bit_equal_to_gguf(tmp_path, kind):
    import gguf

    from kvpilot.server.gguf_loader import GGUFFile

    rows, blocks = 5, 3  # 768 weights per row
    raw = k_quant_blocks(kind, rows, blocks, seed=1)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("w", raw.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "k.gguf")
    ours = f.tensor("w", torch.float32).numpy()
    ref = reference(f, "w").astype(np.float32)
    assert ours.shape == ref.shape == (rows, blocks * 256) and np.isfinite(ref).all() and np.abs(ref).max() > 0
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), f"{kind}: not bit-equal"


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight", "blk.0.attn_norm.weight"])
def test_bundled_model_tensors_bit_equal(gguf_file, name):
    ours = gguf_file.tensor(name, torch.float32).numpy()
    assert np.array_equal(ours.view(np.uint32), reference(gguf_file, name).astype(np.float32).view(np.uint32))


def test_bundled_model_types(gguf_file):
    from collections import Counter

    kinds = Counter(t.tensor_type.name for t in gguf_file.tensors.values())
    assert kinds == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


def test_qk_unpermute_matches_transformers(gguf_file, hf_oracle_session):
    """Our un-permuted Q/K rows equal the q_proj/k_proj weights transformers loads from the same file."""
    from kvpilot.server.gguf_loader import unpermute_rope_rows

    c = gguf_file.config
    hf = hf_oracle_session.model.model.layers
    for layer in (0, c.num_layers - 1):
        q = unpermute_rope_rows(gguf_file.tensor(f"blk.{layer}.attn_q.weight"), c.num_heads)
        k = unpermute_rope_rows(gguf_file.tensor(f"blk.{layer}.attn_k.weight"), c.num_kv_heads)
        assert torch.equal(q, hf[layer].self_attn.q_proj.weight.detach())
        assert torch.equal(k, hf[layer].self_attn.k_proj.weight.detach())
        # The stored layout really is permuted: loading it as is would be wrong.
        assert not torch.equal(gguf_file.tensor(f"blk.{layer}.attn_q.weight"), q)


def test_unpermute_inverts_llama_cpp_permute():
    from kvpilot.server.gguf_loader import unpermute_rope_rows

    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    # llama.cpp's converter: per head, rows (first half, second half) -> interleaved pairs.
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)


def test_model_config_of_bundled_model(gguf_file):
    c = gguf_file.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.max_position, c.rope_theta, c.tie_word_embeddings) == (49152, 8192, 100000.0, True)


def test_missing_model_is_a_clear_error(tmp_path):
    from kvpilot.server.model_files import ModelNotFoundError, resolve_model_path

    with pytest.raises(ModelNotFoundError, match="neither a bundled model"):
        resolve_model_path(str(tmp_path / "nope.gguf"))


def _reader_view(path):
    """gguf's own GGUFReader on a file: metadata as Python values, tensors as (type, shape, bytes)."""
    import gguf

    from kvpilot.server.gguf_loader import _field_value

    reader = gguf.GGUFReader(path)
    metadata = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, {t.name: (t.tensor_type, t.shape.tolist(), int(t.n_bytes), t.data) for t in reader.tensors}


def _assert_read_like_gguf_reader(path):
    from kvpilot.server.gguf_loader import GGUFFile

    ours = GGUFFile(path)
    metadata, tensors = _reader_view(path)
    assert ours.metadata == metadata
    assert list(ours.tensors) == list(tensors)
    for name, (kind, shape, n_bytes, data) in tensors.items():
        t = ours.tensors[name]
        assert (t.tensor_type, t.shape.tolist(), t.n_bytes) == (kind, shape, n_bytes), name
        assert t.data.dtype == data.dtype and t.data.shape == data.shape and np.array_equal(t.data, data), name


def test_header_reader_agrees_with_gguf_reader_on_every_value_type_and_tensor_kind(tmp_path):
    """Our header reader (gguf's GGUFReader takes 6 s on the bundled model's tokenizer arrays) gives
    GGUFReader's metadata and tensor views: every scalar type, string and numeric arrays, odd-shaped
    float and block-quantized tensors, a custom alignment."""
    import gguf

    rng = np.random.default_rng(1)
    scalars = [(f"t.{k.name.lower()}", True if k == gguf.GGUFValueType.BOOL else 7, k) for k in gguf.GGUFValueType
               if k not in (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)]
    metadata = {"t.string": "héllo ▁wörld", "t.strings": ["a", "", "ĠThe", "<|im_start|>", "日本"] * 50, "t.ints": list(range(-3, 300)),
                "t.floats": [0.5, -1.25, 3.0], "t.bools": [True, False, True]}
    tensors = {"f32": (rng.standard_normal((3, 5)), "F32"), "f16": (rng.standard_normal((4, 7)), "F16"), "vec": (rng.standard_normal(9), "F32"),
               "q8": (rng.standard_normal((5, 64)), "Q8_0"), "q4": (rng.standard_normal((2, 96)), "Q4_1"), "bf": (rng.standard_normal((3, 32)), "BF16")}
    path = write_gguf(tmp_path / "all.gguf", tensors, metadata=metadata, alignment=64, typed_metadata=scalars)
    _assert_read_like_gguf_reader(path)


def test_header_reader_agrees_with_gguf_reader_on_the_bundled_model():
    from kvpilot.server.model_files import resolve_model_path

    _assert_read_like_gguf_reader(resolve_model_path("smollm2-135m"))


def test_truncated_gguf_files_are_clear_errors(tmp_path):
    """Cut anywhere — in the header, the metadata, the tensor infos or the data — a file is refused
    with one error naming it, never an IndexError or a crash."""
    from kvpilot.server.gguf_loader import GGUFError, GGUFFile

    whole = write_gguf(tmp_path / "m.gguf", {"w": (np.ones((4, 64), np.float32), "Q8_0")}, metadata={"k": ["x"] * 10}).read_bytes()
    for cut in (0, 3, 10, 30, 60, len(whole) // 2, len(whole) - 32):  # the writer pads the end to 32 bytes
        part = tmp_path / f"cut{cut}.gguf"
        part.write_bytes(whole[:cut])
        with pytest.raises(GGUFError, match=f"cut{cut}.gguf: not a readable GGUF"):
            GGUFFile(part)


def test_not_a_gguf_file(tmp_path):
    from kvpilot.server.gguf_loader import GGUFError, GGUFFile

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not gguf at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        GGUFFile(bad)


def test_unsupported_architecture(tmp_path):
    from kvpilot.server.gguf_loader import GGUFFile
    from kvpilot.server.model_config import ModelFormatError

    f = GGUFFile(write_gguf(tmp_path / "m.gguf", {"w": (np.ones((2, 32), np.float32), "F32")}, arch="mamba"))
    with pytest.raises(ModelFormatError, match="architecture 'mamba' is not supported.*llama, qwen2, qwen3"):
        _ = f.config


def test_unsupported_tensor_type(tmp_path):
    from kvpilot.server.gguf_loader import GGUFError, GGUFFile

    f = GGUFFile(write_gguf(tmp_path / "m.gguf", {"w": (np.ones((2, 256), np.float32), "TQ2_0")}))
    with pytest.raises(GGUFError, match="type TQ2_0, which is not supported"):
        f.tensor("w")


def test_missing_tensor(gguf_file):
    from kvpilot.server.gguf_loader import GGUFError

    with pytest.raises(GGUFError, match="'output.weight' is missing"):
        gguf_file.tensor("output.weight")


# A GGUF's attention metadata that the check below varies (4 heads of 16 over an embedding length of 64, 2 K/V heads).
HEADS_METADATA = {"llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.block_count": 1, "llama.context_length": 256,
                  "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2}


@pytest.mark.parametrize("changes,message", [
    # each divided by zero (ZeroDivisionError reading the config) or built attention that cannot split its rows into heads
    ({"llama.attention.head_count": 0}, "llama.attention.head_count=0 (a count of heads is a positive integer)"),
    ({"llama.attention.head_count": 0, "llama.attention.key_length": 16}, "llama.attention.head_count=0 (a count of heads is a positive integer)"),
    ({"llama.attention.head_count": 4.0}, "llama.attention.head_count=4.0 (a count of heads is a positive integer)"),
    ({"llama.attention.head_count": [4]}, "llama.attention.head_count=[4] (a count of heads is a positive integer)"),
    ({"llama.attention.head_count_kv": 0}, "llama.attention.head_count_kv=0 (a count of heads is a positive integer)"),
    ({"llama.attention.head_count_kv": 3},
     "llama.attention.head_count=4 is not a multiple of llama.attention.head_count_kv=3"),
    ({"llama.attention.key_length": 0}, "llama.attention.key_length=0 (a head's size is a positive integer)"),
    ({"llama.rope.dimension_count": 0}, "llama.rope.dimension_count=0 (a head's size is a positive integer)"),
    ({"llama.attention.head_count": 3, "llama.attention.head_count_kv": 3},
     "llama.embedding_length 64 is not a multiple of llama.attention.head_count=3 "
     "(and no llama.attention.key_length or llama.rope.dimension_count is given)"),
])
def test_attention_heads_that_do_not_fit_are_refused_by_name(tmp_path, capsys, changes, message):
    """As a config.json's are (tests/test_model_families.py): a GGUFError naming the metadata key, which
    `kvpilot generate` turns into `kvpilot: error: ...` and exit 2, never a ZeroDivisionError."""
    import re

    from kvpilot.server.cli import main
    from kvpilot.server.gguf_loader import GGUFError, GGUFFile

    path = write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (np.zeros((8, 64), np.float32), "F32")},
                      metadata={**HEADS_METADATA, **changes, "tokenizer.ggml.model": "gpt2",
                                                     "tokenizer.ggml.tokens": [f"t{i}" for i in range(8)]})
    with pytest.raises(GGUFError, match=re.escape(f"m.gguf: {message}")):
        _ = GGUFFile(path).config
    assert main(["generate", "Hello", "--model", str(path), "--num-threads", "1", "--kv-cache-memory", "16MiB"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kvpilot: error: m.gguf: {message}"


@pytest.mark.parametrize("changes,heads", [
    ({}, (4, 2, 16)),
    ({"llama.attention.head_count_kv": None}, (4, 4, 16)),
    ({"llama.attention.key_length": 32}, (4, 2, 32)),
    ({"llama.rope.dimension_count": 8}, (4, 2, 8)),
    ({"llama.attention.key_length": 32, "llama.rope.dimension_count": 8}, (4, 2, 32)),
])
def test_attention_heads_of_a_gguf(tmp_path, changes, heads):
    """Valid files read as before: K/V heads default to the heads; a head is key_length wide, else
    rope.dimension_count, else embedding_length / heads."""
    from kvpilot.server.gguf_loader import GGUFFile

    metadata = {k: v for k, v in {**HEADS_METADATA, **changes}.items() if v is not None}
    c = GGUFFile(write_gguf(tmp_path / "m.gguf", {"w": (np.zeros((2, 32), np.float32), "F32")}, metadata=metadata)).config
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == heads
