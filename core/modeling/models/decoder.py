"""The decoder every dense architecture is built from: a :class:`DecoderSpec` read from the checkpoint's
config.json says what each layer does; the parallel layers shard themselves; one weight loader maps checkpoint
names onto parameters through the architecture's ``packed_modules_mapping``.

An architecture is a subclass of :class:`DecoderForCausalLM` that defines ``spec_from_hf`` (its config.json ->
a spec) and, where its checkpoint names differ, ``checkpoint_renames``; docs/models.md ("Adding a dense architecture") walks through
one. Layer layouts:

- ``pre`` (Llama): ``h += attn(norm(h)); h += mlp(norm(h))``;
- ``sandwich`` (Gemma 2/3): ``h += post_attn_norm(attn(norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))``;
- ``post`` (OLMo 2): ``h += post_attn_norm(attn(h)); h += post_ff_norm(mlp(h))``.

Hidden states travel between layers as ``(x, residual)``, their sum the residual stream, so the RMSNorm that
starts the next block adds and normalises in one fused CPU kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from pagoda.config import ModelConfig
from pagoda.errors import CheckpointError, ConfigError
from pagoda.execution import distributed
from pagoda.modeling.layers.attention import Attention, kv_scale_target
from pagoda.modeling.layers.fused_ops import CpuKernels
from pagoda.modeling.layers.linear import (ColumnParallelLinear, Linear, Logits, ParallelLMHead,
                                           QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           packed_modules)
from pagoda.modeling.layers.norm import RMSNorm
from pagoda.modeling.layers.rotary import RopeSpec, RotaryEmbedding, StepRotary, split_heads

# HF activation names -> pagoda's gated MLP activations
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}


# ---- how a step calls the layers' modules ------------------------------------------------------------
#
# How a decoder's forward pass calls its layers' modules: through ``nn.Module.__call__`` only when a forward hook
# wants it.
#
# ``nn.Module.__call__`` checks eight hook registries before it calls ``forward``: about 0.5 us a call on a Zen 5
# core, eight calls a decoder layer, some 0.1 ms of a 30-layer decode step. When no forward hook is set on any of
# the model's layer modules nor globally (the usual case), a step calls the layers' and their modules'
# ``forward`` methods directly; as soon as one is set (``pagoda bench --profile`` times the linear and attention
# layers with hooks), every call goes through the modules again, so hooks run exactly as in torch.


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer's modules as a step calls them (None: the layer has no such module)."""

    input_norm: Optional[Callable]
    qkv: Callable
    attn: Callable
    o: Callable
    post_attention_norm: Callable
    pre_feedforward_norm: Optional[Callable]
    post_feedforward_norm: Optional[Callable]
    q_norm: Optional[Callable]
    k_norm: Optional[Callable]
    gate_up: Optional[Callable]  # None on an MoE layer: its experts take the MLP's place
    down: Optional[Callable]

    @classmethod
    def of(cls, layer: nn.Module, direct: bool) -> "LayerCalls":
        """``direct``: each module's bound ``forward`` (hooks skipped), else the module itself."""

        def call(name: str) -> Optional[Callable]:
            module = getattr(layer, name, None)
            if module is None:
                return None
            return module.forward if direct else module

        return cls(call("input_layernorm"), call("qkv_proj"), call("attn"), call("o_proj"),
                   call("post_attention_layernorm"), call("pre_feedforward_layernorm"),
                   call("post_feedforward_layernorm"), call("q_norm"), call("k_norm"), call("gate_up_proj"),
                   call("down_proj"))


