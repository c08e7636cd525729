"""LoRA adapters: the delta kernels against their reference, adapters refused by name, and the engine's
greedy outputs with adapters against Hugging Face peft's (one at a time, one mixed batch with base rows,
over GGUF-block base weights, through the decode graphs' static buffers, with n-gram speculation,
with fewer slots than adapters)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch

from lora_factory import SPECS, STEPS
from oracle import ORACLE_PROMPTS, compare_greedy
from server_harness import SERVER_MODES

# --- kernels ---------------------------------------------------------------------------------------

def _random_case(t=13, k=40, n=56, slots=3, r=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    a = torch.randn(slots, k, r, generator=g)  # A^T per slot
    b = torch.randn(slots, r, n, generator=g)  # B^T per slot
    y = torch.randn(t, n, generator=g)
    token_slots = [2, 2, 0, 0, 0, -1, -1, 1, 2, 2, -1, 0, 1][:t]
    return x, a, b, y, token_slots


def _runs(token_slots):
    runs = []
    for row, slot in enumerate(token_slots):
        if runs and runs[-1][0] == slot and runs[-1][2] == row:
            runs[-1] = (slot, runs[-1][1], row + 1)
        else:
            runs.append((slot, row, row + 1))
    return [r for r in runs if r[0] >= 0]


def _expected(y, x, a, b, token_slots):
    out = y.clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            out[row] += (x[row] @ a[slot]) @ b[slot]
    return out


@pytest.mark.parametrize("kernel", ["runs", "reference", "triton"])
def test_lora_delta_kernels(kernel):
    from kvpilot.kernels.lora import LoRABatch, lora_add_ref_, lora_add_runs_

    x, a, b, y, token_slots = _random_case()
    batch = LoRABatch(torch.tensor(token_slots), _runs(token_slots))
    if kernel == "triton":
        from kvpilot.kernels.triton_lora import lora_add_ as add
    else:
        add = lora_add_runs_ if kernel == "runs" else lora_add_ref_
    got = y.clone()
    add(got, x, a, b, batch)
    torch.testing.assert_close(got, _expected(y, x, a, b, token_slots), rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, y)


# --- the engine against peft ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def peft_case(lora_peft_case):
    return lora_peft_case


@pytest.fixture(scope="module")
def lora_llm(peft_case):
    from kvpilot.server import LLM

    return LLM(num_threads=1, show_progress=False, enable_lora=True, max_loras=3, max_lora_rank=16)


def _request(paths, name):
    from kvpilot.server.adapters import LoRARequest

    return LoRARequest(name, 1, str(paths[name]))


def _greedy():
    from kvpilot.server import SamplingParams

    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)


def _check(outs, oracle):
    top5 = lambda e: sorted(e, key=e.get, reverse=True)[:5]
    result = compare_greedy([o.outputs[0].token_ids for o in outs], [[top5(e) for e in o.outputs[0].logprobs] for o in outs], oracle)
    assert result["exact"] >= result["total"] - 1, result
    assert not result["violations"], result
    return result


def test_adapters_change_the_base_model(peft_case):
    """The fixtures are worth testing with: each adapter changes peft's greedy output on >= 8 of 10 prompts."""
    _, results, base = peft_case
    for name, rs in results.items():
        changed = sum(r.tokens != b.tokens for r, b in zip(rs, base))
        assert changed >= 8, (name, changed)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_equals_peft_one_at_a_time(lora_llm, peft_case, name):
    paths, results, _ = peft_case
    outs = [lora_llm.generate(p, _greedy(), lora_request=_request(paths, name))[0] for p in ORACLE_PROMPTS[:3]]
    print(name, _check(outs, results[name][:3]))


def test_one_batch_of_base_rows_and_three_adapters_equals_peft(lora_llm, peft_case):
    paths, results, base = peft_case
    names = [None, *SPECS]
    prompts, requests, oracle = [], [], []
    for i, p in enumerate(ORACLE_PROMPTS):
        for name in (names[i % 4], names[(i + 1) % 4]):
            prompts.append(p)
            requests.append(_request(paths, name) if name else None)
            oracle.append((results[name] if name else base)[i])
    outs = lora_llm.generate(prompts, _greedy(), lora_request=requests)
    print(_check(outs, oracle))


