"""How the scheduler sizes and starts work: admitting waiting requests (prefix-cache hits, ``n > 1`` prompt
sharing, LoRA slots), chunk sizes, draft slots, and requests the whole cache cannot hold. Part of
:class:`pagoda.scheduling.Scheduler`, kept apart so each file reads on its own; nothing here is a policy hook."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from pagoda.sequence import Sequence, SequenceStatus
from pagoda.step import SchedulerOutput

if TYPE_CHECKING:
    from pagoda.scheduling.policy import SchedulingPolicy


class Admission:
    """The admission half of the scheduler (see :class:`pagoda.scheduling.Scheduler` for the state)."""

    policy: "SchedulingPolicy"
    waiting: list[Sequence]
    running: list[Sequence]
    swapped: list[Sequence]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Start waiting requests in the order the policy's ``order_waiting`` gives, while the budget,
        ``max_num_seqs`` and the KV pool allow and the policy's ``may_admit`` agrees: a prefix-cache hit is
        shared, not recomputed, and a sequence of an ``n > 1`` request shares the prompt blocks its sibling (the
        prompt leader) computed. A request preempted in this step ends the admissions (its reset is not
        committed)."""
        now = time.monotonic()
        idx = 0
        while idx < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[idx]
            if req.request_id in self._busy:
                idx += 1  # another step's, in flight or next
                continue
            if req.request_id in self._preempted_now or not self.policy.may_admit(req):
                break
            if not self._fits_lora_slots(req):
                idx += 1  # its adapter would be one too many this step: it waits for a running one to finish
                continue
            leader = self._prompt_leader(req)
            if leader is not None and leader.num_computed_tokens < req.num_prompt_tokens - 1:
                idx += 1  # its sibling is still computing the shared prompt: join once that is done
                continue
            if leader is not None:
                start = num_new = self._fork_from(leader, req)
                if num_new == 0:
                    break
                num_new = 1
            else:
                computed_blocks, num_cached = self.kv.get_computed_blocks(req)
                num_new = self._num_new_tokens(req, budget, num_cached)
                if num_new == 0:
                    break
                if not self.kv.allocate_slots(req, num_new, computed_blocks):
                    if not self.running:
                        # the whole pool is free and still too small: waiting would never end
                        self._fail_unfittable(req, out)
                        continue
                    break
                start = num_cached
                req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
                if req.sampling_params.n > 1 and req.num_output_tokens == 0:
                    self._prompt_leaders.setdefault(req.parent_id, req)
            self.waiting.pop(idx)
            req.status = SequenceStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = now
            self._insert(self.running, req, self.policy.running_key)
            self._add_to_output(out, req, num_new, start)
            budget -= num_new

    def _fits_lora_slots(self, req: Sequence) -> bool:
        """Whether ``req`` may run beside the running requests without their LoRA adapters exceeding
        ``max_loras`` (a base-model request always may)."""
        lora = req.lora_request
        if lora is None or not self.max_loras:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in running or len(running) < self.max_loras

    def _prompt_leader(self, req: Sequence) -> Optional[Sequence]:
        """The running sibling whose prompt blocks ``req`` (one of ``n`` sequences) can share."""
        params = req.sampling_params
        if params.n <= 1 or params.prompt_logprobs is not None or req.num_output_tokens or req.num_prompt_tokens < 2:
            return None  # (prompt logprobs need every prompt position computed)
        leader = self._prompt_leaders.get(req.parent_id)
        if leader is None or leader is req or leader.status != SequenceStatus.RUNNING:
            self._prompt_leaders.pop(req.parent_id, None)
            return None
        return leader

    def _forget_leader(self, req: Sequence) -> None:
        """``req`` lost its blocks: no sibling forks from it any more."""
        if self._prompt_leaders.get(req.parent_id) is req:
            del self._prompt_leaders[req.parent_id]

    def _fork_from(self, leader: Sequence, req: Sequence) -> int:
        """Share the leader's prompt blocks and make room for the last prompt token, which this sequence
        computes for its own first sample. Returns the tokens shared (the position it computes from),
        0 if the pool is short."""
        num_shared = req.num_prompt_tokens - 1
        self.kv.fork(leader, req, num_shared)
        if not self.kv.allocate_slots(req, 1):
            self.kv.free(req)
            return 0
        return num_shared

    def _num_draft_slots(self, req: Sequence, budget: int) -> int:
        """Draft slots for a decoding request: ``num_speculative_tokens`` when its sampling allows
        speculation, within its ``max_tokens``, the budget and ``max_model_len``, and only if the blocks
        are free now (drafts never cost a preemption)."""
        if not req.may_speculate():
            return 0
        k = min(self.num_speculative_tokens, budget, self.max_model_len - req.num_tokens)
        if req.sampling_params.max_tokens is not None:
            k = min(k, req.sampling_params.max_tokens - req.num_output_tokens - 1)  # no drafts past the last token
        if k <= 0 or self._outgrows_cache(req, 1 + k) or not self.kv.can_allocate(req, 1 + k):
            return 0
        return k

    def _outgrows_cache(self, req: Sequence, num_new: int) -> bool:
        return self.kv.blocks_needed(req.num_computed_tokens + num_new) > self.kv.num_blocks

    def _fail_unfittable(self, req: Sequence, out: SchedulerOutput) -> None:
        """Take a request the whole cache cannot hold out of its queue and give back its blocks (the rest of
        the step may use them); ``update`` ends it with the error."""
        need = self.kv.blocks_needed(max(req.num_tokens, req.num_computed_tokens + 1))
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        self.kv.free(req)
        self._forget_leader(req)
        out.failed.append((req, (
            f"request {req.request_id} needs {need} KV blocks for its {req.num_tokens} tokens but the whole cache "
            f"has {self.kv.num_blocks}; raise --kv-cache-memory-bytes (or --num-gpu-blocks-override) or shorten "
            "the prompt / max_tokens")))

    def _num_new_tokens(self, req: Sequence, budget: int, num_computed: Optional[int] = None) -> int:
        """Tokens to compute this step: all that remain, or a chunk of them with chunked prefill
        (at most the budget and ``long_prefill_token_threshold``); 0 if a whole prompt does not fit."""
        remaining = req.num_tokens - (req.num_computed_tokens if num_computed is None else num_computed)
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        num_new = min(remaining, budget)
        if self.long_prefill_token_threshold:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return num_new
