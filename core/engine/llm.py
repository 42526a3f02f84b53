"""``LLM``: the offline API (vLLM-compatible): generate and chat over a batch of prompts."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.engine.vllm_options import split_offline_options
from pagoda.errors import InvalidRequestError
from pagoda.execution.lora_request import LoRARequest
from pagoda.outputs import RequestOutput, RequestOutputKind
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling_params import SamplingParams


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    Keyword options are :class:`pagoda.EngineArgs` fields (``dtype``,
    ``max_model_len``, ``block_size``, ``max_num_seqs``, ...), and vLLM's that mean nothing on pagoda
    (``trust_remote_code``, ``gpu_memory_utilization``, ``enforce_eager``, ...: a warning each; see
    :mod:`pagoda.engine.vllm_options`). Unlike a served engine, it keeps no request
    counters or latency histograms (``engine.stats`` is None) unless given ``disable_log_stats=False``.
    """

    def __init__(self, model: Optional[str] = None, plugin_manager: Optional[PluginManager] = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("disable_log_stats", True)
        # vLLM's options that mean nothing here (trust_remote_code, gpu_memory_utilization, enforce_eager, ...):
        # a warning each, so a script written for vLLM runs
        args = EngineArgs.build(model=model, **split_offline_options(kwargs))
        self.engine = LLMEngine.from_engine_args(args, plugin_manager)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no SamplingParams: the model's recommended
        settings (its generation_config.json, ``generation_config="none"`` to leave them out) over
        SamplingParams' own defaults."""
        return SamplingParams(**self.engine.config.model.sampling_defaults)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: Optional[bool] = None,
        priority: Optional[Sequence[int]] = None,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in prompt order.

        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base model); the engine
        needs ``enable_lora=True``. Prompts of different adapters run in the same steps."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(loras)} lora_requests for {len(prompts)} prompts; pass one, or one per prompt")
        ids = []
        try:
            for i, (prompt, params, lora) in enumerate(zip(prompts, params_list, loras)):
                rid = f"llm-{self._counter}"
                self._counter += 1
                prio = priority[i] if priority is not None else None
                # only the finished outputs are returned: none is built before its request finishes
                ids.append(self.engine.add_request(rid, prompt, params, priority=prio,
                                                   output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora))
        except Exception:
            self.engine.abort_request(ids)  # a bad prompt in the list must not leave the others queued
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else len(ids) > 1)

    def chat(
        self,
        messages: Union[list[dict[str, str]], Sequence[list[dict[str, str]]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: Optional[bool] = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation and generate. ``chat_template_kwargs``: more
        variables for the template, e.g. ``{"reasoning_effort": "low"}`` (gpt-oss) or ``{"enable_thinking":
        False}`` (Qwen3)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, chat_template, add_generation_prompt,
                                                                 chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[dict[str, str]], chat_template: Optional[str] = None,
                            add_generation_prompt: bool = True,
                            chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        tok = self.engine.tokenizer
        if chat_template is None and not tok.chat_template:
            raise InvalidRequestError("this tokenizer has no chat template; pass chat_template= (--chat-template)")
        text = tok.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
        return tok.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