def test_prompt_logprobs_equal_peft(lora_llm, peft_case):
    from kvpilot.server import SamplingParams

    paths, results, _ = peft_case
    name = "all7-r8"
    out = lora_llm.generate(ORACLE_PROMPTS[7], SamplingParams(max_tokens=1, prompt_logprobs=0), lora_request=_request(paths, name))[0]
    ids = out.prompt_token_ids
    ours = [entry[ids[j + 1]] for j, entry in enumerate(out.prompt_logprobs[1:])]
    assert max(abs(a - b) for a, b in zip(ours, results[name][7].prompt_logprobs)) < 1e-3


def test_prefix_cache_is_keyed_by_adapter(lora_llm, peft_case):
    """The same prompt under the base model, then an adapter: no KV is shared (an adapter changes K and
    V), and the adapter's output is still peft's; the same adapter files again, under another name, hit
    its blocks (keys start from the digest of the adapter's files, not its name or id)."""
    from kvpilot.server.adapters import LoRARequest

    paths, results, _ = peft_case
    prompt = ORACLE_PROMPTS[7]  # long enough for full blocks
    lora_llm.generate(prompt, _greedy())
    copy = paths["mixed-r16"].parent / "mixed-r16-copy"
    shutil.copytree(paths["mixed-r16"], copy, dirs_exist_ok=True)
    (copy / "adapter_config.json").write_text(json.dumps({**json.loads((copy / "adapter_config.json").read_text()), "lora_alpha": 17}))
    changed = LoRARequest("mixed-r16-alpha17", 1, str(copy))  # other files: never the blocks of mixed-r16
    first = lora_llm.generate(prompt, _greedy(), lora_request=changed)[0]
    assert first.num_cached_tokens == 0
    (copy / "adapter_config.json").write_bytes((paths["mixed-r16"] / "adapter_config.json").read_bytes())
    same = LoRARequest("mixed-r16-same-files", 1, str(copy))
    runs = [lora_llm.generate(prompt, _greedy(), lora_request=same)[0], lora_llm.generate(prompt, _greedy(), lora_request=_request(paths, "mixed-r16"))[0]]
    assert runs[1].num_cached_tokens > 0  # the blocks the same files computed under the other name
    assert first.outputs[0].logprobs != runs[0].outputs[0].logprobs  # alpha 17 is another adapter (its tokens may agree)
    _check(runs, [results["mixed-r16"][7]] * 2)


def test_fewer_slots_than_adapters_same_tokens(peft_case):
    """max_loras=2 with four adapters (one loaded twice under two names), all at once and in rotation:
    the same tokens as with a slot for each."""
    from kvpilot.server import LLM
    from kvpilot.server.adapters import LoRARequest

    paths, results, _ = peft_case
    llm = LLM(num_threads=1, show_progress=False, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    four = [*(LoRARequest(n, 1, str(paths[n])) for n in SPECS), LoRARequest("all7-r8-again", 1, str(paths["all7-r8"]))]
    expected = [*(results[n] for n in SPECS), results["all7-r8"]]
    prompts = ORACLE_PROMPTS[:2]
    requests = [four[(i + j) % 4] for i in range(len(prompts)) for j in range(4)]
    oracle = [expected[(i + j) % 4][i] for i in range(len(prompts)) for j in range(4)]
    outs = llm.generate([p for p in prompts for _ in range(4)], _greedy(), lora_request=requests)
    print("concurrent", _check(outs, oracle))
    rotation = [llm.generate(prompts[0], _greedy(), lora_request=r)[0] for r in [four[0], four[2], four[1], four[3], four[0]]]
    print("rotation", _check(rotation, [expected[i][0] for i in (0, 2, 1, 3, 0)]))
    assert sum(a.tensors is not None for a in llm.engine.lora.by_id.values()) <= 2  # host copies bounded by max_cpu_loras


def test_ngram_speculation_with_an_adapter_equals_without(lora_llm, peft_case):
    from kvpilot.server import LLM

    paths, _, _ = peft_case
    spec = LLM(num_threads=1, show_progress=False, enable_lora=True, max_lora_rank=16, speculative_method="ngram")
    request = _request(paths, "all7-r8")
    prompts = ORACLE_PROMPTS[:4]
    want = [o.outputs[0].token_ids for o in lora_llm.generate(prompts, _greedy(), lora_request=request)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, _greedy(), lora_request=request)]
    assert got == want


