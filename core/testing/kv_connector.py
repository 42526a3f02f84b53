"""KV connector checks: the store keeps what it is given, by key, whole, from many threads at once; and two real
engines hand each other prompt blocks through it with the tokens of an engine alone."""

from __future__ import annotations

import random
import threading
from typing import Any, Optional

from pagoda.interfaces import KVConnectorFactory
from pagoda.testing.contract import Where

_PROMPT_TOKENS = 70  # four full blocks of 16 and a tail: four blocks to save and load


def check_kv_connector(factory: KVConnectorFactory, options: Optional[dict[str, Any]] = None, *,
                       shared: bool = True, engines: bool = True, model: Optional[str] = None) -> None:
    """Check a ``pagoda_kv_connectors`` factory built with ``options`` (``--kv-connector-options``).

    The store: ``lookup`` counts the keys held from the first only, ``load`` gives back exactly the bytes
    saved (None for a key never saved), a value saved again under its key replaces it whole, and eight threads
    saving and loading at once each get their own values. With ``shared`` (a store several engines share), a
    second connector built with the same options sees the first one's values. With ``engines``, real engines
    on ``model`` (default: pagoda's default model, float32) run prompts through it: the first saves their
    blocks, the second (or, without ``shared``, the same engine with prefix caching off) must load every full
    prompt block from the store and give exactly the greedy tokens of an engine without a connector.
    Raises :class:`pagoda.testing.ContractError`."""
    name = getattr(factory, "__name__", repr(factory))
    options = dict(options or {})
    config = _engine_config(model)
    where = Where(name, "store", f"options {options}", step_name="operation")
    connector = _build(factory, config, options, where)
    try:
        _check_store(connector, where)
        _check_threads(connector, where)
        if shared:
            other = _build(factory, config, options, where)
            try:
                _check_shared(connector, other, where)
            finally:
                other.close()
    finally:
        connector.close()
    if engines:
        _check_engines(factory, options, shared, model, Where(name, "engines", f"options {options}"))


def _engine_config(model: Optional[str]) -> Any:
    from pagoda.engine.engine_args import EngineArgs
    from pagoda.modeling.default_model import ensure_default_model

    return EngineArgs.build(model=model or str(ensure_default_model()), dtype="float32").create_engine_config()


def _build(factory: KVConnectorFactory, config: Any, options: dict[str, Any], where: Where) -> Any:
    try:
        return factory(config, **options)
    except Exception as exc:  # noqa: BLE001
        raise where.at("factory").fail("factory(engine_config, **options)", f"it raised {type(exc).__name__}: {exc}",
                                       "the factory builds a connector from valid options",
                                       "the factory") from exc


def _key(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}"


