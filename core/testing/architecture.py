"""Model architecture checks: a tiny random checkpoint the check writes, loaded through the plugin registry the
way an engine loads any checkpoint folder, against HF transformers where transformers knows the architecture."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pagoda.testing.contract import Where

# (prompt length, seed of its token ids): one short prompt and one longer than a 16-token KV block
PROMPTS = ((5, 1), (23, 2))


def check_architecture(factory: Any, config: dict[str, Any], *,
                       tensors: Optional[Callable[[dict[str, Any]], dict[str, torch.Tensor]]] = None,
                       max_tokens: int = 8, tolerance: float = 2e-3, seed: int = 0,
                       backends: tuple[str, ...] = ("torch", "cpu")) -> None:
    """Check a ``pagoda_model_architectures`` factory (a class such as ``DecoderForCausalLM``'s subclasses).

    ``config``: a small ``config.json`` (a dict) naming the architecture in ``architectures``; a missing
    ``vocab_size`` becomes the default model's vocabulary, whose tokenizer the checkpoint gets. The check writes a
    random-weight checkpoint (safetensors) to a temporary folder: with transformers, when it knows the
    ``model_type``; otherwise from ``tensors(config)`` (``{checkpoint name: tensor}``). It registers ``factory``
    under the architecture's name in a plugin manager of pagoda's own plugins (other installed plugins are not
    loaded; the registered architecture overrides pagoda's built-in of the same name) and, on each of ``backends``, loads the folder and decodes greedily (float32):

    - the engine built ``factory``'s model, and every checkpoint tensor found its place;
    - where transformers knows the architecture's name: its greedy tokens, and each token's log-probability within
      ``tolerance``;
    - everywhere: finite log-probabilities, the same tokens batched as one at a time, with the prompt's blocks
      from the prefix cache, and on every backend.

    Raises ContractError."""
    import transformers

    from pagoda import LLM, SamplingParams, hookimpl
    from pagoda.modeling.default_model import ensure_default_model
    from pagoda.registry.plugin_manager import PluginManager

    config = dict(config)
    arch = (config.get("architectures") or [None])[0]
    where = Where(getattr(factory, "__name__", repr(factory)), seed, f"architecture {arch!r}")
    if not arch:
        raise where.fail("check_architecture()", "config has no 'architectures' entry",
                         "the config names the architecture the factory registers as", "the config passed in")
    default_dir = ensure_default_model()
    from pagoda.engine.components import load_tokenizer

    vocab = len(load_tokenizer(str(default_dir), None))
    config.setdefault("vocab_size", vocab)
    knows_model_type = config.get("model_type") in transformers.CONFIG_MAPPING
    hf_model_class = getattr(transformers, arch, None)
    with tempfile.TemporaryDirectory(prefix="pagoda-check-architecture-") as tmp:
        folder = Path(tmp)
        hf_model = _write_checkpoint(folder, config, tensors, knows_model_type, hf_model_class, seed, where)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_dir / name, folder / name)

        class Registration:
            @hookimpl
            def pagoda_model_architectures(self):
                return {arch: factory}

        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(100, min(config["vocab_size"], vocab), (n,), generator=gen).tolist()
                   for n, _ in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        reference = None
        if hf_model is not None:
            reference = [_hf_greedy(hf_model, p, max_tokens) for p in prompts]
        seen: dict[str, list[list[int]]] = {}
        for backend in backends:
            pm = PluginManager().load(autoload=False)  # pagoda's own plugins and the factory, whatever is installed
            pm.register(Registration(), name="pagoda-testing-architecture", dist="pagoda.testing")
            at = where.at(backend, "backend")
            try:
                llm = LLM(model=str(folder), plugin_manager=pm, dtype="float32", max_model_len=128, cpu_threads=1,
                          kv_cache_memory_bytes=8 << 20, attention_backend=backend, block_size=16,
                          enable_prefix_caching=True)
            except Exception as exc:
                raise at.fail("loading the checkpoint", f"{type(exc).__name__}: {exc}",
                              "the architecture loads a checkpoint written from its config",
                              "the factory's __init__ or load_weights()") from exc
            model = llm.engine.runner.model
            if not isinstance(model, factory if isinstance(factory, type) else object):
                raise at.fail("building the model", f"the engine built a {type(model).__name__}",
                              "the registered architecture is the one used", "the plugin registration")
            batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in batched]
            for out in batched:
                logprobs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                if not all(math.isfinite(v) for v in logprobs):
                    raise at.fail("generate()", f"log-probabilities {logprobs}", "the logits are finite",
                                  "the factory's forward() or compute_logits()")
            if reference is not None:
                for prompt, out, (ref_tokens, ref_logprobs) in zip(prompts, batched, reference):
                    got = out.outputs[0]
                    if got.token_ids != ref_tokens:
                        raise at.fail(f"greedy decoding of a {len(prompt)}-token prompt",
                                      f"tokens {got.token_ids}, transformers gives {ref_tokens}",
                                      "greedy tokens equal transformers' (float32)", "the factory's forward()")
                    mine = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids)]
                    worst = max(abs(a - b) for a, b in zip(mine, ref_logprobs))
                    if worst > tolerance:
                        raise at.fail(f"greedy decoding of a {len(prompt)}-token prompt",
                                      f"log-probabilities {worst:.2e} away from transformers'",
                                      f"within {tolerance}", "the factory's forward() or compute_logits()")
            one_by_one = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
                          for p in prompts]  # the second time: the prompts' full blocks come from the cache
            if one_by_one != tokens:
                raise at.fail("generate() one prompt at a time, from the prefix cache",
                              f"tokens {one_by_one}, batched {tokens}",
                              "a prompt's tokens do not depend on its batch or on cached blocks",
                              "the factory's forward() (rows mixed across requests?)")
            seen[backend] = tokens
            llm.engine.shutdown()
        if len({json.dumps(t) for t in seen.values()}) > 1:
            raise where.fail("comparing backends", f"tokens per backend {seen}",
                             "every attention backend gives the same greedy tokens", "the factory's forward()")


def _write_checkpoint(folder: Path, config: dict[str, Any], tensors: Any, knows_model_type: bool,
                      hf_model_class: Any, seed: int, where: Where) -> Any:
    """Writes config.json and random safetensors; returns transformers' model when it knows the architecture."""
    import transformers

    if tensors is not None:
        from safetensors.torch import save_file

        (folder / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in tensors(config).items()}, str(folder / "model.safetensors"))
        return _hf_model(folder, hf_model_class)
    if not knows_model_type:
        raise where.fail("writing the checkpoint", f"transformers has no config class for model_type "
                         f"{config.get('model_type')!r}", "a checkpoint the check can write",
                         "the call: pass tensors=, a function of the config giving the checkpoint's tensors")
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases that matter
            if p.dim() == 1:
                torch.nn.init.normal_(p, mean=float(p.mean()), std=0.3)
    model.save_pretrained(str(folder), safe_serialization=True)
    written = json.loads((folder / "config.json").read_text())
    written["architectures"] = config["architectures"]
    (folder / "config.json").write_text(json.dumps(written))
    return _hf_model(folder, hf_model_class)


def _hf_model(folder: Path, hf_model_class: Any) -> Any:
    """transformers' own model of the folder, when it knows the architecture's name (else None)."""
    if hf_model_class is None:
        return None
    model = hf_model_class.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