def test_gguf_base_weights_with_adapters_equal_peft(peft_case):
    """QLoRA-style: adapters over the GGUF's blocks (peft's base: the same GGUF dequantized)."""
    from kvpilot.server import LLM

    paths, results, _ = peft_case
    llm = LLM(num_threads=1, show_progress=False, quantization="gguf", enable_lora=True, max_loras=2, max_lora_rank=16)
    names = ["all7-r8", "mixed-r16"]
    outs = llm.generate(ORACLE_PROMPTS * 2, _greedy(), lora_request=[_request(paths, n) for n in names for _ in ORACLE_PROMPTS])
    print(_check(outs, [r for n in names for r in results[n]]))


def test_decode_graph_buffers_with_adapters_equal_peft(peft_case):
    """Decode steps through the graphs' static buffers (not captured on CPU): each row's slot is one
    more static input, padding rows have none."""
    from kvpilot.server import LLM

    paths, results, base = peft_case
    llm = LLM(num_threads=1, show_progress=False, enable_lora=True, max_loras=3, max_lora_rank=16, max_num_seqs=8)
    llm.engine.worker.start_decode_graphs(llm.engine.max_model_len, capture=False)
    calls = []
    run = llm.engine.worker.decode_graphs.run
    llm.engine.worker.decode_graphs.run = lambda inp: calls.append(inp.input_ids.shape[0]) or run(inp)
    names = [None, "all7-r8", "qv-r4-rslora"]
    outs = llm.generate(ORACLE_PROMPTS[:6], _greedy(), lora_request=[_request(paths, names[i % 3]) if names[i % 3] else None for i in range(6)])
    assert calls and max(calls) == 6
    print(_check(outs, [(results[names[i % 3]] if names[i % 3] else base)[i] for i in range(6)]))


# --- adapters refused by name ----------------------------------------------------------------------

def _edit(src, dest, config=None, rename=None, drop_weights=False):
    shutil.copytree(src, dest)
    if config:
        cfg = json.loads((dest / "adapter_config.json").read_text())
        cfg.update(config)
        (dest / "adapter_config.json").write_text(json.dumps(cfg))
    if rename or drop_weights:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(dest / "adapter_model.safetensors"))
        if drop_weights:
            (dest / "adapter_model.safetensors").unlink()
            torch.save(tensors, dest / "adapter_model.bin")
        else:
            save_file(rename(tensors), str(dest / "adapter_model.safetensors"))
    return dest


@pytest.mark.parametrize("case,message", [
    ("dora", "DoRA"), ("bias", "LoRA bias"), ("modules_to_save", "modules_to_save"), ("lm_head", "LM-head"),
    ("pickled", "never loaded"), ("rank", "max-lora-rank"), ("size", "refused unread"), ("shape", "another model"), ("outside", "outside the adapter directory"),
    ("symlink", "outside the adapter directory"), ("layer", "layer 99"), ("half", "without its other half"),
])
def test_adapters_refused_by_name(lora_llm, peft_case, tmp_path, case, message):
    from kvpilot.server.adapters import AdapterError

    paths, _, _ = peft_case
    src = paths["all7-r8"]
    root = tmp_path / "adapters"
    root.mkdir()
    target = root / case
    if case == "dora":
        _edit(src, target, {"use_dora": True})
    elif case == "bias":
        _edit(src, target, {"bias": "lora_only"})
    elif case == "modules_to_save":
        _edit(src, target, {"modules_to_save": ["lm_head"]})
    elif case == "lm_head":
        _edit(src, target, {"target_modules": ["q_proj", "lm_head"]})
    elif case == "pickled":
        _edit(src, target, drop_weights=True)
    elif case in ("rank", "size"):
        target = paths["mixed-r16"]
    elif case == "shape":
        _edit(src, target, rename=lambda t: {k: (v[:, :100].contiguous() if "lora_A" in k and "q_proj" in k else v) for k, v in t.items()})
    elif case == "outside":
        target = src
    elif case == "symlink":
        (root / case).symlink_to(src)
    elif case == "layer":
        _edit(src, target, rename=lambda t: {k.replace("layers.0.", "layers.99."): v for k, v in t.items()})
    elif case == "half":
        _edit(src, target, rename=lambda t: {k: v for k, v in t.items() if not ("layers.3." in k and "lora_B" in k)})
    registry = lora_llm.engine.lora
    if case in ("rank", "size"):
        # Slots of rank 14: the rank-16 adapter on five projections is within the file-size bound of a
        # rank-14 adapter on all seven, and refused for its rank; at rank 8 its file is too big to read.
        from kvpilot.server.engine.lora import LoRARegistry

        registry = LoRARegistry(registry.config, 1, 1, 14 if case == "rank" else 8, lambda slot, adapter: None)
    before = registry.names()
    with pytest.raises(AdapterError, match=message):
        registry.add(case, target, root=None if case in ("rank", "size") else root)
    assert registry.names() == before