class ForwardHooks:
    """Whether a forward hook is set on any of some modules, or on every module (torch's global hooks).

    Asked once a step: one pass over the modules' hook dictionaries (about 2 us for 330 modules)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        # torch adds and removes hooks in these dictionaries in place: references to them stay current
        self._registries = [registry for m in modules for registry in (m._forward_hooks, m._forward_pre_hooks)]

    def present(self) -> bool:
        return (any(self._registries) or bool(torch_module._global_forward_hooks)
                or bool(torch_module._global_forward_pre_hooks))


class LayerCallPlan:
    """The decoder layers of one model stage with both ways of calling their modules, built once on the model's
    first forward (when every layer holds its final modules: an MoE layer drops its dense MLP after the base
    layer's ``__init__``), and the way this step takes."""

    def __init__(self, layers: tuple[nn.Module, ...]) -> None:
        self.layers = layers
        self._direct = [LayerCalls.of(layer, direct=True) for layer in layers]
        self._through_modules = [LayerCalls.of(layer, direct=False) for layer in layers]
        self._hooks = ForwardHooks(m for layer in layers for m in layer.modules())
        self.direct: Optional[bool] = None  # set by choose()

    def choose(self) -> bool:
        """Pick this step's way (direct unless a hook is set) and hand each layer its calls; returns it."""
        direct = not self._hooks.present()
        if direct != self.direct:
            for layer, calls in zip(self.layers, self._direct if direct else self._through_modules):
                layer.calls = calls
            self.direct = direct
        return direct


@dataclass(frozen=True)
class DecoderSpec:
    """What a dense decoder's layers do, read from its config.json by the architecture."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    act: str = "silu"  # a value of ACTIVATIONS
    norm_offset: float = 0.0  # Gemma: norm weights are stored as w and applied as (offset + w)
    layout: str = "pre"  # "pre", "sandwich" or "post" (see the module doc)
    qk_norm: Optional[str] = None  # RMSNorm of q and k before RoPE: "head" (per head) or "full" (the projection)
    scale: Optional[float] = None  # attention scale (None: head_dim ** -0.5)
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    sliding_windows: tuple[Optional[int], ...] = ()  # per layer (empty: none)
    ropes: tuple[Optional[RopeSpec], ...] = ()  # per layer; None: the layer has no RoPE
    embed_scale: Optional[float] = None  # embeddings times this (Gemma: sqrt(hidden); Granite's multiplier)
    residual_multiplier: float = 1.0  # attention and MLP outputs times this before the residual add (Granite)
    logits_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling)
    tie_word_embeddings: bool = False
    sinks: bool = False  # per-head attention sinks (checkpoint ``self_attn.sinks``)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def window(self, i: int) -> Optional[int]:
        return self.sliding_windows[i] if self.sliding_windows else None

    def rope(self, i: int) -> Optional[RopeSpec]:
        return self.ropes[i]


def hf_field(cfg: dict[str, Any], name: str, default: Any = None, required: bool = False) -> Any:
    """``cfg[name]``; a required field missing is a load-time error that names it."""
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if required:
        raise ConfigError(f"config.json has no {name!r}, which {cfg.get('architectures', ['this model'])[0]} needs")
    return default


def refuse(cfg: dict[str, Any], name: str, ok: Any, what: str) -> None:
    """A config field pagoda cannot honour: an error naming it, unless its value is ``ok`` (or absent)."""
    value = cfg.get(name)
    if value is not None and value != ok and not (isinstance(ok, tuple) and value in ok):
        raise ConfigError(f"config.json sets {name}={value!r}: {what}")


def activation(cfg: dict[str, Any], *names: str) -> str:
    for name in names:
        if cfg.get(name):
            act = ACTIVATIONS.get(cfg[name])
            if act is None:
                raise ConfigError(f"config.json sets {name}={cfg[name]!r}, an activation pagoda does not implement "
                                  f"(supported: {', '.join(sorted(ACTIVATIONS))})")
            return act
    return "silu"


def base_spec(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields every decoder config spells alike (HF's names), as DecoderSpec keyword arguments."""
    heads = int(hf_field(cfg, "num_attention_heads", required=True))
    hidden = int(hf_field(cfg, "hidden_size", required=True))
    return dict(vocab_size=int(hf_field(cfg, "vocab_size", required=True)), hidden_size=hidden,
                intermediate_size=int(hf_field(cfg, "intermediate_size", required=True)),
                num_layers=int(hf_field(cfg, "num_hidden_layers", required=True)), num_heads=heads,
                num_kv_heads=int(hf_field(cfg, "num_key_value_heads", heads)),
                head_dim=int(hf_field(cfg, "head_dim", hidden // heads)),
                rms_norm_eps=float(hf_field(cfg, "rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf_field(cfg, "tie_word_embeddings", False)))


def layer_windows(cfg: dict[str, Any], num_layers: int, default_all: bool) -> tuple[Optional[int], ...]:
    """Per-layer sliding windows: ``layer_types`` ("sliding_attention" / "full_attention") where the config
    lists them, else ``sliding_window`` on every layer when ``default_all``."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ConfigError(f"config.json lists {len(types)} layer_types for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"config.json layer_types has {sorted(unknown)}; pagoda knows sliding_attention and "
                              "full_attention")
        if "sliding_attention" in types and not window:
            raise ConfigError("config.json has sliding_attention layers but no sliding_window")
    max_positions = cfg.get("max_position_embeddings")
    if window and max_positions and int(window) >= int(max_positions):
        window = None  # wider than any sequence (Phi-4-mini's 262144): it never slides, and no layer needs masks
    if types:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if window and default_all:
        return (int(window),) * num_layers
    return ()


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no weights, never run."""

    def forward(self, *args: Any) -> None:
        raise RuntimeError("a decoder layer of another pipeline stage was run on this one")


def _offset_loader(offset: float):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: Optional[int], name: str) -> None:
        if tuple(param.shape) != tuple(loaded.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(loaded.shape)} but the model expects "
                                  f"{tuple(param.shape)}")
        param.data.copy_((loaded.float() + offset).to(param.dtype))
    return load


def _narrow_loader(param: nn.Parameter, start: int) -> None:
    """Load rows ``[start, start + len(param))`` of the checkpoint's tensor (this rank's part), through the loader
    the parameter already has (a norm offset) or a plain copy."""
    inner = getattr(param, "weight_loader", None)

    def load(p: nn.Parameter, loaded: torch.Tensor, shard: Optional[int], name: str) -> None:
        if loaded.dim() != 1 or loaded.shape[0] < start + p.shape[0]:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(loaded.shape)}; this rank needs its rows "
                                  f"{start}..{start + p.shape[0] - 1} (the checkpoint does not match its config.json)")
        part = loaded.narrow(0, start, p.shape[0])
        if inner is not None:
            inner(p, part, shard, name)
        else:
            p.data.copy_(part.to(p.dtype))
    param.weight_loader = load


class DecoderLayer(nn.Module):
    """One decoder layer of a :class:`DecoderSpec`: attention and a gated MLP, normed as the layout says."""

    def __init__(self, spec: DecoderSpec, cfg: ModelConfig, backend: Any, quant: Any, idx: int,
                 kernels: CpuKernels, rotary: Optional[RotaryEmbedding]) -> None:
        super().__init__()
        self.spec, self.kernels = spec, kernels
        dtype, d, hidden, inter = cfg.dtype, spec.head_dim, spec.hidden_size, spec.intermediate_size
        prefix = f"model.layers.{idx}"
        q = lambda name: quant.for_layer(f"{prefix}.{name}") if quant is not None else None  # noqa: E731
        self.qkv_proj = QKVParallelLinear(hidden, d, spec.num_heads, spec.num_kv_heads, spec.qkv_bias, dtype,
                                          q("self_attn.qkv_proj"), f"{prefix}.self_attn.qkv_proj", kernels)
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.o_proj = RowParallelLinear(spec.num_heads * d, hidden, spec.o_bias, dtype, q("self_attn.o_proj"),
                                        f"{prefix}.self_attn.o_proj", kernels, input_part=self.qkv_proj.q_cols)
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], spec.mlp_bias, dtype, q("mlp.gate_up_proj"),
                                                 f"{prefix}.mlp.gate_up_proj", kernels)
        self.down_proj = RowParallelLinear(inter, hidden, spec.mlp_bias, dtype, q("mlp.down_proj"),
                                           f"{prefix}.mlp.down_proj", kernels)
        norm = lambda size: self._norm(size, spec, dtype, kernels)  # noqa: E731
        self.layout = spec.layout
        if spec.layout in ("pre", "sandwich"):
            self.input_layernorm = norm(hidden)
        self.post_attention_layernorm = norm(hidden)
        if spec.layout == "sandwich":
            self.pre_feedforward_layernorm = norm(hidden)
        if spec.layout in ("sandwich", "post"):
            self.post_feedforward_layernorm = norm(hidden)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = norm(d), norm(d)
        elif spec.qk_norm == "full":
            # this rank's part of the norms of the whole q and k projections
            self.q_norm, self.k_norm = norm(heads.num_heads * d), norm(heads.num_kv_heads * d)
        self._sharded_qk = None
        tp = distributed.current()
        if spec.qk_norm == "full" and tp.size > 1:
            _narrow_loader(self.q_norm.weight, heads.q_start * d)
            _narrow_loader(self.k_norm.weight, heads.kv_start * d)
            # the projections' full widths, and how many ranks hold each KV head (their k counted once)
            copies = tp.size // spec.num_kv_heads if spec.num_kv_heads < tp.size else 1
            self._sharded_qk = (tp, spec.num_heads * d, spec.num_kv_heads * d, copies)
        scale = spec.scale if spec.scale is not None else d ** -0.5
        self.attn = Attention(backend, idx, heads.num_heads, heads.num_kv_heads, d, scale, spec.window(idx),
                              spec.attn_softcap, spec.sinks, dtype)
        if self.attn.sinks is not None and distributed.current().size > 1:
            start = heads.q_start
            self.attn.sinks.weight_loader = lambda p, t, s, n: p.data.copy_(t.narrow(0, start, p.shape[0]))
        # the fused rotary kernel rotates q and k inside the projection's output; a layer that norms q and k
        # first, or rotates part of each head, rotates them after the split
        self.fused_rope = rotary is not None and spec.qk_norm is None and not rotary.partial
        # per-head q/k norms (Qwen3, Gemma 3) and the rotary embedding: one kernel over the projection's output
        self.fused_qk_norm = spec.qk_norm == "head" and (rotary is None or not rotary.partial)
        self.act = spec.act
        self.residual_multiplier = spec.residual_multiplier
        self._rotary_id = id(rotary) if rotary is not None else None
        # this step's way of calling the modules above (a LayerCalls): set by the model before its layers run
        self.calls: Optional[LayerCalls] = None

    @staticmethod
    def _norm(size: int, spec: DecoderSpec, dtype: torch.dtype, kernels: CpuKernels) -> RMSNorm:
        norm = RMSNorm(size, spec.rms_norm_eps, dtype, kernels)
        if spec.norm_offset:
            norm.weight.weight_loader = _offset_loader(spec.norm_offset)
        return norm

    def attention(self, x: torch.Tensor, ropes: dict, kv_cache: Any, metadata: Any) -> torch.Tensor:
        c = self.calls
        qkv = c.qkv(x)  # [num_tokens, (h + 2 hkv) * d]
        rope: Optional[StepRotary] = ropes.get(self._rotary_id)
        if self.fused_rope:
            q, k, v = rope.split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        elif self.fused_qk_norm and self.kernels.qk_norm_rotary_(
                qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads, self.num_kv_heads,
                self.head_dim, rope.kernel_tables() if rope is not None else None):
            q, k, v = split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
            t, d = q.shape[0], self.head_dim
            if self.qk_norm == "head":
                q = c.q_norm(q.reshape(-1, d)).view(t, self.num_heads, d)
                k = c.k_norm(k.reshape(-1, d)).view(t, self.num_kv_heads, d)
            elif self._sharded_qk is not None:
                q, k = self._sharded_full_qk_norm(q.reshape(t, -1), k.reshape(t, -1))
                q, k = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d)
            elif self.qk_norm == "full":
                q = c.q_norm(q.reshape(t, -1)).view(t, self.num_heads, d)
                k = c.k_norm(k.reshape(t, -1)).view(t, self.num_kv_heads, d)
            if rope is not None:
                q, k = rope.rotate(q, k)
        return c.o(c.attn(q, k, v, kv_cache, metadata))  # attention: [num_tokens, h * d]

    def _sharded_full_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of the whole q and k projections (OLMo 2) when this rank holds part of their heads: one
        all-reduce of each token's two sums of squares. ``q [T, h * d]``, ``k [T, hkv * d]`` of this rank."""
        tp, q_width, k_width, k_copies = self._sharded_qk
        qf, kf = q.float(), k.float()
        sums = torch.stack((qf.pow(2).sum(-1), kf.pow(2).sum(-1) / k_copies), dim=-1)  # [T, 2]
        tp.all_reduce(sums, "qk_norm")
        eps = self.spec.rms_norm_eps
        q_inv = torch.rsqrt(sums[:, :1] / q_width + eps)
        k_inv = torch.rsqrt(sums[:, 1:] / k_width + eps)
        return ((qf * q_inv) * self.q_norm.weight.float()).to(q.dtype), \
            ((kf * k_inv) * self.k_norm.weight.float()).to(k.dtype)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        c = self.calls
        gate_up = c.gate_up(x)
        if self.act == "silu":
            h = self.kernels.silu_and_mul(gate_up)
        elif self.act == "gelu_tanh":
            h = self.kernels.gelu_tanh_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh" if self.act == "gelu_tanh" else "none") * up
        return c.down(h)

    def forward(self, x, residual, ropes: dict, kv_cache, metadata):
        c = self.calls
        if self.layout == "post":
            h = x if residual is None else x + residual
            a = c.post_attention_norm(self.attention(h, ropes, kv_cache, metadata))
            h = h + a
            return c.post_feedforward_norm(self.mlp(h)), h
        if residual is None:
            residual = x
            x = c.input_norm(x)
        else:
            x, residual = c.input_norm(x, residual)
        a = self.attention(x, ropes, kv_cache, metadata)
        if self.layout == "sandwich":
            a = c.post_attention_norm(a)
            x, residual = c.pre_feedforward_norm(a, residual)
            return c.post_feedforward_norm(self.mlp(x)), residual
        if self.residual_multiplier != 1.0:
            a = a * self.residual_multiplier
        x, residual = c.post_attention_norm(a, residual)
        m = self.mlp(x)
        if self.residual_multiplier != 1.0:
            m = m * self.residual_multiplier
        return m, residual


