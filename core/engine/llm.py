"""``LLM``: the offline API (vLLM-compatible): generate, chat and beam search over a batch of prompts; embed, score
and encode with a pooling model."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from pagoda.engine.beam_search import BeamSearch, check_beam_width, step_params
from pagoda.engine.engine_args import EngineArgs
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.engine.vllm_options import split_offline_options
from pagoda.errors import InvalidRequestError
from pagoda.execution.lora_request import LoRARequest
from pagoda.outputs import (BeamSearchOutput, EmbeddingOutput, EmbeddingRequestOutput,
                            PoolingOutput, PoolingRequestOutput, RequestOutput, RequestOutputKind, ScoringOutput,
                            ScoringRequestOutput)
from pagoda.registry.plugin_manager import PluginManager
from pagoda.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    Keyword options are :class:`pagoda.EngineArgs` fields (``dtype``,
    ``max_model_len``, ``block_size``, ``max_num_seqs``, ...), and vLLM's that mean nothing on pagoda
    (``trust_remote_code``, ``gpu_memory_utilization``, ``enforce_eager``, ...: a warning each; see
    :mod:`pagoda.engine.vllm_options`). Unlike a served engine, it keeps no request
    counters or latency histograms (``engine.stats`` is None) unless given ``disable_log_stats=False``.
    """

    def __init__(self, model: Optional[str] = None, plugin_manager: Optional[PluginManager] = None,
                 task: str = "auto", runner: Optional[str] = None, **kwargs: Any) -> None:
        """``task``: ``generate``, ``embed`` or ``score``, or ``auto`` (read from the checkpoint, as ``pagoda
        serve --task`` reads it); ``runner="pooling"`` is vLLM's name for a pooling task. A pooling model serves
        :meth:`embed`, :meth:`score` and :meth:`encode` (``engine`` is then None and ``pooling`` its engine)."""
        from pagoda.engine.pooling import PoolingEngine, resolve_serving_task
        from pagoda.modeling.default_model import resolve_model_path

        kwargs.setdefault("disable_log_stats", True)
        # vLLM's options that mean nothing here (trust_remote_code, gpu_memory_utilization, enforce_eager, ...):
        # a warning each, so a script written for vLLM runs
        options = split_offline_options(kwargs)
        model_dir = str(resolve_model_path(model))
        self.task = resolve_serving_task(model_dir, task, runner)
        self.engine: Optional[LLMEngine] = None
        self.pooling: Optional[PoolingEngine] = None
        if self.task == "generate":
            self.engine = LLMEngine.from_engine_args(EngineArgs.build(model=model, **options), plugin_manager)
        else:
            self.pooling = PoolingEngine(EngineArgs.build(model=model_dir, **options), self.task, plugin_manager)
        self._counter = 0

    @property
    def llm_engine(self) -> Optional[LLMEngine]:
        """The engine, under vLLM's name for it (``engine``)."""
        return self.engine

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (between calls nothing runs, so every cached block is idle); later
        prompts compute all their tokens until they are cached again. True, as vLLM's returns when it reset."""
        self._generator().kv_manager.reset_prefix_cache()
        return True

    def get_tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else self.pooling.tokenizer

    def _generator(self) -> LLMEngine:
        if self.engine is None:
            raise InvalidRequestError(f"this model was loaded for the {self.task!r} task, which does not generate "
                                      "text: use embed(), score() or encode(), or load a generative model")
        return self.engine

    # ---- pooling models ------------------------------------------------------------------------------------

    def _pooling_engine(self, method: str):
        if self.pooling is None:
            raise InvalidRequestError(f"{method}() needs a pooling model: this one was loaded to generate; pass "
                                      "task=\"embed\" (or runner=\"pooling\") for a model that embeds")
        return self.pooling

    def _pooling_inputs(self, prompts: Any, param: str) -> list[Any]:
        from pagoda.engine.pooling import PoolingInput

        pooling = self.pooling
        prompts = _as_prompt_list(prompts)
        items = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
            item = pooling.tokenize(prompt) if isinstance(prompt, str) else PoolingInput([int(t) for t in prompt])
            pooling.check(item, param)
            items.append(item)
        return items

    def _request_ids(self, n: int) -> list[str]:
        ids = [f"llm-{self._counter + i}" for i in range(n)]
        self._counter += n
        return ids

    def encode(self, prompts: Any, use_tqdm: Optional[bool] = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled hidden state (``outputs.data``: not normalized; a cross-encoder's score)."""
        pooling = self._pooling_engine("encode")
        items = self._pooling_inputs(prompts, "prompts")
        return [PoolingRequestOutput(rid, PoolingOutput(data), list(item.token_ids))
                for rid, item, data in zip(self._request_ids(len(items)), items, pooling.encode(items))]

    def embed(self, prompts: Any, use_tqdm: Optional[bool] = None,
              dimensions: Optional[int] = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``),
        normalized where the model normalizes (its modules.json), cut to ``dimensions`` for a Matryoshka model;
        as ``/v1/embeddings`` answers."""
        from pagoda.modeling.pooling import finish_embedding

        pooling = self._pooling_engine("embed")
        if dimensions is not None and not (pooling.pooling.matryoshka and 1 <= dimensions <= pooling.hidden_size):
            raise InvalidRequestError(f"dimensions={dimensions}: the model has no Matryoshka representation or "
                                      f"{dimensions} is not in [1, {pooling.hidden_size}]", param="dimensions")
        items = self._pooling_inputs(prompts, "prompts")
        vectors = pooling.encode(items)
        return [EmbeddingRequestOutput(rid, EmbeddingOutput(
                    finish_embedding(v, pooling.pooling.normalize, dimensions).tolist()), list(item.token_ids))
                for rid, item, v in zip(self._request_ids(len(items)), items, vectors)]

    def score(self, data_1: Union[str, Sequence[str]], data_2: Union[str, Sequence[str]],
              use_tqdm: Optional[bool] = None) -> list[ScoringRequestOutput]:
        """One score per pair (one ``data_1`` against each ``data_2``, or lists of the same length): a
        cross-encoder's, or the cosine of the two texts' embeddings; as ``/v1/score`` answers."""
        import torch

        pooling = self._pooling_engine("score")
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1 and len(second) > 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise InvalidRequestError(f"data_1 has {len(first)} texts and data_2 {len(second)}: pass one data_1 and "
                                      "any number of data_2, or lists of the same length", param="data_2")
        ids = self._request_ids(len(first))
        if pooling.scores_pairs_itself:
            items = [pooling.tokenize_pair(a, b) for a, b in zip(first, second)]
            for item in items:
                pooling.check(item, "data_2")
            return [ScoringRequestOutput(rid, ScoringOutput(float(s)), list(item.token_ids))
                    for rid, item, s in zip(ids, items, pooling.encode(items))]
        texts = list(dict.fromkeys([*first, *second]))
        items = self._pooling_inputs(texts, "data_2")
        vectors = dict(zip(texts, pooling.encode(items)))
        tokens = dict(zip(texts, items))
        return [ScoringRequestOutput(rid, ScoringOutput(float(torch.nn.functional.cosine_similarity(
                    vectors[a], vectors[b], dim=0))), list(tokens[a].token_ids) + list(tokens[b].token_ids))
                for rid, a, b in zip(ids, first, second)]

    def shutdown(self) -> None:
        """Stop the engine (and the ranks and helper processes it started)."""
        if self.engine is not None:
            self.engine.shutdown()
        if self.pooling is not None:
            self.pooling.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no SamplingParams: the model's recommended
        settings (its generation_config.json, ``generation_config="none"`` to leave them out) over
        SamplingParams' own defaults."""
        return SamplingParams(**self._generator().config.model.sampling_defaults)

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
        prompts = _as_prompt_list(prompts)
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
        engine = self._generator()
        ids = []
        try:
            for i, (prompt, params, lora) in enumerate(zip(prompts, params_list, loras)):
                rid = f"llm-{self._counter}"
                self._counter += 1
                prio = priority[i] if priority is not None else None
                # only the finished outputs are returned: none is built before its request finishes
                ids.append(engine.add_request(rid, prompt, params, priority=prio,
                                                   output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora))
        except Exception:
            engine.abort_request(ids)  # a bad prompt in the list must not leave the others queued
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

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search over each prompt (text, token ids, or a prompt dict), as vLLM's ``LLM.beam_search``: each
        step extends every live beam by its ``2 * beam_width`` most likely next tokens (one engine step for all
        beams of all prompts, their shared prefixes from the prefix cache) and keeps the ``beam_width``
        candidates of highest score; a candidate ending in the end-of-sequence token is finished (unless
        ``ignore_eos``). Returns, per prompt, the ``beam_width`` best of the finished and live beams."""
        engine = self._generator()
        check_beam_width(params.beam_width, engine.config.model.max_logprobs, "beam_width", "max_logprobs")
        prompts = _as_prompt_list(prompts)
        searches = [BeamSearch(params, engine.eos_token_id) for _ in prompts]
        sampling = step_params(params)
        for n in range(params.max_tokens):
            order = [(search, prompt_input) for search, prompt in zip(searches, prompts)
                     for prompt_input in search.inputs(prompt)]
            if not order:
                break
            outs = iter(self.generate([prompt_input for _, prompt_input in order], sampling,
                                      use_tqdm=use_tqdm and n == 0))
            for search in searches:
                search.advance([next(outs) for _ in search.live])
        return [BeamSearchOutput(search.best(engine.tokenizer.decode)) for search in searches]

    def apply_chat_template(self, messages: list[dict[str, str]], chat_template: Optional[str] = None,
                            add_generation_prompt: bool = True,
                            chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        tok = self._generator().tokenizer
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


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text, token ids or a prompt dict) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
