"""How a decoder's forward pass calls its layers' modules: through ``nn.Module.__call__`` only when a forward hook
wants it.

``nn.Module.__call__`` checks eight hook registries before it calls ``forward``: about 0.5 us a call on a Zen 5
core, eight calls a decoder layer, some 0.1 ms of a 30-layer decode step. When no forward hook is set on any of
the model's layer modules nor globally (the usual case), a step calls the layers' and their modules'
``forward`` methods directly; as soon as one is set (``pagoda bench --profile`` times the linear and attention
layers with hooks), every call goes through the modules again, so hooks run exactly as in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from torch import nn
from torch.nn.modules import module as torch_module


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
