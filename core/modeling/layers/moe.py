"""Mixture-of-Experts layers: top-k routing, and the routed experts computed as grouped GEMMs.

A token's hidden state goes to ``top_k`` of ``num_experts`` gated MLPs (its *experts*), chosen by a router
(a linear layer to one logit per expert), and their outputs are summed with the router's weights. The
experts run grouped: the (token, slot) pairs are sorted by expert and each active expert multiplies only the
tokens routed to it, one GEMM per active expert, never a loop over tokens and never all experts on all tokens.

On a CPU the whole of it runs in one C++ call per layer (``moe_ops.cpp``): every active expert reads each chunk
of its weights once and uses it for all the tokens routed to it, gate and up rows side by side (bf16 dot
products for bf16 experts on bf16 activations on CPUs with bf16 math; elsewhere the weights widened from
bf16/int8 to fp32 in registers, 8 lanes on AVX2, 16 on AVX-512), then the down projection by output columns over
all active experts with the weighted sum taken in place, in one parallel region. The routing is one call of the
same kernel (``moe_route``), :func:`select_experts` its reference. Elsewhere, or where the kernel cannot be
built, the same grouped computation runs in torch.

Tensor parallelism splits every expert's intermediate dimension over the ranks (each rank holds a slice of
every expert, so the work is even whatever the routing); one all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.errors import CheckpointError, ConfigError
from pagoda.execution import distributed
from pagoda.host import cpu_isa
from pagoda.host.cpp_extension import load_cpu_extension_or_none
from pagoda.host.env import HostConfig, resolve_host_config

_SOURCE = Path(__file__).with_name("moe_ops.cpp")

ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}
SCORINGS = {"softmax": 0, "sigmoid": 1}


def moe_ops(host: Optional[HostConfig] = None) -> Optional[Any]:
    """The compiled MoE kernel for ``host`` (an engine's settings; None: the environment's), or None when its
    ``fused_cpu_ops`` setting is off or the kernel cannot be built."""
    host = host if host is not None else resolve_host_config()
    if not host.fused_cpu_ops:
        return None
    return load_cpu_extension_or_none("pagoda_moe_ops", _SOURCE, fallback="torch grouped GEMMs", host=host)


@dataclass(frozen=True)
class RouterSpec:
    """How a router's logits choose a token's experts and weigh them.

    ``scoring``: ``softmax`` over all experts (Mixtral, Qwen-MoE) or ``sigmoid`` per expert (DeepSeek-V3
    style, where ``selection_bias`` shifts which experts are chosen, not their weights). ``renormalize``: the
    chosen weights divided by their sum. ``softmax_over_top_k``: gpt-oss's order, top-k of the raw logits and
    a softmax over those k only.
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    softmax_over_top_k: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"MoE router scoring {self.scoring!r} is not one pagoda implements (softmax, sigmoid)")
        if self.top_k < 1:
            raise ConfigError(f"an MoE layer needs at least one expert per token, not {self.top_k}")


