"""`with_structured_output` for ChatDynGen: three methods, all enforced by constrained decoding.

- ``"json_schema"`` (default): the output is constrained to the schema's JSON and parsed.
- ``"function_calling"``: the schema becomes a tool that the model is forced to call (through
  tool_choice, itself a constraint); the call's arguments are the result.
- ``"json_mode"``: the output is constrained to be a JSON object, any keys; describe the shape
  in the prompt.
"""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

if TYPE_CHECKING:
    from langchain_dyngen.chat_models import ChatDynGen

StructuredMethod = Literal["json_schema", "function_calling", "json_mode"]
JSON_OBJECT: dict[str, Any] = {"type": "object"}


def structured_runnable(
    model: ChatDynGen,
    schema: dict[str, Any] | type,
    method: StructuredMethod,
    include_raw: bool,
    strict: bool | None,
) -> Runnable[Any, Any]:
    """The runnable `ChatDynGen.with_structured_output` returns (see that method)."""
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    trace_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
    parser: Runnable[Any, Any]
    if method == "function_calling":
        tool_name = convert_to_openai_tool(schema)["function"]["name"]
        llm = model.bind_tools([schema], tool_choice=tool_name, parallel_tool_calls=False,
                               ls_structured_output_format=trace_format)
        parser = (PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                  if is_pydantic
                  else JsonOutputKeyToolsParser(key_name=tool_name, first_tool_only=True))
    elif method in ("json_schema", "json_mode"):
        constraint = convert_to_json_schema(schema) if method == "json_schema" else JSON_OBJECT
        llm = model.bind(constraint=constraint, ls_structured_output_format=trace_format)
        parser = (PydanticOutputParser(pydantic_object=schema) if is_pydantic  # type: ignore[arg-type]
                  else JsonOutputParser())
    else:
        raise ValueError(
            f"method must be 'json_schema', 'function_calling' or 'json_mode'; got {method!r}"
        )
    if not include_raw:
        return llm | parser
    parse_raw = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                           parsing_error=lambda _: None)
    no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parse_raw.with_fallbacks(
        [no_parse], exception_key="parsing_error")
