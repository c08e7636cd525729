"""OpenAI's Agents SDK (PyPI `openai-agents`) running a one-tool agent against kvpilot's Responses API.

    .venv/bin/python bench/openai_agents.py

The SDK is not a test dependency: it pins `websockets<17` (kvpilot's server stack runs 17) and brings
`mcp` and its own dependencies, so it gets its own venv in the cache (made on first use). A kvpilot
server is started on the bundled model; the agent (the SDK's OpenAIResponsesModel, tool_choice required
for its first turn: the SDK sets it back to auto after a tool call) answers a question with its tool.
Prints the items of the run (the tool call, its output, the final message) and exits non-zero unless
the tool was called and a final answer came back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpilot.kernels.cache import cache_root  # noqa: E402

AGENTS_VERSION = "0.24.0"
AGENT = '''
import asyncio, sys
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
calls = []

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"22 C and sunny in {city}"

async def main():
    client = AsyncOpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
    agent = Agent(name="weather", instructions="Answer with the get_weather tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="smollm2-135m", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    for item in result.new_items:
        print(type(item).__name__, getattr(item, "raw_item", None))
    print("tool called with:", calls)
    print("final output:", repr(result.final_output))
    sys.exit(0 if calls and isinstance(result.final_output, str) else 1)

asyncio.run(main())
'''


def agents_python() -> Path:
    venv = cache_root() / "bench" / f"openai-agents-{AGENTS_VERSION}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"openai-agents=={AGENTS_VERSION}"], check=True, cwd=venv)
    return python


def main() -> None:
    python = agents_python()
    port = 18350
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(Path(sys.executable).parent / "kvpilot"), "serve", "--port", str(port), "--num-threads", "2",
                               "--kv-cache-memory", "256MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the kvpilot server did not start")
            time.sleep(0.5)
        sys.exit(subprocess.run([str(python), "-c", AGENT, url], cwd="/tmp").returncode)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
