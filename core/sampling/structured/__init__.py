"""Structured outputs: output constrained to a JSON schema, any JSON object, a regex, a choice or a grammar.

- ``bitmask``: the token bitmask a step's grammar rows are filled into, and its application to the logits;
- ``xgrammar_backend``, ``guidance_backend``: the built-in backends (``xgrammar``; ``guidance``, alias
  ``llguidance``), registered through ``pagoda_structured_output_backends`` like any plugin's;
- ``manager``: the engine's side: the backend of each request (``auto``: the first that supports it), the
  compile pool and its cache, each sequence's matcher, and each step's bitmask;
- ``speculative``: the rows of a verified run of speculative drafts, filled by the runner once the drafts
  are known.
"""

from pagoda import hookimpl


@hookimpl
def pagoda_structured_output_backends():
    from pagoda.sampling.structured.guidance_backend import GuidanceBackend
    from pagoda.sampling.structured.xgrammar_backend import XgrammarBackend

    return {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend, "llguidance": GuidanceBackend}
