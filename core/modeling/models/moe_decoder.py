"""The decoder of Mixture-of-Experts architectures: the dense decoder with a :class:`SparseMoeBlock` in place of
the MLP on the layers its :class:`MoeSpec` makes sparse, and a loader for the experts' checkpoint tensors
(one tensor per expert and projection, as Mixtral and Qwen write them, or all experts stacked, as gpt-oss)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

from pagoda.errors import CheckpointError, ConfigError
from pagoda.modeling.layers.linear import ColumnParallelLinear, RowParallelLinear, UnquantizedLinearMethod
from pagoda.modeling.layers.moe import FusedMoE, RouterSpec, SharedExpert, SparseMoeBlock
from pagoda.modeling.models.decoder import DecoderForCausalLM, DecoderLayer, DecoderSpec

# model.layers.N.(mlp|block_sparse_moe).experts.REST
_EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(.+)$")
# REST for one expert's projection: E.gate_proj.weight (Qwen), E.w1.weight (Mixtral), ...; a GPTQ/AWQ checkpoint's
# E.w1.qweight, qzeros, scales and g_idx; a compressed-tensors one's weight_packed, weight_scale, weight_shape and
# weight_g_idx (pack-quantized), or an int8 / FP8 weight with its weight_scale; an FP8 (quant_method: fp8) one's
# weight with its weight_scale_inv per block
_ONE_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|bias|qweight|qzeros|scales|g_idx|"
                         r"weight_packed|weight_scale|weight_scale_inv|weight_shape|weight_g_idx|input_scale|"
                         r"weight_zero_point)$")
# model.layers.N.mlp.shared_expert.PROJ.weight: Qwen2-MoE's shared expert, unquantized
_SHARED_EXPERT_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_expert\.(?:gate|up|down)_proj\.weight$")
_QUANTIZED = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_scale_inv",
              "weight_shape", "weight_g_idx", "input_scale", "weight_zero_point")
_QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)  # an expert "weight" stored quantized (compressed-tensors)
_LOADERS = ("GPTQConfig", "AWQConfig", "CompressedTensorsConfig", "Mxfp4Config", "Fp8Config")
_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class MoeSpec:
    """What an architecture's sparse layers do, read from its config.json (``DecoderSpec.extra["moe"]``)."""

    num_experts: int
    intermediate_size: int  # each routed expert's
    router: RouterSpec
    sparse_layers: tuple[bool, ...]  # per layer: an MoE block (True) or the dense MLP
    router_bias: bool = False
    activation: str = "silu"  # or "clamped_swiglu" (gpt-oss)
    expert_bias: bool = False
    alpha: float = 1.702
    limit: float = 7.0
    shared_intermediate_size: int = 0  # a shared expert's (0: none)
    shared_gate: bool = False


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is an MoE block on the layers the spec makes sparse."""

    def __init__(self, spec: DecoderSpec, cfg: Any, backend: Any, quant: Any, idx: int, kernels: Any,
                 rotary: Any) -> None:
        super().__init__(spec, cfg, backend, quant, idx, kernels, rotary)
        moe: MoeSpec = spec.extra["moe"]
        self.moe = None
        if not moe.sparse_layers[idx]:
            return
        del self.gate_up_proj, self.down_proj  # never filled: the experts take their place
        prefix = f"model.layers.{idx}.mlp"
        shared = None
        if moe.shared_intermediate_size:
            # a dense MLP: quantized like the attention when the checkpoint's quant config covers it
            q = lambda name: quant.for_layer(f"{prefix}.{name}") if quant is not None else None  # noqa: E731
            inter = moe.shared_intermediate_size
            shared = SharedExpert(
                ColumnParallelLinear(spec.hidden_size, [inter, inter], False, cfg.dtype,
                                     q("shared_expert.gate_up_proj"), f"{prefix}.shared_expert.gate_up_proj", kernels),
                RowParallelLinear(inter, spec.hidden_size, False, cfg.dtype, q("shared_expert.down_proj"),
                                  f"{prefix}.shared_expert.down_proj", kernels),
                kernels)
        self.moe = SparseMoeBlock(spec.hidden_size, moe.num_experts, moe.intermediate_size, moe.router, cfg.dtype,
                                  router_bias=moe.router_bias, activation=moe.activation, expert_bias=moe.expert_bias,
                                  alpha=moe.alpha, limit=moe.limit, shared_expert=shared, shared_gate=moe.shared_gate,
                                  host=cfg.host, prefix=prefix,
                                  int8_experts=quant is not None and getattr(quant, "int8_experts", None) is not None
                                  and quant.int8_experts(prefix),
                                  experts_method=quant.moe_method(prefix) if hasattr(quant, "moe_method") else None)
        for param in self.moe.experts.parameters():
            param.is_optional = True  # filled through the experts' own loader, checked by FusedMoE.missing

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return super().mlp(x) if self.moe is None else self.moe(x)


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """A decoder with MoE layers; its subclass's ``spec_from_hf`` puts a :class:`MoeSpec` in
    ``DecoderSpec.extra["moe"]``."""

    layer_class = MoeDecoderLayer
    # LoRA acts on linear layers; the experts are not ones (start-up refuses it). A GPTQ, AWQ, compressed-tensors or
    # FP8 checkpoint's attention layers and shared expert run quantized; its group-quantized routed experts (act-order
    # too), FP8 ones and an MXFP4 checkpoint's stay packed (the quant config's moe_method), int8 ones with row scales
    # stay int8, the rest are dequantized at load (its dequantize)
    supports_lora = False
    # the router, the shared expert and its gate under the layer's ``moe`` block (".mlp." is dropped after)
    checkpoint_renames = {".block_sparse_moe.gate.": ".mlp.moe.router.", ".mlp.gate.": ".mlp.moe.router.",
                          ".mlp.router.": ".mlp.moe.router.", ".mlp.shared_expert.": ".mlp.moe.shared_expert.",
                          ".mlp.shared_expert_gate.": ".mlp.moe.shared_expert_gate."}

    def __init__(self, cfg: Any, backend: Any, quant: Any = None) -> None:
        if quant is not None and type(quant).__name__ not in _LOADERS:
            raise ConfigError(f"{type(self).__name__}: pagoda loads GPTQ, AWQ, compressed-tensors, FP8 and MXFP4 "
                              f"Mixture-of-Experts checkpoints, not {type(quant).__name__} (online int8 is not "
                              "applied to experts); use the unquantized checkpoint, or one in those formats")
        self.quant = quant
        if getattr(cfg, "batch_invariant", False):
            raise ConfigError(f"--batch-invariant covers dense models; {type(self).__name__} routes tokens to "
                              "experts, whose grouped matmuls depend on the batch: drop --batch-invariant")
        super().__init__(cfg, backend, quant)

    def experts_of(self, layer: int) -> FusedMoE:
        module = self.layers[layer]
        if getattr(module, "moe", None) is None:
            raise CheckpointError(f"the checkpoint has experts for layer {layer}, which config.json makes dense "
                                  "(mlp_only_layers / decoder_sparse_step); the checkpoint does not match its config")
        return module.moe.experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The experts' tensors go to their layer's :class:`FusedMoE`; every other tensor to the dense loader."""
        super().load_weights(self._experts_loaded(weights))
        missing = [m for layer in self._stage_layers if getattr(layer, "moe", None) is not None
                   for m in layer.moe.experts.missing()]
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} expert tensor(s) the model needs, "
                                  f"e.g. {missing[:3]}")

    def _experts_loaded(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        quantized: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}  # (layer, expert, part) -> tensors
        mxfp4: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, stacked name) -> blocks and scales
        for name, tensor in weights:
            match = _EXPERT_TENSOR.match(name)
            if match is None:
                self._check_shared_expert(name, tensor)
                yield name, tensor
                continue
            if self._on_another_stage(name):
                continue
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= len(self.layers):
                raise CheckpointError(f"checkpoint tensor {name!r} names layer {layer}, but config.json gives "
                                      f"{len(self.layers)} layers")
            experts = self.experts_of(layer)
            one = _ONE_EXPERT.match(rest)
            if one is not None and (one.group(3) in _QUANTIZED
                                    or (one.group(3) == "weight" and tensor.dtype in _QUANTIZED_DTYPES)):
                if self.quant is None:
                    raise CheckpointError(f"checkpoint tensor {name!r} is a quantized expert's, but config.json has no "
                                          "quantization_config saying how it is packed")
                key = (layer, int(one.group(1)), _PARTS[one.group(2)])
                quantized.setdefault(key, {"name": name[: -len(one.group(3)) - 1]})[one.group(3)] = tensor
            elif one is not None:
                part = _PARTS[one.group(2)] + ("_bias" if one.group(3) == "bias" else "")
                experts.load_expert(part, int(one.group(1)), tensor, name)
            elif mxfp4_pair(rest) is not None:
                stacked, kind = mxfp4_pair(rest)
                pair = mxfp4.setdefault((layer, stacked), {})
                pair[kind] = tensor
                if len(pair) == 2:
                    self._load_mxfp4(experts, stacked, pair.pop("blocks"), pair.pop("scales"), name[: -len(kind) - 1])
            else:
                self._load_stacked(experts, rest, tensor, name)
        unpaired = [f"model.layers.{layer}...experts.{stacked}_{next(iter(pair))}" for (layer, stacked), pair
                    in mxfp4.items() if pair]
        if unpaired:
            raise CheckpointError(f"MXFP4 tensors without their other half (blocks with scales): {unpaired[:3]}")
        for (layer, expert, part), tensors in quantized.items():
            name = tensors.pop("name")
            experts = self.experts_of(layer)
            if experts.quant_method is not None:  # group-quantized and FP8 experts stay packed
                experts.load_quantized(part, expert, tensors, name)
            elif experts.s13 is not None:  # int8 experts stay int8, with their row scales
                q, scale = self.quant.int8_expert(tensors, name)
                experts.load_expert(part, expert, q, name, scale=scale)
            elif hasattr(self.quant, "dequantize"):
                experts.load_expert(part, expert, self.quant.dequantize(tensors, name), name)
            else:
                raise CheckpointError(f"quantized expert {name!r}: {type(self.quant).__name__} leaves {experts.prefix} "
                                      "unquantized (its ignored layers), but the checkpoint stores it quantized; fix "
                                      "the quantization_config")

    def _check_shared_expert(self, name: str, tensor: torch.Tensor) -> None:
        """A shared expert stored unquantized in a checkpoint whose quant config covers it: say which tensor and
        how to mark the shared expert as left unquantized."""
        shared = _SHARED_EXPERT_WEIGHT.match(name)
        if (shared is None or self.quant is None or self._on_another_stage(name)
                or tensor.dtype in _QUANTIZED_DTYPES):  # compressed-tensors' int8 / FP8 weights keep the name
            return
        layer = int(shared.group(1))
        block = getattr(self.layers[layer], "moe", None) if layer < len(self.layers) else None
        shared_expert = None if block is None else block.shared_expert
        if shared_expert is None or isinstance(shared_expert.down_proj.quant_method, UnquantizedLinearMethod):
            return
        way_out = {"GPTQConfig": "a dynamic rule \"-:.*shared_expert.*\": {} in its quantization_config",
                   "CompressedTensorsConfig": "\"re:.*shared_expert.*\" in its quantization_config's ignore list"
                   }.get(type(self.quant).__name__, '"shared_expert" in its quantization_config\'s modules_to_not_convert')
        raise CheckpointError(f"checkpoint tensor {name!r} is an unquantized shared expert, but config.json's "
                              f"{type(self.quant).__name__} quantizes every linear layer of the decoder, the shared "
                              f"expert's too (as vLLM and transformers read it); quantize the shared expert, or "
                              f"mark it as left unquantized with {way_out}")

    def _load_mxfp4(self, experts: FusedMoE, stacked: str, blocks: torch.Tensor, scales: torch.Tensor,
                    name: str) -> None:
        """gpt-oss's MXFP4 experts: ``gate_up_proj`` ``[E, 2I, H / 32, 16]`` (gate and up rows interleaved) or
        ``down_proj`` ``[E, H, I / 32, 16]``, with their scales; each expert's projections go to the experts'
        quant method (the MXFP4 config's, which keeps them packed) as ``{"blocks", "scales"}``."""
        if stacked not in ("gate_up_proj", "down_proj"):
            raise CheckpointError(f"checkpoint tensor {name}_blocks is not an expert tensor pagoda knows")
        if getattr(experts.quant_method, "method", None) != "MXFP4":
            raise CheckpointError(f"checkpoint tensor {name}_blocks holds MXFP4 experts, but config.json's "
                                  "quantization_config does not say quant_method 'mxfp4'")
        if blocks.shape[0] != experts.num_experts or scales.shape[0] != experts.num_experts:
            raise CheckpointError(f"tensors {name}_blocks / _scales stack {blocks.shape[0]} / {scales.shape[0]} "
                                  f"experts; config.json gives {experts.num_experts}")
        rows = {"gate": slice(0, None, 2), "up": slice(1, None, 2)} if stacked == "gate_up_proj" else {
            "down": slice(None)}
        for e in range(experts.num_experts):
            for part, row in rows.items():
                experts.load_quantized(part, e, {"blocks": blocks[e, row], "scales": scales[e, row]}, name)

    @staticmethod
    def _load_stacked(experts: FusedMoE, rest: str, tensor: torch.Tensor, name: str) -> None:
        """All experts in one tensor, as gpt-oss writes them: ``gate_up_proj [E, H, 2I]`` with gate and up
        interleaved column by column, ``down_proj [E, I, H]``, and their biases."""
        if rest == "gate_up_proj":
            t = tensor.transpose(1, 2)  # [E, 2I, H]
            experts.load_stacked("gate", t[:, 0::2], name)
            experts.load_stacked("up", t[:, 1::2], name)
        elif rest == "gate_up_proj_bias":
            experts.load_stacked("gate_bias", tensor[:, 0::2], name)
            experts.load_stacked("up_bias", tensor[:, 1::2], name)
        elif rest == "down_proj":
            experts.load_stacked("down", tensor.transpose(1, 2), name)
        elif rest == "down_proj_bias":
            experts.load_stacked("down_bias", tensor, name)
        else:
            raise CheckpointError(f"checkpoint tensor {name!r} is not an expert tensor pagoda knows")


def mxfp4_pair(rest: str) -> Optional[tuple[str, str]]:
    """``gate_up_proj_blocks`` -> (``gate_up_proj``, ``blocks``): half of an MXFP4 expert tensor pair; None
    for any other tensor."""
    for kind in ("blocks", "scales"):
        if rest.endswith("_" + kind):
            return rest[: -len(kind) - 1], kind
    return None


def sparse_layers(cfg: dict[str, Any], num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-MoE's choice of MoE layers: every ``decoder_sparse_step``-th, except ``mlp_only_layers``."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def moe_count(cfg: dict[str, Any], *names: str) -> Optional[int]:
    """The first of ``names`` config.json sets (architectures and transformers versions spell it apart)."""
    for name in names:
        if cfg.get(name) is not None:
            return int(cfg[name])
    raise ConfigError(f"config.json has none of {', '.join(names)}, which {cfg.get('architectures', ['an MoE'])[0]} "
                      "needs")