class DecoderForCausalLM(nn.Module):
    """A dense decoder built from the :class:`DecoderSpec` its subclass reads from config.json.
    ``forward`` takes one step's flattened tokens."""

    # given the caches of its first N layers only, forward runs those N layers, then the final norm:
    # a self-speculation draft ("self:layers=N") is the target itself
    runs_first_layers_of_caches = True
    # LoRA adapters apply to its projections (an architecture whose layers they cannot reach sets False)
    supports_lora = True
    # builds this rank's shard under tensor parallelism (pagoda.execution.distributed.current())
    supports_tensor_parallel = True
    # builds only its pipeline stage's layers (pagoda.execution.distributed.current_stage()); forward takes
    # ``intermediate`` and returns (hidden states, residual) before the last stage
    supports_pipeline_parallel = True
    # fused layer -> the checkpoint projections it stacks, in output order (a LoRA adapter's q_proj is slice 0;
    # a quant config's q_proj entry is read for qkv_proj). A checkpoint may also store the fused layer itself
    # (Phi-3's qkv_proj): the loader splits it by the layer's output sizes.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # checkpoint name fragment -> pagoda's, applied before the packing (an architecture's own spellings)
    checkpoint_renames: dict[str, str] = {}
    # the decoder layer class (an MoE architecture's replaces the MLP of its sparse layers)
    layer_class: type = DecoderLayer

    @classmethod
    def spec_from_hf(cls, cfg: dict[str, Any]) -> DecoderSpec:
        """The architecture's reading of its (text) config.json; a field it cannot honour raises ConfigError
        naming it."""
        raise NotImplementedError

    def prompt_step(self) -> ContextManager[None]:
        """Prompt rows through the GEMM at every row count (see :meth:`CpuKernels.prompt_step`)."""
        return self.kernels.prompt_step()

    def __init__(self, cfg: ModelConfig, backend: Any, quant: Any = None) -> None:
        super().__init__()
        text_cfg = cfg.hf_config.get("text_config", cfg.hf_config)
        spec = self.spec_from_hf(text_cfg)
        if any(w is not None and w >= cfg.max_model_len for w in spec.sliding_windows):
            # a window as long as the longest sequence the engine holds hides no key: such a layer attends
            # plainly (Mistral 7B v0.1's 4,096 at --max-model-len 4096 or less), on the fused kernels that windowed
            # layers cannot take
            spec = replace(spec, sliding_windows=tuple(None if w is not None and w >= cfg.max_model_len else w
                                                       for w in spec.sliding_windows))
        self.spec = spec
        self.cfg = cfg
        # the CPU kernels of this model's layers, chosen from its engine's host settings
        self.kernels = kernels = CpuKernels(cfg.host, cfg.batch_invariant)
        self.tp = tp = distributed.current()
        # pipeline parallelism: this stage's layers; the embedding on the first, the norm and LM head on the last
        self.stage = stage = distributed.current_stage()
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.embed_tokens = None
        if stage.is_first or (stage.is_last and self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, cfg.dtype)
        # one rotary table per distinct RoPE of the layers (Gemma 3: a local and a global one)
        max_pos = max(cfg.max_model_len, int(text_cfg.get("max_position_embeddings", cfg.max_model_len)))
        tables: dict[RopeSpec, RotaryEmbedding] = {}
        for i in range(spec.num_layers):
            rs = spec.rope(i)
            if rs is not None and rs not in tables and stage.owns_layer(i):
                tables[rs] = RotaryEmbedding(spec.head_dim, max_pos, rs.theta, None, cfg.dtype, kernels, spec=rs,
                                             max_model_len=cfg.max_model_len)
        self.rotaries = nn.ModuleList(tables.values())
        with packed_modules(self.packed_modules_mapping):  # what quant configs read for the fused layers
            self.layers = nn.ModuleList(
                self.layer_class(spec, cfg, backend, quant, i, kernels, tables.get(spec.rope(i)))
                if stage.owns_layer(i) else MissingLayer() for i in range(spec.num_layers))
        # the layers forward runs, and whether it ends the model (a tuple: not registered as submodules again)
        self._stage_layers = tuple(self.layers[stage.layer_start:stage.layer_end])
        self._is_last_stage = stage.is_last
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = DecoderLayer._norm(spec.hidden_size, spec, cfg.dtype, kernels)
            if not self.tie_word_embeddings:
                self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, cfg.dtype, kernels)
        self._logits = Logits(spec.vocab_size, kernels)
        self._embed_scale = spec.embed_scale
        # how forward calls the stage's layers and their modules: made on the first forward, once the weights are
        # loaded and every layer holds its final modules
        self._call_plan: Optional[LayerCallPlan] = None

    # the first rotary table (the Llama family has one): kept for callers of the single-table model
    @property
    def rotary(self) -> Optional[RotaryEmbedding]:
        return self.rotaries[0] if len(self.rotaries) else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, metadata: Any,
                intermediate: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
        """``input_ids``, ``positions``: ``[num_tokens]``. Returns hidden states ``[num_tokens, hidden]``.

        Runs one decoder layer per entry of ``kv_caches`` (all of them normally; the first N for a
        self-speculation draft). On a pipeline stage, ``kv_caches`` are the stage's layers'; a stage after the
        first starts from ``intermediate`` (the previous stage's hidden states and residual), and a stage
        before the last returns its own ``(hidden states, residual)`` instead of the normed hidden states."""
        if intermediate is None:
            x = self.embed_tokens(input_ids)
            if self._embed_scale is not None:
                x = x * torch.tensor(self._embed_scale, dtype=x.dtype)
            residual = None
        else:
            x, residual = intermediate
        ropes = {id(r): r.at(positions) for r in self.rotaries}  # once per step, not per layer
        if self._call_plan is None:
            self._call_plan = LayerCallPlan(self._stage_layers)
        direct = self._call_plan.choose()  # no forward hooks: the modules' forwards, without nn.Module.__call__
        for layer, kv_cache in zip(self._stage_layers, kv_caches):
            x, residual = (layer.forward if direct else layer)(x, residual, ropes, kv_cache, metadata)
        if not self._is_last_stage:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, vocab]`` in float32."""
        logits = self._logits(hidden, self.lm_head, self.embed_tokens)
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        if self.spec.final_softcap:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits

    def attention_features(self) -> set[str]:
        """What this model's layers ask of the attention backend beyond causal attention."""
        return set().union(*(m.features for m in self.modules() if isinstance(m, Attention)))

    def layer_windows(self) -> dict[int, int]:
        """Layer index -> sliding window, for this stage's layers that have one (their attention layers read the
        window pool's metadata when it is on)."""
        return {m.layer_idx: m.sliding_window for m in self.modules() if isinstance(m, Attention) and m.sliding_window}

    # ---- loading -------------------------------------------------------------------------------------

    def map_name(self, name: str) -> tuple[str, Optional[int]]:
        """Checkpoint name -> (parameter name, shard index in a fused layer or None)."""
        if name.startswith("model."):
            name = name[len("model."):]
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        name = name.replace(".self_attn.sinks", ".attn.sinks")
        shard = None
        for fused, parts in self.packed_modules_mapping.items():
            for i, part in enumerate(parts):
                if f".{part}." in name:
                    name, shard = name.replace(f".{part}.", f".{fused}."), i
                    break
            if shard is not None:
                break
        return name.replace(".self_attn.", ".").replace(".mlp.", "."), shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from ``(checkpoint_name, tensor)`` pairs; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or self._on_another_stage(name):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            if (kv_scale := kv_scale_target(name)) is not None:
                self._load_kv_scale(name, tensor, *kv_scale)
                continue
            target, shard = self.map_name(name)
            param = params.get(target)
            if param is None:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}; "
                    "the checkpoint does not match its config.json"
                )
            module = self._module_of(target)
            if shard is None and isinstance(module, Linear) and len(module.full_output_sizes) > 1:
                # the checkpoint stores the fused layer itself: its shards, one after the other
                for i, part in enumerate(self._fused_parts(module, param, target, tensor, name)):
                    self._load_one(param, part, i, name)
                    loaded.add(f"{target}#{i}")
                continue
            self._load_one(param, tensor, shard, name)
            loaded.add(target if shard is None else f"{target}#{shard}")
        expected = set()
        for pname, param in params.items():
            if getattr(param, "is_optional", False):
                continue  # a quant method's optional tensor (GPTQ g_idx without act-order)
            module = self._module_of(pname)
            shards = len(module.output_sizes) if isinstance(module, Linear) and len(module.output_sizes) > 1 else 0
            expected.update({f"{pname}#{i}" for i in range(shards)} if shards else {pname})
        missing = sorted(expected - loaded)
        if missing:
            raise CheckpointError(
                f"checkpoint is missing {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}"
            )
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        if self.lm_head is None and self.stage.is_last:
            self._logits.packed_tied(self.embed_tokens)  # packed now, not in the first request's step

    @staticmethod
    def _fused_parts(module: nn.Module, param: nn.Parameter, target: str, tensor: torch.Tensor,
                     name: str) -> list[torch.Tensor]:
        """A fused layer's checkpoint tensor cut into its shards along the output dimension: rows of a dense
        weight or bias, or a quantized tensor's output entries (``out_pack`` channels per packed int32 word, as
        its quant method's loader says); a tensor that runs over the inputs only (GPTQ's g_idx) is every shard's."""
        sizes = module.full_output_sizes
        loader = getattr(param, "weight_loader", None)
        if target.endswith((".weight", ".bias")) and not hasattr(loader, "out_dim"):
            dim, pack = 0, 1
        elif hasattr(loader, "out_dim"):
            dim, pack = loader.out_dim, loader.out_pack
        elif getattr(loader, "same_for_every_shard", False):
            return [tensor] * len(sizes)
        else:
            raise CheckpointError(f"tensor {name!r}: this checkpoint stores {module.prefix} fused and quantized in a "
                                  "way pagoda does not split; use the unquantized checkpoint (or quantize it "
                                  "online, e.g. --quantization int8)")
        if any(size % pack for size in sizes):
            raise CheckpointError(f"tensor {name!r}: {module.prefix} stacks {sizes} output channels, which do not "
                                  f"fall on whole words of {pack} packed channels; this fused layer cannot be split")
        if tensor.dim() <= dim or tensor.shape[dim] * pack != sum(sizes):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}; {module.prefix} stacks {sizes} "
                                  f"output channels along dim {dim} (the checkpoint does not match its config.json)")
        return list(tensor.split([size // pack for size in sizes], dim=dim))

    def _module_of(self, pname: str) -> nn.Module:
        return self.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else self

    @staticmethod
    def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard: Optional[int], name: str) -> None:
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard, name)
            return
        if tuple(param.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)} but the model expects {tuple(param.shape)}"
            )
        param.data.copy_(tensor.to(param.dtype))

    def _on_another_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a part of the model another pipeline stage holds."""
        if self.stage.num_stages == 1:
            return False
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            return index.isdigit() and not self.stage.owns_layer(int(index))
        if name == "model.embed_tokens.weight":
            return self.embed_tokens is None
        return name.startswith(("model.norm.", "lm_head.")) and not self.stage.is_last

    def _load_kv_scale(self, name: str, tensor: torch.Tensor, layer_idx: int, which: str) -> None:
        """A per-layer fp8 KV cache scale (used only with kv_cache_dtype fp8)."""
        if layer_idx >= len(self.layers):
            raise CheckpointError(f"checkpoint tensor {name!r} names layer {layer_idx}, but the model has "
                                  f"{len(self.layers)} layers; the checkpoint does not match its config.json")
        self.layers[layer_idx].attn.load_kv_scale(which, tensor, name)