# --- over HTTP -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(SERVER_MODES))  # the engine in the server's process, and in its own
def test_runtime_load_request_unload_over_http(peft_case, hf_oracle_session, tmp_path, mode):
    """An adapter from --lora-modules and one loaded at run time answer as peft does; /v1/models lists
    them with their parent and source; unloaded, the name is a 404; a path out of --lora-dir and a missing
    API key are refused; the adapter metrics count the requests. An hf://org/repo source is downloaded
    into --lora-dir (its two adapter files only, never the pickle beside them) and answers as peft does."""
    import httpx

    from e2e.hub import LoopbackHub
    from server_harness import ServerProcess, metrics

    paths, results, _ = peft_case
    root = tmp_path / "adapters"
    root.mkdir()
    for name in ("all7-r8", "mixed-r16"):
        shutil.copytree(paths[name], root / name)
    qv = paths["qv-r4-rslora"]
    (tmp_path / "adapter_model.bin").write_bytes(b"a pickle")
    hub = LoopbackHub({"org/qv": {"adapter_config.json": qv / "adapter_config.json", "adapter_model.safetensors": qv / "adapter_model.safetensors",
                                  "adapter_model.bin": tmp_path / "adapter_model.bin"}})
    server = ServerProcess("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora", "--lora-dir", str(root),
                           "--lora-modules", f"first={root / 'all7-r8'}", "--api-key", "sekret", *SERVER_MODES[mode], env={"HF_ENDPOINT": hub.url},
                           log_path=tmp_path / "server.log").wait_ready()
    try:
        auth = {"Authorization": "Bearer sekret"}
        post = lambda path, body, headers=auth: httpx.post(server.url + path, json=body, headers=headers, timeout=120)

        def completion(model: str, i: int) -> httpx.Response:
            return post("/v1/completions", {"model": model, "prompt": ORACLE_PROMPTS[i], "max_tokens": STEPS, "temperature": 0, "ignore_eos": True})

        def peft_text(name: str, i: int) -> str:
            return hf_oracle_session.tokenizer.decode(results[name][i].tokens, skip_special_tokens=True)

        models = httpx.get(server.url + "/v1/models", headers=auth, timeout=10).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("smollm2-135m", None), ("first", "smollm2-135m")]
        r = completion("first", 0)
        assert r.status_code == 200 and r.json()["model"] == "first"
        assert r.json()["choices"][0]["text"] == peft_text("all7-r8", 0)
        # a router's view (#70): what a request for the adapter becomes, and the names the Gateway API Inference Extension reads
        rendered = post("/v1/completions/render", {"model": "first", "prompt": ORACLE_PROMPTS[0], "max_tokens": STEPS})
        assert rendered.status_code == 200 and rendered.json()[0]["model"] == "first", rendered.text
        assert rendered.json()[0]["token_ids"] == post("/tokenize", {"model": "first", "prompt": ORACLE_PROMPTS[0]}).json()["tokens"]
        assert r.json()["usage"]["prompt_tokens"] == len(rendered.json()[0]["token_ids"])
        from prometheus_client.parser import text_string_to_metric_families

        families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "lora_requests_info", "cache_config_info"):
            assert families["vllm:" + name].type == "gauge", name
        adapters = families["vllm:lora_requests_info"].samples[0].labels
        assert adapters["max_lora"] == "2" and {"running_lora_adapters", "waiting_lora_adapters"} <= adapters.keys(), adapters
        cache = families["vllm:cache_config_info"].samples[0].labels
        assert int(cache["block_size"]) == 16 and int(cache["num_gpu_blocks"]) > 0, cache

        assert post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "mixed-r16"}, headers={}).status_code == 401
        outside = post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(paths["mixed-r16"])})
        assert outside.status_code == 400 and "outside the adapter directory" in outside.json()["error"]["message"]
        loaded = post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "mixed-r16"})
        assert loaded.status_code == 200, loaded.text
        taken = post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "mixed-r16"})
        assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
        r = completion("second", 3)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == peft_text("mixed-r16", 3)
        m = metrics(server.url)
        assert m["kvpilot:lora_requests_total{adapter=first}"] == 1 and m["kvpilot:lora_requests_total{adapter=second}"] == 1

        assert post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
        gone = completion("second", 3)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 404
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", headers=auth, timeout=10).json()["data"]] == ["smollm2-135m", "first"]

        fetched = post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": "hf://org/qv"})
        assert fetched.status_code == 200, fetched.text
        assert sorted(p.name for p in (root / "hf" / "org" / "qv").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        r = completion("third", 5)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == peft_text("qv-r4-rslora", 5)
        models = httpx.get(server.url + "/v1/models", headers=auth, timeout=10).json()["data"]
        assert [(m["id"], m["root"]) for m in models[1:]] == [("first", str(root / "all7-r8")), ("third", "hf://org/qv")]
        for source, why in (("hf://org/qv/adapter_model.safetensors", "an adapter is a directory"), ("hf://org/missing", "HTTP 404")):
            refused = post("/v1/load_lora_adapter", {"lora_name": "fourth", "lora_path": source})
            assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text
    finally:
        assert server.terminate() == 0
        hub.close()


# Adapters whose every request would fail, or whose load would never end: each is refused at load, by
# what is wrong (case -> a pattern of the refusal's message).
UNSERVABLE = {
    "alpha-inf": "lora_alpha must be a finite number",
    "alpha-nan": "lora_alpha must be a finite number",
    "alpha-1e300": r"'s B times its scale alpha/rank \(1\.25e\+299\) is not finite",  # finite, past float32 once applied
    "alpha-pattern-nan": "alpha_pattern must map module names to finite numbers",
    "alpha-pattern-1e300": r"q_proj's B times its scale alpha/rank \(1\.25e\+299\) is not finite",
    "alpha-pattern-flags": r"alpha_pattern key '\(\?i\)q_proj' is not a regular expression",  # valid alone, not as matched
    "rank-0": "self_attn.q_proj has rank 0",
    "0-d": r"tensor '.*layers\.0\.self_attn\.q_proj\.lora_A\.weight' is 0-d",
    "deep-config": "nests deeper than the JSON parser's recursion limit",
    "big-config": f"larger than {1 << 20} bytes",
    "fifo-config": "is not a regular file",
}


def _make_unservable(case: str, src, dest):
    """The UNSERVABLE adapter `case`: a copy of the adapter at src, at dest, with one thing wrong."""
    layer0_q = "layers.0.self_attn.q_proj.lora_"
    config = {"alpha-inf": {"lora_alpha": math.inf}, "alpha-nan": {"lora_alpha": math.nan}, "alpha-1e300": {"lora_alpha": 1e300},
              "alpha-pattern-nan": {"alpha_pattern": {"v_proj": math.nan}}, "alpha-pattern-1e300": {"alpha_pattern": {"q_proj": 1e300}},
              "alpha-pattern-flags": {"alpha_pattern": {"(?i)q_proj": 16}},
              "big-config": {"notes": "x" * (1 << 20)}}.get(case)
    rename = {"rank-0": lambda t: {k: v.new_empty(0, v.shape[1]) if layer0_q + "A" in k else v.new_empty(v.shape[0], 0) if layer0_q + "B" in k else v
                                   for k, v in t.items()},
              "0-d": lambda t: {k: torch.tensor(1.0) if layer0_q + "A" in k else v for k, v in t.items()}}.get(case)
    _edit(src, dest, config, rename)
    config_file = dest / "adapter_config.json"
    if case == "deep-config":  # a valid config with one more field, nested 100,000 deep
        config_file.write_text(config_file.read_text().rstrip()[:-1] + ', "nested": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "fifo-config":
        config_file.unlink()
        os.mkfifo(config_file)


@pytest.fixture(scope="module", params=list(SERVER_MODES))  # the engine in the server's process, and in its own
def one_slot_server(peft_case, tmp_path_factory, request):
    """A server with one adapter slot and one host copy (a third adapter loaded drops the other two's
    host copies), run-time loading from a --lora-dir holding the peft adapters, "first" (all7-r8) loaded
    at start: (the server, its --lora-dir)."""
    from server_harness import ServerProcess

    paths, _, _ = peft_case
    root = tmp_path_factory.mktemp("adapters")
    for name in SPECS:
        shutil.copytree(paths[name], root / name)
    server = ServerProcess("--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "16", "--allow-runtime-lora",
                           "--lora-dir", str(root), "--lora-modules", f"first={root / 'all7-r8'}", *SERVER_MODES[request.param],
                           log_path=tmp_path_factory.mktemp("server") / "server.log").wait_ready()
    yield server, root
    assert server.terminate() == 0


SHORT_STEPS = 8  # greedy tokens compared with the oracle's where a test checks that a model still serves


def _completion(server, model: str, prompt: int, max_tokens: int = SHORT_STEPS):
    import httpx

    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": ORACLE_PROMPTS[prompt], "max_tokens": max_tokens,
                                                            "temperature": 0, "ignore_eos": True}, timeout=60)


