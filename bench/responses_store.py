"""The Responses API's store under a flood: a server with a small store (100 responses) gets N stored
responses with large inputs; its resident memory is read (/proc) after each N/5, and the oldest ids
must be gone while the newest are read back.

    .venv/bin/python bench/responses_store.py [--requests 1500] [--input-chars 6000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))

from common import machine  # noqa: E402


def rss_mib(pid: int) -> float:
    total = 0
    for p in [pid, *(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--input-chars", type=int, default=6000)
    args = ap.parse_args()
    port = 18360
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(Path(sys.executable).parent / "kvpilot"), "serve", "--port", str(port), "--num-threads", "2",
                               "--kv-cache-memory", "256MiB", "--responses-store-max-responses", "100"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = httpx.Client(timeout=60)
        ids, samples = [], []
        for i in range(args.requests):
            # one long shared prefix (the prefix cache computes it once), each request's own number at the end
            text = ("lorem ipsum dolor sit amet " * (args.input_chars // 27))[:args.input_chars] + f" request {i}"
            r = client.post(url + "/v1/responses", json={"model": "smollm2-135m", "input": text, "max_output_tokens": 1})
            r.raise_for_status()
            ids.append(r.json()["id"])
            if (i + 1) % (args.requests // 5) == 0:
                samples.append((i + 1, rss_mib(server.pid)))
        first = client.get(f"{url}/v1/responses/{ids[0]}").status_code
        last = client.get(f"{url}/v1/responses/{ids[-1]}").status_code
        print(f"{machine()}; {args.requests} stored responses of {args.input_chars} input characters, store bound 100 responses")
        print("| responses sent | server RSS (MiB) |\n|---|---|")
        for n, mib in samples:
            print(f"| {n} | {mib:.0f} |")
        print(f"the first response: HTTP {first} (dropped); the last: HTTP {last}")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
