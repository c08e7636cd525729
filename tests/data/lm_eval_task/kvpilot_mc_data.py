"""The documents of the kvpilot_mc lm-eval task (kvpilot_mc.yaml): the jsonl beside this file, as a
DatasetDict with one split, `test` (lm-eval calls this with the task's metadata as keyword arguments)."""

import json
from pathlib import Path


def load_docs(**_metadata):
    import datasets

    rows = [json.loads(line) for line in (Path(__file__).parent / "kvpilot_mc.jsonl").read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