def _peft_text(hf_oracle_session, result) -> str:
    return hf_oracle_session.tokenizer.decode(result.tokens[:SHORT_STEPS], skip_special_tokens=True)


@pytest.mark.timeout(60, func_only=True)  # the test's own requests: the servers' start-up is the fixture's
def test_unservable_adapters_are_refused_at_load_over_http(one_slot_server, peft_case, hf_oracle_session):
    """Each UNSERVABLE adapter (a non-finite scale: lora_alpha, alpha_pattern, or alpha/rank past float32
    once applied; a rank-0 or 0-d tensor; a config nested past the JSON parser, over 1 MiB, or a FIFO) and
    an adapter taking the base model's name are a 400 at load naming what is wrong, in both modes (the
    engine core's own process refused the first ones with 400, the server's with 500; the FIFO hung the
    load); none is listed, and the base model and "first" answer as before."""
    import httpx

    server, root = one_slot_server
    paths, results, base = peft_case
    load = lambda name, path: httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=30)
    for case, refusal in UNSERVABLE.items():
        _make_unservable(case, paths["all7-r8"], root / case)
        r = load(case, case)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", (case, r.text)
        assert re.search(refusal, r.json()["error"]["message"]), (case, r.text)
    base_name = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = load(base_name, "all7-r8")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert f"{base_name!r} is the served model's name" in r.json()["error"]["message"]
    listed = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]]
    assert listed.count(base_name) == 1 and "first" in listed and not set(UNSERVABLE) & set(listed), listed
    r = _completion(server, base_name, 1)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _peft_text(hf_oracle_session, base[1])
    r = _completion(server, "first", 2)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _peft_text(hf_oracle_session, results["all7-r8"][2])


