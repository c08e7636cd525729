"""KV memory of one sequence of Gemma 3 270M at a long context, its sliding-window layers in a pool of their own
(block_manager.WindowPool) against what the same sequence would hold if every layer kept every block (the block
table's blocks in all 18 layers). Measured on the engine: the blocks each table holds at the end of the prefill
and at every decode step, read from the block manager.

  .venv/bin/python bench/window_kv.py [--context 8192] [--json bench/results/window-kv.json]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_results, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens (random ids), then --steps decoded")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the figures here (bench/results/window-kv.json)")
    args = ap.parse_args()

    from kvpilot.server import LLM, SamplingParams

    llm = LLM("gemma3-270m", num_threads=args.threads, show_progress=False, kv_cache_memory="768MiB", max_num_seqs=4,
              max_model_len=args.context + args.steps + 16)
    engine = llm.engine
    bm, c = engine.block_manager, engine.model_config
    if bm.window is None:
        sys.exit("the engine runs without a window pool (see its log): nothing to measure")
    seen: list[tuple[int, int, int]] = []  # (computed tokens, block-table blocks, window-pool blocks) after each allocation
    allocate = bm.allocate

    def spy(seq, num_new_tokens, *rest):
        done = allocate(seq, num_new_tokens, *rest)
        if done:
            seen.append((seq.num_computed_tokens + num_new_tokens, len(seq.block_table), bm.window.held(seq)))
        return done

    bm.allocate = spy
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 200000) for _ in range(args.context)]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True))
    worker = engine.worker
    per_layer_block = worker.kv_caches[0][0][0].numel() * worker.kv_caches[0][0].element_size() * 2  # K and V of one layer's block
    windowed = sum(1 for i in range(c.num_layers) if c.window(i))
    tokens, table_blocks, window_blocks = max(seen)  # the last decode step
    pooled = (table_blocks * (c.num_layers - windowed) + window_blocks * windowed) * per_layer_block
    every = table_blocks * c.num_layers * per_layer_block
    rows = [{"tokens": tokens, "layers": f"{c.num_layers - windowed} global + {windowed} window ({c.sliding_window})",
             "window-layer blocks": window_blocks, "their bound": -(-c.sliding_window // bm.block_size) + 1,
             "global-layer blocks": table_blocks, "KV MiB, window pool": round(pooled / 2**20, 1),
             "KV MiB, every block kept": round(every / 2**20, 1), "ratio": round(every / pooled, 2)}]
    print(table(rows, list(rows[0])))
    decoding = [w for t, _, w in seen if t > args.context]
    print(f"window-layer blocks held at each of the {len(decoding)} decode steps: at most {max(decoding)}; at the largest prefill chunk: "
          f"{max(w for t, _, w in seen if t <= args.context)} (a chunk's blocks are held while it runs)")
    if args.json:
        save_results(args.json, results=rows, kv_dtype=str(worker.kv_dtype), block_size=bm.block_size)


if __name__ == "__main__":
    main()
