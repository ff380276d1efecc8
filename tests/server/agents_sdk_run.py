"""An OpenAI Agents SDK agent with a function tool against BASE_URL, run to its end both
plainly and streamed, over the Responses API or chat completions.

    python agents_sdk_run.py BASE_URL MODEL responses|chat_completions

Run by tests/server/test_agent_clients.py inside the server's network namespace; exits
non-zero (with the SDK's exception) when any request failed.
"""

import asyncio
import sys

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name.
    """
    return f"It is sunny in {city}."


async def main(base_url: str, model: str, api: str) -> None:
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    set_default_openai_client(AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-dummy",
                                          max_retries=0), use_for_tracing=False)
    set_default_openai_api(api)
    agent = Agent(name="weather", instructions="Answer with the get_weather tool.",
                  model=model, tools=[get_weather],
                  model_settings=ModelSettings(max_tokens=24, temperature=0.7))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    print("final:", repr(result.final_output)[:200])
    streamed = Runner.run_streamed(agent, "And in Oslo?", max_turns=4)
    async for _ in streamed.stream_events():
        pass
    print("streamed final:", repr(streamed.final_output)[:200])


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
