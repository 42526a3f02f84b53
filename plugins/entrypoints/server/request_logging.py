"""Log lines of requests and their outputs (``--enable-log-requests``, ``--enable-log-outputs``, ``--max-log-len``).

A request is logged when its engine requests are made: its prompt, prompt token ids and sampling parameters. Its
outputs are logged as each of its choices finishes: the text, the token ids and the finish reason; a stream's
deltas are gathered for that line only while output logging is on.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda.requests")


class RequestLog:
    """What a server logs of its requests; ``max_len`` cuts the text and the token ids a line shows."""

    def __init__(self, log_outputs: bool, max_len: Optional[int]) -> None:
        self.log_outputs, self.max_len = log_outputs, max_len

    def _cut(self, items):
        return items if self.max_len is None or items is None else items[:self.max_len]

    def received(self, request_id: str, prompt: Optional[str], prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        logger.info("request %s received: prompt %r, prompt_token_ids %s, params %s", request_id, self._cut(prompt),
                    list(self._cut(prompt_token_ids)), params)

    def outputs(self) -> Optional["OutputLog"]:
        """What gathers one engine request's outputs for their log lines; None without output logging."""
        return OutputLog(self) if self.log_outputs else None


class OutputLog:
    """One engine request's choices as they arrive (whole or in deltas), each logged when it finishes."""

    def __init__(self, log: RequestLog) -> None:
        self.log = log
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.texts.setdefault(c.index, []).append(c.text)
            self.token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.finish_reason is None:
                continue
            text, ids = "".join(self.texts.pop(c.index)), self.token_ids.pop(c.index)
            logger.info("request %s choice %d finished (%s): output %r, output_token_ids %s", out.request_id,
                        c.index, c.finish_reason, self.log._cut(text), self.log._cut(ids))