@pytest.mark.timeout(60, func_only=True)  # the test's own requests: the servers' start-up is the fixture's
def test_a_failed_re_read_leaves_the_slot_to_the_adapter_in_it(one_slot_server, peft_case, hf_oracle_session):
    """One slot, one host copy: "first" runs (into the slot); "changes" and "third" load (dropping the
    host copies of "first", then of "changes"); the files of "changes" change, so its re-read for the
    slot is refused and its request fails. "first" keeps the slot and answers as peft does: the slot
    used to be taken from it before the re-read, and every request of "first" then failed (no slot free:
    the slot still named it as its holder)."""
    import httpx

    server, root = one_slot_server
    _, results, _ = peft_case
    load = lambda name, path: httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=30)
    assert _completion(server, "first", 0, max_tokens=1).status_code == 200
    shutil.copytree(root / "qv-r4-rslora", root / "changes")
    assert load("changes", "changes").status_code == 200
    assert load("third", "mixed-r16").status_code == 200
    config = root / "changes" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 9}))
    r = _completion(server, "changes", 0, max_tokens=1)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text  # the server's log names why
    r = _completion(server, "first", 4)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _peft_text(hf_oracle_session, results["all7-r8"][4])


def test_int4_base_weights_with_an_adapter_equal_peft_on_the_dequantized_base(peft_case, hf_oracle_session):
    """QLoRA-style over our int4 (embedding and head int8): peft's base is the same model with every
    weight replaced by its quantize-dequantize round trip, so the two differ only in summation order."""
    import copy

    from peft import PeftModel

    from kvpilot.kernels.quantized import quantize_int4, quantize_int8
    from kvpilot.server import LLM
    from lora_factory import peft_greedy

    paths, _, _ = peft_case
    base = copy.deepcopy(hf_oracle_session.model)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(quantize_int4(p, 32).dequantize())
            elif name.endswith("embed_tokens.weight"):
                p.copy_(quantize_int8(p).dequantize())
    prompts = [hf_oracle_session.tokenizer(p).input_ids for p in ORACLE_PROMPTS[:4]]
    oracle = peft_greedy(PeftModel.from_pretrained(base, str(paths["all7-r8"])).eval(), prompts, STEPS, set())
    llm = LLM(num_threads=1, show_progress=False, quantization="int4", enable_lora=True, max_lora_rank=16)
    outs = llm.generate(ORACLE_PROMPTS[:4], _greedy(), lora_request=_request(paths, "all7-r8"))
    print(_check(outs, oracle))