def _value(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def _expect(where: Where, step: str, operation: str, got: Any, want: Any, rule: str, suspect: str) -> None:
    if got != want:
        shown = (lambda v: f"{len(v)} bytes" if isinstance(v, (bytes, bytearray, memoryview)) else repr(v))
        raise where.at(step).fail(operation, f"it returned {shown(got)}, expected {shown(want)}", rule, suspect)


def _check_store(connector: Any, where: Where) -> None:
    rng = random.Random(0)
    keys = [_key(rng) for _ in range(4)]
    values = [_value(rng, size) for size in (1, 4096, 737_280 + 97, 33)]
    lookup_rule = "lookup(keys) counts the keys the store holds from the first, stopping at the first it lacks"
    _expect(where, "empty lookup", "lookup([])", connector.lookup([]), 0, lookup_rule, "lookup()")
    _expect(where, "unknown keys", "lookup(4 keys never saved)", connector.lookup(keys), 0, lookup_rule, "lookup()")
    _expect(where, "unknown key", "load(a key never saved)", connector.load(keys[0]), None,
            "load() of a key never saved is None", "load()")
    for key, value in zip(keys[:3], values[:3]):
        connector.save(key, value)
    _expect(where, "lookup", "lookup(3 saved keys, then one not)", connector.lookup(keys), 3, lookup_rule,
            "lookup()")
    _expect(where, "lookup order", "lookup(a key not saved, then 3 saved)", connector.lookup(keys[3:] + keys[:3]),
            0, lookup_rule, "lookup()")
    for i, (key, value) in enumerate(zip(keys[:3], values[:3])):
        got = connector.load(key)
        _expect(where, f"load {i}", f"load() of a {len(value)}-byte value", None if got is None else bytes(got),
                value, "load() gives back exactly the bytes saved under the key", "load() or save()")
    replacement = _value(rng, 2048)
    connector.save(keys[1], replacement)
    got = connector.load(keys[1])
    _expect(where, "save again", "load() after a second save() under the key", None if got is None else bytes(got),
            replacement, "a value saved again under its key replaces the old one whole", "save()")


def _check_threads(connector: Any, where: Where) -> None:
    problems: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(100 + seed)
        try:
            for _ in range(6):
                key, value = _key(rng), _value(rng, rng.randrange(1, 200_000))
                connector.save(key, value)
                got = connector.load(key)
                if got is None or bytes(got) != value:
                    problems.append(f"thread {seed} saved {len(value)} bytes under {key} and loaded "
                                    f"{'None' if got is None else f'{len(got)} other bytes'}")
                    return
        except Exception as exc:  # noqa: BLE001
            problems.append(f"thread {seed}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if problems:
        raise where.at("threads").fail("save() and load() from 8 threads at once", problems[0],
                                       "pagoda calls load() and save() from several threads at once; each gets its "
                                       "own values", "save() or load() (shared state without a lock?)")


def _check_shared(first: Any, second: Any, where: Where) -> None:
    rng = random.Random(7)
    key, value = _key(rng), _value(rng, 5000)
    first.save(key, value)
    _expect(where, "shared lookup", "lookup() on a second connector of the same options", second.lookup([key]), 1,
            "a store several engines share shows each one's saves to the others", "lookup() or save()")
    got = second.load(key)
    _expect(where, "shared load", "load() on a second connector of the same options",
            None if got is None else bytes(got), value,
            "a store several engines share shows each one's saves to the others", "load() or save()")


def _check_engines(factory: KVConnectorFactory, options: dict[str, Any], shared: bool, model: Optional[str],
                   where: Where) -> None:
    from pagoda.engine.llm import LLM
    from pagoda import hookimpl
    from pagoda.modeling.default_model import ensure_default_model
    from pagoda.registry.plugin_manager import PluginManager
    from pagoda.sampling_params import SamplingParams

    class Kit:
        @hookimpl
        def pagoda_kv_connectors(self):
            return {"conformance-checked": factory}

    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(_PROMPT_TOKENS)]} for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine_options = dict(model=model or str(ensure_default_model()), dtype="float32", max_model_len=256,
                          num_gpu_blocks_override=48, cpu_threads=1)

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = tokens(LLM(**engine_options))
    pm = PluginManager().load()
    pm.register(Kit(), name="conformance-kit")
    with_connector = dict(engine_options, plugin_manager=pm, kv_connector="conformance-checked",
                          kv_connector_options=options)
    if not shared:
        with_connector["enable_prefix_caching"] = False  # the second run must ask the store, not the cache
    saver = LLM(**with_connector)
    first = tokens(saver)
    saver.engine.kv_transfers.flush()
    loader = LLM(**with_connector) if shared else saver
    second = tokens(loader)
    stats = loader.engine.kv_transfers.stats
    wanted = len(prompts) * ((_PROMPT_TOKENS - 1) // 16)
    if stats.blocks_loaded != wanted:
        raise where.at("second engine").fail(
            "generate() of prompts another engine saved", f"{stats.blocks_loaded} blocks were loaded of the {wanted} "
            f"saved ({stats})", "every block saved is found by lookup() and loaded whole",
            "lookup(), load() or save()")
    for run, got in (("the saving engine", first), ("the loading engine", second)):
        if got != plain:
            raise where.at(run).fail("generate()", f"tokens {got} differ from an engine without a connector's {plain}",
                                     "blocks loaded through the connector hold the K/V computed for them",
                                     "load() or save() (bytes changed in the store)")
    for llm in {id(saver): saver, id(loader): loader}.values():
        llm.engine.shutdown()
