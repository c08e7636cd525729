"""Runs the kvpilot_mc task (kvpilot_mc.yaml) with lm-eval's `hf` model on the bundled SmolLM2-135M GGUF,
offline, and prints the accuracy and each choice's loglikelihood:

    .venv/bin/python tests/data/lm_eval_task/run_hf.py
"""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent


def main():
    import lm_eval
    from lm_eval.tasks import TaskManager

    from kvpilot.server.model_files import resolve_model_path

    gguf = resolve_model_path("smollm2-135m")
    t0 = time.monotonic()
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(gguf.parent), "gguf_file": gguf.name, "dtype": "float32", "device": "cpu"},
        tasks=["kvpilot_mc"], task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        batch_size=1, bootstrap_iters=0, log_samples=True, random_seed=0)
    print(f"simple_evaluate: {time.monotonic() - t0:.1f} s")
    print("results:", out["results"]["kvpilot_mc"])
    for s in out["samples"]["kvpilot_mc"]:
        lls = [round(r[0][0], 4) for r in s["resps"]]
        greedy = [r[0][1] for r in s["resps"]]
        print(s["doc_id"], s["doc"]["question"], "target", s["target"], "lls", lls, "greedy", greedy, "acc", s["acc"])


if __name__ == "__main__":
    main()