def test_qwen2_checkpoint_with_qkv_biases_and_an_adapter_equals_peft(family_checkpoints, tmp_path):
    """A Qwen2-family checkpoint (q/k/v biases beside the adapted fused QKV, tied head): an adapter on all
    seven projections, made by peft on transformers' own model of the checkpoint, changes its greedy output
    and ours equals peft's, one batch with base rows."""
    from transformers import AutoModelForCausalLM

    from kvpilot.server import LLM
    from kvpilot.server.adapters import LoRARequest
    from lora_factory import peft_greedy, save_adapter

    directory, _ = family_checkpoints["qwen2"]
    base = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32).eval()
    assert base.model.layers[0].self_attn.q_proj.bias is not None
    adapted, path = save_adapter(base, "all7-r8", tmp_path)
    llm = LLM(model=str(directory), num_threads=1, show_progress=False, enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory="32MiB")
    prompts = [llm.engine.tokenizer.encode(p) for p in ORACLE_PROMPTS]
    oracle, plain = peft_greedy(adapted, prompts, STEPS, set()), peft_greedy(base, prompts, STEPS, set())
    assert sum(a.tokens != b.tokens for a, b in zip(oracle, plain)) >= 8
    request = LoRARequest("qwen2-all7", 1, str(path))
    outs = llm.generate(prompts * 2, _greedy(), lora_request=[request] * len(prompts) + [None] * len(prompts))
    print(_check(outs, oracle + plain))


def test_an_adapter_whose_files_changed_is_refused_when_read_again(lora_llm, peft_case, tmp_path):
    """Its KV blocks are keyed by its files' digest: dropped from host memory and needed again, an
    adapter must still be those files, or it is refused by name (not served with other weights)."""
    from kvpilot.server.adapters import AdapterError
    from kvpilot.server.engine.lora import LoRARegistry

    paths, _, _ = peft_case
    for name in ("qv-r4-rslora", "all7-r8"):
        shutil.copytree(paths[name], tmp_path / name)
    registry = LoRARegistry(lora_llm.engine.model_config, 1, 1, 16, lambda slot, adapter: None)
    first = registry.add("first", tmp_path / "qv-r4-rslora")
    registry.add("second", tmp_path / "all7-r8")  # one host copy: the first's is dropped
    assert first.tensors is None
    config = tmp_path / "qv-r4-rslora" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 9}))
    with pytest.raises(AdapterError, match="'first': its files in .* changed since it was loaded"):
        registry.slots_for([first.id], set())
