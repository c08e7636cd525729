"""load_format=dummy (server/dummy_weights.py): a model from its config.json alone, seeded random weights made where the
model computes. The names and shapes it makes are each family's real checkpoint's; the model it makes is a real one
(greedy equal to transformers holding the same weights), the same on every rank of a split model and for the same
seed, another for another seed."""

from __future__ import annotations

import shutil

import pytest

from checkpoint_factory import CASES


def test_dummy_weights_are_named_and_shaped_as_each_familys_checkpoint(family_checkpoints):
    from safetensors import safe_open

    from kvpilot.server.checkpoint import read_json
    from kvpilot.server.dummy_weights import expected_weights
    from kvpilot.server.model_config import config_from_hf

    for family in CASES:
        directory, _ = family_checkpoints[family]
        stored = {}
        for f in directory.glob("*.safetensors"):
            with safe_open(str(f), framework="pt") as st:
                stored |= {name: tuple(st.get_slice(name).get_shape()) for name in st.keys()}
        config = config_from_hf(read_json(directory / "config.json"), family, family)
        assert expected_weights(config) == stored, family


def config_only(directory, dest):
    """A copy of a checkpoint directory without its weight files."""
    shutil.copytree(directory, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return dest


@pytest.mark.timeout(300)
def test_a_dummy_model_is_its_configs_model_with_the_seeds_weights(family_checkpoints, tmp_path):
    """The tiny Qwen2 (q/k/v biases, tied head) from its config.json alone: greedy tokens equal transformers' model of that
    config holding DummyWeights' tensors (the family tests' rule); two ranks make and split the same weights (equal tokens);
    another seed is another model; a GGUF file, or a packed quantization, is refused by name."""
    import torch
    from test_model_families import PROMPTS, STEPS, greedy, llm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvpilot.server import SamplingParams
    from kvpilot.server.dummy_weights import DummyWeights
    from kvpilot.server.model_config import ModelFormatError
    from oracle import HFOracle, compare_greedy

    directory = config_only(family_checkpoints["qwen2"][0], tmp_path / "qwen2-config")
    assert not list(directory.glob("*.safetensors"))
    oracle = HFOracle(directory)
    oracle._tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(directory)), dtype=torch.float32).eval()
    dummy = DummyWeights.of(directory, seed=3)
    missing, unexpected = model.load_state_dict({name: dummy.load(name) for name in dummy.checkpoint_names()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (tied: transformers' head is the embedding)
    oracle._model = model
    want = [oracle._greedy(p, STEPS) for p in PROMPTS]

    engine = llm(directory, load_format="dummy", seed=3)
    _, tokens, topk = greedy(engine, batched=True)
    assert all(len(set(t)) > 3 for t in tokens) and len({tuple(t) for t in tokens}) == len(tokens)  # not a degenerate model
    result = compare_greedy(tokens, topk, want)
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run = lambda e: [o.outputs[0].token_ids for o in e.generate(PROMPTS[:3], params)]  # noqa: E731
    split = llm(directory, load_format="dummy", seed=3, tensor_parallel_size=2)
    assert run(split) == run(engine)
    split.engine.close()
    assert run(llm(directory, load_format="dummy", seed=4)) != run(engine)

    with pytest.raises(ModelFormatError, match="config.json"):
        llm(family_checkpoints["qwen2"][1], load_format="dummy")
    with pytest.raises(ValueError, match="load_format=dummy makes float weights"):
        llm(directory, load_format="dummy", quantization="gguf")
