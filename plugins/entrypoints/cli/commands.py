"""``pagoda generate`` and ``pagoda plugins``."""

from __future__ import annotations

import argparse
import sys

from pagoda.cli import add_engine_args, engine_args_from


def register_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion (or a chat answer with --chat) for a prompt")
    p.add_argument("prompt", nargs="?", default="What is the capital of France?", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message and apply the chat template")
    p.add_argument("--reasoning-effort", default=None, choices=("none", "minimal", "low", "medium", "high", "xhigh"),
                   help="with --chat: the chat template's reasoning_effort (gpt-oss: low, medium, high) and "
                        "enable_thinking (false for none) variables")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    if ns.reasoning_effort is not None and not ns.chat:
        raise SystemExit("--reasoning-effort is read by the chat template: add --chat")
    args = engine_args_from(ns)
    llm = LLM(**args.model_dump(exclude_defaults=True), plugin_manager=ns.plugin_manager)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            stop=ns.stop)
    if ns.chat:
        effort = ns.reasoning_effort
        kwargs = None if effort is None else {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False, chat_template_kwargs=kwargs)[0]
        print(out.outputs[0].text.strip())
    else:
        out = llm.generate(ns.prompt, params, use_tqdm=False)[0]
        print(ns.prompt + out.outputs[0].text)
    return 0


def register_plugins(sub) -> None:
    p = sub.add_parser("plugins", help="list every component name, its kind and the distribution providing it")
    p.set_defaults(func=run_plugins)


def run_plugins(ns: argparse.Namespace) -> int:
    from pagoda import PLUGIN_API_VERSION, __version__

    pm = ns.plugin_manager
    print(f"pagoda {__version__}, plugin API {PLUGIN_API_VERSION}\n")
    rows = [(c.kind, c.name, c.plugin, c.dist, pm.api_ranges.get(c.plugin, "-")) for c in pm.table()]
    rows += [(builtin.kind, builtin.qualified_name, builtin.plugin, builtin.dist, f"OVERRIDDEN by {used.plugin!r}")
             for used, builtin in pm.override_list()]
    # a name several plugins provide: what its plain name selects is in the rows above (pagoda's own), the others
    # are listed by the qualified names that select them
    rows += [(c.kind, c.qualified_name, c.plugin, c.dist, "CONFLICT (see below)")
             for conflict in pm.conflict_list() for c in conflict.others]
    rows += [("(failed)", "-", f.name, f.dist, f.reason) for f in pm.failures]
    rows += [("(blocked)", "-", name, dist, "PAGODA_DISABLE_PLUGINS") for name, dist in sorted(pm.blocked.items())]
    header = ("KIND", "NAME", "PLUGIN", "DISTRIBUTION", "API")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    for used, builtin in pm.override_list():
        print(f"\noverride: the {used.kind} {used.name!r} is plugin {used.plugin!r} from {used.dist}, used instead "
              f"of {builtin.dist}'s (block {used.plugin} with PAGODA_DISABLE_PLUGINS to use the built-in)")
    for conflict in pm.conflict_list():
        print(f"\nconflict: {conflict.reason}")
    for name in pm.unmatched_blocks:
        print(f"\nPAGODA_DISABLE_PLUGINS names {name!r}, which is no installed plugin: it blocks plugins by the "
              "names in the PLUGIN column")
    for failure in pm.failures:
        print(f"\nplugin {failure.name!r} from {failure.dist} failed to load:\n{failure.error}", file=sys.stderr)
    return 0
