"""A tool-calling agent with LangChain on dyngen: the model calls several tools in one turn.

    python examples/langchain_agent.py [MODEL_DIR] [--auto]

The agent loop is plain LangChain: the model (with tools bound) answers; each tool call in the
answer runs — all of one turn's calls concurrently — and the results go back as ToolMessages
until the model answers in text. Tool calls are parsed into ``AIMessage.tool_calls`` with ids.

The demo model has 135M parameters and decides poorly on its own, so by default the first turn
forces tool calls (tool_choice="any", enforced by constrained decoding) and the turn after the
results asks for text (tool_choice="none"); a worked example in the history shows it how to
ask for several calls at once. With a capable model (Qwen2.5-Coder-1.5B-Instruct, say) pass
``--auto``: the model decides. Its chat template itself shows how to call tools, so the
history holds no worked example (Qwen2.5-Coder-1.5B copies one: it answered "Paris is clear,
22 °C and Tokyo is ..." in the example's words, with no call); a system message asks in
words for the calls of one question to come in one reply, and for an answer once the
results are back (without it, that model called the tool once per turn, and after the
results called it again).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from _demo import model_dir
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from langchain_dyngen import ChatDynGen

WEATHER = {"Paris": "sunny, 24 °C", "Tokyo": "rainy, 18 °C", "Oslo": "snowing, -3 °C",
           "Lima": "cloudy, 19 °C", "Cairo": "clear, 31 °C"}


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER.get(city.strip(), "unknown")


# A worked example: one question about two cities, answered with two calls in one turn.
EXAMPLE: list[BaseMessage] = [
    HumanMessage("What is the weather in Lima and in Cairo?"),
    AIMessage("", tool_calls=[
        {"name": "get_weather", "args": {"city": "Lima"}, "id": "call_ex1"},
        {"name": "get_weather", "args": {"city": "Cairo"}, "id": "call_ex2"}]),
    ToolMessage(WEATHER["Lima"], tool_call_id="call_ex1"),
    ToolMessage(WEATHER["Cairo"], tool_call_id="call_ex2"),
    AIMessage(f"Lima is {WEATHER['Lima']} and Cairo is {WEATHER['Cairo']}."),
]


# What --auto tells the model instead: parallel calls, in words (no example to copy).
SYSTEM = ("You are a helpful assistant. If a question needs a tool several times (for several "
          "cities, say), make all those calls at once in your reply. Once the results are "
          "back, answer the question from them.")


def run_tools(message: AIMessage) -> list[ToolMessage]:
    """Run every call of one turn concurrently; results keep the calls' order and ids."""
    tools = {"get_weather": get_weather}
    with ThreadPoolExecutor() as pool:
        return list(pool.map(lambda call: tools[call["name"]].invoke(call), message.tool_calls))


def main() -> None:
    auto = "--auto" in sys.argv
    if auto:
        sys.argv.remove("--auto")
    chat = ChatDynGen(model_dir=str(model_dir()), temperature=0, max_tokens=120,
                      cache_tokens=8192)
    question = "What is the weather in Paris and in Tokyo and in Oslo?"
    history = [SystemMessage(SYSTEM)] if auto else EXAMPLE
    messages: list[BaseMessage] = [*history, HumanMessage(question)]
    print(f"User: {question}")
    started = time.perf_counter()
    for turn in range(4):
        choice = "auto" if auto else ("any" if turn == 0 else "none")
        reply = chat.bind_tools([get_weather], tool_choice=choice).invoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if not reply.tool_calls:
            print(f"Assistant: {reply.text.strip()}")
            break
        calls = ", ".join(f"{c['name']}({c['args']}) [{c['id']}]" for c in reply.tool_calls)
        print(f"Assistant calls {len(reply.tool_calls)} tool(s) at once: {calls}")
        results = run_tools(reply)
        for result in results:
            print(f"  tool {result.tool_call_id} -> {result.content}")
        messages.extend(results)
    usage = reply.usage_metadata or {}
    print(f"(last turn: {usage.get('input_tokens')} prompt tokens, "
          f"{usage.get('input_token_details', {}).get('cache_read')} of them from the cache; "
          f"{turn + 1} turns in {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