def select_experts(logits: torch.Tensor, spec: RouterSpec,
                   selection_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (weights ``[T, k]`` float32, expert ids ``[T, k]`` int64)."""
    if spec.softmax_over_top_k:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    if spec.scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    else:
        scores = torch.sigmoid(logits.float())
        choice = scores if selection_bias is None else scores + selection_bias.float()
        ids = torch.topk(choice, spec.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, activation: str = "silu", b13: Optional[torch.Tensor] = None,
                    b2: Optional[torch.Tensor] = None, alpha: float = 1.702, limit: float = 7.0,
                    s13: Optional[torch.Tensor] = None, s2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The routed experts in torch, grouped: ``x [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``, ``weights``/``ids [T, k]``; int8 weights with their row scales ``s13 [E, 2I]``,
    ``s2 [E, H]``. fp32 math, the result in ``x``'s dtype."""
    num_tokens, top_k = ids.shape
    inter = w13.shape[1] // 2
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x.index_select(0, order // top_k).float()  # [T * k, H]
    ys = torch.empty(num_tokens * top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w_13, w_2 = w13[e].float(), w2[e].float()
        if s13 is not None:
            w_13, w_2 = w_13 * s13[e][:, None], w_2 * s2[e][:, None]
        gate_up = xs[start:start + n] @ w_13.t()  # [n, 2I]
        if b13 is not None:
            gate_up = gate_up + b13[e].float()
        h = _activate(gate_up[:, :inter], gate_up[:, inter:], activation, alpha, limit)
        y = h @ w_2.t()
        ys[start:start + n] = y if b2 is None else y + b2[e].float()
        start += n
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(num_tokens, top_k, -1) * weights.float()[..., None]).sum(dim=1).to(x.dtype)


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows),
    ``w2 [E, H, I]``, and with ``has_bias`` float32 biases ``b13 [E, 2I]``, ``b2 [E, H]``. Under tensor
    parallelism ``I`` is this rank's slice of the intermediate dimension and ``forward`` sums the ranks.

    ``activation``: ``silu`` (``silu(gate) * up``) or ``clamped_swiglu`` (gpt-oss: ``alpha``, ``limit``).
    ``host``: the engine's host settings, which choose the CPU kernel (None: torch only).
    ``int8``: the weights are held as int8 with one float32 scale per output row, ``s13 [E, 2I]`` and
    ``s2 [E, H]`` (a checkpoint's int8 experts, loaded through :meth:`load_expert` with their scales).
    ``quant_method``: a quant config's experts method (its ``moe_method``), which holds the weights in its own
    packed layout in place of ``w13``/``w2`` (``create_weights``), loads each expert's checkpoint tensors
    (``load_expert``, through :meth:`load_quantized`) and computes the routed experts (``apply``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype, *,
                 activation: str = "silu", has_bias: bool = False, alpha: float = 1.702, limit: float = 7.0,
                 host: Optional[HostConfig] = None, prefix: str = "", int8: bool = False,
                 quant_method: Optional[Any] = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ConfigError(f"MoE activation {activation!r} is not one pagoda implements ({', '.join(ACTIVATIONS)})")
        self.tp = tp = distributed.current()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.full_intermediate_size = intermediate_size
        self.inter_start, self.intermediate_size = distributed.split(intermediate_size, tp.size, tp.rank)
        self.activation, self.alpha, self.limit, self.prefix = activation, float(alpha), float(limit), prefix
        inter = self.intermediate_size
        weight_dtype = torch.int8 if int8 else dtype
        self.quant_method = quant_method
        self.w13 = self.w2 = None
        if quant_method is None:
            self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=weight_dtype),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=weight_dtype),
                                   requires_grad=False)
        self.s13 = self.s2 = None
        if int8:
            self.s13 = nn.Parameter(torch.ones(num_experts, 2 * inter), requires_grad=False)
            self.s2 = nn.Parameter(torch.ones(num_experts, hidden_size), requires_grad=False)
        self.b13 = self.b2 = None
        if has_bias:
            self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * inter), requires_grad=False)
            # the down projection's bias is added once, on the first rank, before the ranks' outputs are summed
            self.b2 = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
        self._loaded: set[tuple[str, int]] = set()
        if quant_method is not None:
            quant_method.create_weights(self, dtype)
        self.ops = moe_ops(host) if host is not None else None
        # bf16 experts on bf16 activations take bf16 dot products where the CPU has bf16 math
        self.bf16_dot = host is not None and cpu_isa.cpu_isa(host.cpu_isa) == "avx512_bf16" \
            and weight_dtype == torch.bfloat16

    # ---- loading ----------------------------------------------------------------------------------------

    def load_expert(self, part: str, expert: int, loaded: torch.Tensor, name: str,
                    scale: Optional[torch.Tensor] = None) -> None:
        """One expert's checkpoint tensor: ``part`` is ``gate``/``up`` (``[I, H]``), ``down`` (``[H, I]``),
        ``gate_bias``/``up_bias`` (``[I]``) or ``down_bias`` (``[H]``), all of the full (unsplit) size. Int8
        experts take int8 weights with ``scale``, one per output row."""
        is_weight = part in ("gate", "up", "down")
        if is_weight and self.quant_method is not None:
            raise CheckpointError(f"checkpoint tensor {name!r}: {self.prefix} holds quantized experts, but the tensor "
                                  f"is {loaded.dtype}; every routed expert of a layer must be quantized alike")
        if is_weight and (self.s13 is not None) != (scale is not None and loaded.dtype == torch.int8):
            raise CheckpointError(f"checkpoint tensor {name!r}: {self.prefix} holds "
                                  f"{'int8' if self.s13 is not None else str(self.w13.dtype)} experts, but the tensor "
                                  f"is {loaded.dtype}{' with' if scale is not None else ' without'} row scales; every "
                                  "routed expert of a layer must be quantized alike")
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(f"checkpoint tensor {name!r} names expert {expert}, but config.json gives "
                                  f"{self.num_experts} experts")
        inter, start = self.intermediate_size, self.inter_start
        full = self.full_intermediate_size
        expected = {"gate": (full, self.hidden_size), "up": (full, self.hidden_size),
                    "down": (self.hidden_size, full), "gate_bias": (full,), "up_bias": (full,),
                    "down_bias": (self.hidden_size,)}[part]
        if tuple(loaded.shape) != expected:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(loaded.shape)} but the model expects {expected} "
                                  f"for {self.prefix}; the checkpoint does not match its config.json")
        if part.endswith("_bias") and self.b13 is None:
            raise CheckpointError(f"checkpoint tensor {name!r} is an expert bias, which {self.prefix} was not "
                                  "configured with")
        if scale is not None and tuple(scale.shape) != (expected[0],):
            raise CheckpointError(f"checkpoint tensor {name!r}: {tuple(scale.shape)} scales for {expected[0]} rows")
        if part in ("gate", "up"):
            rows = loaded.narrow(0, start, inter)
            self.w13.data[expert].narrow(0, 0 if part == "gate" else inter, inter).copy_(rows)
            if scale is not None:
                self.s13.data[expert].narrow(0, 0 if part == "gate" else inter, inter).copy_(scale.narrow(0, start, inter))
        elif part == "down":
            self.w2.data[expert].copy_(loaded.narrow(1, start, inter))
            if scale is not None:
                self.s2.data[expert].copy_(scale)
        elif part in ("gate_bias", "up_bias"):
            self.b13.data[expert].narrow(0, 0 if part == "gate_bias" else inter, inter).copy_(
                loaded.narrow(0, start, inter))
        else:
            self.b2.data[expert].copy_(loaded if self.tp.rank == 0 else torch.zeros_like(loaded))
        self._loaded.add((part, expert))

    def load_quantized(self, part: str, expert: int, tensors: dict[str, torch.Tensor], name: str) -> None:
        """One expert's ``gate``/``up``/``down`` projection as its checkpoint's quantized tensors (``qweight``,
        ``scales``, ... by suffix; ``name`` the projection's), for experts held by a quant method."""
        if self.quant_method is None:
            raise CheckpointError(f"quantized expert {name!r}: {self.prefix} holds unpacked experts")
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(f"checkpoint tensor {name!r} names expert {expert}, but config.json gives "
                                  f"{self.num_experts} experts")
        self.quant_method.load_expert(self, part, expert, tensors, name)
        self._loaded.add((part, expert))

    def load_stacked(self, part: str, loaded: torch.Tensor, name: str) -> None:
        """All experts' tensor of one ``part`` at once, ``[E, ...]`` in :meth:`load_expert`'s shapes."""
        if loaded.shape[0] != self.num_experts:
            raise CheckpointError(f"tensor {name!r} stacks {loaded.shape[0]} experts; config.json gives "
                                  f"{self.num_experts}")
        for e in range(self.num_experts):
            self.load_expert(part, e, loaded[e], name)

    def missing(self) -> list[str]:
        """The checkpoint parts no tensor filled, as ``prefix.part[expert]`` (empty when complete)."""
        parts = ["gate", "up", "down"] + (["gate_bias", "up_bias", "down_bias"] if self.b13 is not None else [])
        return [f"{self.prefix}.{p}[{e}]" for p in parts for e in range(self.num_experts)
                if (p, e) not in self._loaded]

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights on this rank (what a token reads per chosen expert)."""
        if self.quant_method is not None:
            return self.quant_method.expert_bytes(self)
        scales = 0 if self.s13 is None else (self.s13[0].numel() + self.s2[0].numel()) * 4
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size() + scales

    # ---- compute ----------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``weights``/``ids [T, k]`` from :func:`select_experts` -> ``[T, H]`` in ``x``'s dtype."""
        if self.quant_method is not None:
            out = self.quant_method.apply(self, x, weights, ids)
        elif self.ops is not None and x.device.type == "cpu":
            out = self.ops.moe_experts(x.contiguous(), self.w13, self.w2, self.s13, self.s2, self.b13, self.b2,
                                       ids.contiguous(), weights.float().contiguous(),
                                       ACTIVATIONS[self.activation], self.alpha, self.limit, 0, self.bf16_dot)
        else:
            out = grouped_experts(x, self.w13, self.w2, weights, ids, self.activation, self.b13, self.b2,
                                  self.alpha, self.limit, self.s13, self.s2)
        return self.tp.all_reduce(out, "moe")

    def isa_path(self) -> str:
        """The path the experts take here, for benchmarks and logs."""
        if self.quant_method is not None:
            return self.quant_method.isa_path(self)
        if self.ops is None:
            return "torch grouped GEMMs"
        path = self.ops.moe_path()
        if self.bf16_dot and path == "avx512_bf16":
            return f"{path} grouped tiles, bf16 dot products on bf16 activations"
        return f"{path} grouped tiles, weights widened to fp32"


