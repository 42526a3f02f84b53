"""The scheduler: one token-budget core (:class:`Scheduler`) and the hooks a policy plugin answers
(:class:`SchedulingPolicy`). A ``pagoda_schedulers`` component is a policy factory,
``factory(scheduler, **options)``; :func:`build_scheduler` resolves it and passes it its options."""

from __future__ import annotations

import inspect
from typing import Any, Optional

from pagoda.config import CacheConfig, LoRAConfig, SchedulerConfig
from pagoda.errors import ConfigError
from pagoda.scheduling.scheduler import HOOKS, PolicyFactory, Scheduler, SchedulingPolicy

__all__ = ["HOOKS", "PolicyFactory", "Scheduler", "SchedulingPolicy", "build_scheduler", "check_policy_options"]


def check_policy_options(name: str, factory: PolicyFactory, options: dict[str, Any]) -> None:
    """Refuse options the policy ``name`` does not take, naming the key and the options it does take."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return  # a callable without a signature to read: it checks its own options
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p.name for p in list(params.values())[1:]
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        takes = f"its options are {', '.join(accepted)}" if accepted else "it takes no options"
        raise ConfigError(f"the {name!r} scheduling policy has no option {unknown[0]!r} (in --scheduler-options / "
                          f"scheduler_options); {takes}")


def build_scheduler(plugin_manager: Any, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_manager,
                    lora_config: Optional[LoRAConfig] = None) -> Scheduler:
    """The scheduler with the policy ``scheduler_config.policy`` (a ``pagoda_schedulers`` component) built with
    ``scheduler_config.policy_options``; a wrong option is a ConfigError naming it."""
    name = scheduler_config.policy
    factory = plugin_manager.get("pagoda_schedulers", name, "scheduling_policy").factory
    options = dict(scheduler_config.policy_options)
    check_policy_options(name, factory, options)
    try:
        return Scheduler(scheduler_config, cache_config, kv_manager, factory, options,
                         max_loras=lora_config.max_loras if lora_config is not None else 0)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"the {name!r} scheduling policy refused its options {options}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"the {name!r} scheduling policy could not be built as factory(scheduler, **options) "
                          f"({exc}); a pagoda_schedulers component is a scheduling policy, "
                          "pagoda.scheduling.SchedulingPolicy (see docs/plugins.md)") from None
