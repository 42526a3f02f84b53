"""The built-in tool-call parsers (``pagoda_tool_parsers``), named as vLLM names them: ``hermes``,
``llama3_json``, ``pythonic`` and ``openai`` (gpt-oss's harmony messages); and the reader of the answers the
server holds to a tool-call schema itself (``forced``)."""

from pagoda.plugins.entrypoints.tool_parsers.hermes import HermesToolParser
from pagoda.plugins.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser
from pagoda.plugins.entrypoints.tool_parsers.openai import OpenAIToolParser
from pagoda.plugins.entrypoints.tool_parsers.pythonic import PythonicToolParser

BUILT_IN_TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                         "pythonic": PythonicToolParser, "openai": OpenAIToolParser}