class SharedExpert(nn.Module):
    """A dense gated MLP (``gate_up_proj``, ``down_proj``: the architecture's parallel linear layers) that
    every token goes through beside its routed experts (Qwen2-MoE)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, kernels: Any = None) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.kernels = gate_up_proj, down_proj, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            h = self.kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.down_proj(h)


class SparseMoeBlock(nn.Module):
    """A router, its routed experts and optionally a shared expert, in place of a decoder layer's MLP.

    ``router_bias``: the router's linear layer has a bias (gpt-oss). ``shared_expert``: a
    :class:`SharedExpert` every token also goes through, scaled by ``sigmoid(shared_expert_gate(x))`` when
    ``shared_gate`` (Qwen2-MoE). ``experts_method``: see :class:`FusedMoE`'s ``quant_method``.
    """

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, router: RouterSpec,
                 dtype: torch.dtype, *, router_bias: bool = False, activation: str = "silu",
                 expert_bias: bool = False, alpha: float = 1.702, limit: float = 7.0,
                 shared_expert: Optional[SharedExpert] = None, shared_gate: bool = False,
                 host: Optional[HostConfig] = None, prefix: str = "", int8_experts: bool = False,
                 experts_method: Optional[Any] = None) -> None:
        super().__init__()
        if router.top_k > num_experts:
            raise ConfigError(f"config.json routes each token to {router.top_k} experts of {num_experts}; "
                              "num_experts_per_tok must be at most the number of experts")
        self.router_spec = router
        self.router = nn.Linear(hidden_size, num_experts, bias=router_bias, dtype=dtype)
        self.router.requires_grad_(False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, dtype, activation=activation,
                                has_bias=expert_bias, alpha=alpha, limit=limit, host=host, prefix=f"{prefix}.experts",
                                int8=int8_experts, quant_method=experts_method)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None and shared_gate:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype)
            self.shared_expert_gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``."""
        logits = F.linear(x, self.router.weight, self.router.bias)  # [T, E]
        ops, spec = self.experts.ops, self.router_spec
        if ops is not None and logits.device.type == "cpu":  # one call in place of softmax, top-k and the sums
            weights, ids = ops.moe_route(logits.contiguous(), spec.top_k, SCORINGS[spec.scoring], spec.renormalize,
                                         spec.softmax_over_top_k)
        else:
            weights, ids = select_experts(logits, spec)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        return out
