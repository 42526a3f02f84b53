"""KV connectors with real engines on a tiny model: a prompt prefilled by one engine is loaded by another with the
greedy tokens of one engine alone; corrupt, truncated and cut-off blocks are recomputed; a request waiting for its
blocks holds up no one; the built-in connectors pass the kit, which fails broken ones."""

from __future__ import annotations

import random
import threading
import zlib
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.errors import ConfigError
from pagoda.kv.blocks import hash_block
from pagoda.kv.connector import block_key
from pagoda.plugins.kv_connectors.shared_disk import SharedDiskConnector
from pagoda.plugins.kv_connectors.tcp import BlockServer, TCPConnector
from pagoda.registry.plugin_manager import PluginManager
from pagoda.testing import ContractError, check_kv_connector
from tiny_models import write_tiny_llama

rng = random.Random(11)
# three 70-token prompts: four full blocks of 16 each to save and load, and a tail computed
PROMPTS = [[rng.randrange(1000, 30000) for _ in range(70)] for _ in range(3)]
OTHER = [rng.randrange(1000, 30000) for _ in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCKS_PER_PROMPT = (70 - 1) // 16
OPTIONS = dict(dtype="float32", max_model_len=256, cpu_threads=1, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    """The greedy tokens of one engine alone, without a connector."""
    return generate(LLM(model=tiny_model, **OPTIONS))


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def disk_engine(model: str, folder: Path, **options) -> LLM:
    return LLM(model=model, kv_connector="shared-disk", kv_connector_options={"path": str(folder)},
               **{**OPTIONS, **options})


def test_a_prompt_prefilled_by_one_engine_is_loaded_by_another_with_the_tokens_of_one_engine(
        tiny_model, reference, tmp_path):
    a = disk_engine(tiny_model, tmp_path)
    assert generate(a) == reference
    a.engine.kv_transfers.flush()
    assert a.engine.kv_transfers.stats.blocks_saved == 3 * (70 // 16)  # every full prompt block
    assert len(list(tmp_path.glob("*.kvc"))) == 3 * (70 // 16)

    b = disk_engine(tiny_model, tmp_path)
    outs = b.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = b.engine.kv_transfers.stats
    assert stats.blocks_loaded == 3 * BLOCKS_PER_PROMPT and stats.blocks_failed == 0
    # the loaded tokens were not computed: they count as cached, as a prefix-cache hit would
    assert [o.num_cached_tokens for o in outs] == [BLOCKS_PER_PROMPT * 16] * 3
    assert b.engine.kv_manager.stats.hits == 0  # none of it came from B's own prefix cache


def test_a_block_whose_check_passes_but_whose_bytes_differ_would_change_the_tokens(tiny_model, reference, tmp_path):
    """The control that shows the loaded K/V is what the second engine attends to: zeroed payloads, framed with a
    valid crc32, give other tokens."""
    a = disk_engine(tiny_model, tmp_path)
    generate(a)
    a.engine.kv_transfers.flush()
    for path in tmp_path.glob("*.kvc"):
        data = bytearray(path.read_bytes())
        data[177:-4] = bytes(len(data) - 181)  # the payload after the 49-byte header and 16 tokens
        data[-4:] = zlib.crc32(data[:-4]).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    b = disk_engine(tiny_model, tmp_path)
    assert generate(b) != reference
    assert b.engine.kv_transfers.stats.blocks_loaded == 3 * BLOCKS_PER_PROMPT


def test_corrupt_and_truncated_blocks_are_recomputed_with_identical_tokens_and_saved_again(
        tiny_model, reference, tmp_path):
    a = disk_engine(tiny_model, tmp_path)
    generate(a)
    a.engine.kv_transfers.flush()
    identity = a.engine.kv_transfers.identity
    files = [tmp_path / f"{key}.kvc" for key in block_keys(identity, PROMPTS[0])]
    flipped = bytearray(files[1].read_bytes())
    flipped[500] ^= 0x40  # one bit of the first prompt's second block
    files[1].write_bytes(bytes(flipped))
    files[3].write_bytes(files[3].read_bytes()[:1000])  # its fourth block cut short

    b = disk_engine(tiny_model, tmp_path)
    assert generate(b) == reference
    stats = b.engine.kv_transfers.stats
    # the first prompt loads its first block only: the second failed, so it and everything after it is computed
    assert stats.blocks_failed == 2 and stats.blocks_loaded == 1 + 2 * BLOCKS_PER_PROMPT
    b.engine.kv_transfers.flush()
    c = disk_engine(tiny_model, tmp_path)  # b computed the two blocks again and saved them whole
    assert generate(c) == reference
    assert c.engine.kv_transfers.stats.blocks_loaded == 3 * BLOCKS_PER_PROMPT


def block_keys(identity: bytes, prompt: list[int]) -> list[str]:
    """The connector keys of a prompt's full blocks: its chain hashes, as the prefix cache computes them."""
    keys, parent = [], None
    for i in range(len(prompt) // 16):
        parent = hash_block(parent, prompt[i * 16:(i + 1) * 16], ())
        keys.append(block_key(identity, parent))
    return keys


class SlowDisk(SharedDiskConnector):
    """A shared folder whose loads wait until ``release`` is set."""

    release = threading.Event()

    def load(self, key):
        assert self.release.wait(30)
        return super().load(key)


def test_a_request_waiting_for_its_blocks_holds_up_no_other_request(tiny_model, reference, tmp_path):
    a = disk_engine(tiny_model, tmp_path)
    generate(a)
    a.engine.kv_transfers.flush()
    other_alone = generate(LLM(model=tiny_model, **OPTIONS), [OTHER])[0]

    class Slow:
        @hookimpl
        def pagoda_kv_connectors(self):
            return {"slow-disk": SlowDisk.from_config}

    pm = PluginManager().load()
    pm.register(Slow(), name="slow")
    b = LLM(model=tiny_model, plugin_manager=pm, kv_connector="slow-disk",
            kv_connector_options={"path": str(tmp_path)}, **OPTIONS)
    engine = b.engine
    SlowDisk.release.clear()
    engine.add_request("stored", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.add_request("other", {"prompt_token_ids": OTHER}, GREEDY)
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if "other" in finished:
            break
    # the other request ran to its end while the stored one waited for its reads, with no token yet
    assert finished == {"other": other_alone}
    assert engine.scheduler.requests["stored"].num_output_tokens == 0
    SlowDisk.release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished["stored"] == reference[0]
    assert engine.kv_transfers.stats.blocks_loaded == BLOCKS_PER_PROMPT


def test_tcp_engines_hand_blocks_over_and_a_transfer_cut_in_half_is_recomputed(tiny_model, reference):
    a = LLM(model=tiny_model, kv_connector="tcp", kv_connector_options={"serve": True, "port": 0}, **OPTIONS)
    assert generate(a) == reference
    a.engine.kv_transfers.flush()
    connector = a.engine.kv_transfers.connector
    store = connector.server.store
    # cut the value of the second prompt's first block in half, as a transfer broken off would leave it
    key = block_keys(a.engine.kv_transfers.identity, PROMPTS[1])[0]
    value = store.get(key)
    store.put(key, value[:len(value) // 2])

    b = LLM(model=tiny_model, kv_connector="tcp", kv_connector_options={"port": connector.address[1]}, **OPTIONS)
    assert generate(b) == reference
    stats = b.engine.kv_transfers.stats
    assert stats.blocks_failed == 1 and stats.blocks_loaded == 2 * BLOCKS_PER_PROMPT
    b.engine.shutdown()
    a.engine.shutdown()


def test_a_store_that_is_down_costs_a_recompute_not_a_request(tiny_model, reference):
    server = BlockServer("127.0.0.1", 0, 1 << 20)
    port = server.server_address[1]
    server.server_close()  # nothing listens there any more
    b = LLM(model=tiny_model, kv_connector="tcp", kv_connector_options={"port": port, "timeout": 1}, **OPTIONS)
    assert generate(b) == reference
    assert b.engine.kv_transfers.stats.save_errors == 3 * (70 // 16)


def test_the_built_in_connectors_meet_the_contract(tiny_model, tmp_path):
    check_kv_connector(SharedDiskConnector.from_config, {"path": str(tmp_path)}, model=tiny_model)
    server = BlockServer("127.0.0.1", 0, 1 << 30).start()
    try:
        check_kv_connector(TCPConnector.from_config, {"port": server.server_address[1]}, engines=False)
    finally:
        server.stop()


class DropsLastByte(SharedDiskConnector):
    def save(self, key, value):
        super().save(key, value[:-1])


class CountsEveryKey(SharedDiskConnector):
    def lookup(self, keys):
        return sum(1 for k in keys if self._file(k).exists())


class Forgetful:
    """Keeps values in its own dict: two connectors never see each other's saves."""

    def __init__(self):
        self.values = {}

    def lookup(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.values:
            n += 1
        return n

    def load(self, key):
        return self.values.get(key)

    def save(self, key, value):
        self.values[key] = bytes(value)

    def close(self):
        pass


@pytest.mark.parametrize("connector, match", [
    (DropsLastByte, "gives back exactly the bytes saved"),
    (CountsEveryKey, "stopping at the first it lacks"),
])
def test_the_kit_fails_a_store_that_breaks_a_rule(connector, match, tmp_path):
    with pytest.raises(ContractError, match=match):
        check_kv_connector(connector.from_config, {"path": str(tmp_path)}, engines=False)


def test_the_kit_fails_a_store_that_is_not_shared_and_passes_it_when_it_says_so(tiny_model):
    with pytest.raises(ContractError, match="shows each one's saves to the others"):
        check_kv_connector(lambda config: Forgetful(), engines=False)
    check_kv_connector(lambda config: Forgetful(), shared=False, model=tiny_model)


def test_wrong_connector_settings_are_refused_with_what_to_change(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="unknown KV connector 'nfs'.*'shared-disk'"):
        LLM(model=tiny_model, kv_connector="nfs", **OPTIONS)
    with pytest.raises(ConfigError, match='needs a folder'):
        LLM(model=tiny_model, kv_connector="shared-disk", **OPTIONS)
    with pytest.raises(ConfigError, match="not an existing directory"):
        LLM(model=tiny_model, kv_connector="shared-disk", kv_connector_options={"path": str(tmp_path / "no")},
            **OPTIONS)
    with pytest.raises(ConfigError, match="need --kv-connector NAME"):
        LLM(model=tiny_model, kv_role="decode", **OPTIONS)
    with pytest.raises(ConfigError, match="tensor or pipeline parallelism"):
        LLM(model=tiny_model, kv_connector="shared-disk", kv_connector_options={"path": str(tmp_path)},
            tensor_parallel_size=2, **OPTIONS)


def test_a_prefill_instance_only_saves_and_a_decode_instance_only_loads(tiny_model, reference, tmp_path):
    prefill = disk_engine(tiny_model, tmp_path, kv_role="prefill")
    assert generate(prefill) == reference
    # no flush: a prefill instance's step ends once its blocks are written
    assert prefill.engine.kv_transfers.stats.blocks_saved == 3 * (70 // 16)
    assert prefill.engine.kv_transfers.stats.lookups == 0
    decode = disk_engine(tiny_model, tmp_path, kv_role="decode")
    assert generate(decode) == reference
    stats = decode.engine.kv_transfers.stats
    assert stats.blocks_loaded == 3 * BLOCKS_PER_PROMPT and stats.blocks_saved == 0


def test_the_connector_example_of_the_docs_meets_the_contract(tiny_model):
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "kv_connectors.md").read_text()
    source = re.search(r"```python\n(# example: KV connector\n.*?)```", text, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(source, "kv_connectors.md", "exec"), namespace)
    check_kv_connector(namespace["InProcessConnector"], {"name": "docs-example"}, model=tiny_model)
    assert namespace["pagoda_kv_connectors"]() == {"in-process": namespace["InProcessConnector"]}


def test_the_block_server_runs_as_a_process_of_its_own(tmp_path):
    import subprocess
    import sys

    from pagoda.plugins.entrypoints.server import free_port

    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("pagoda")), "kv-server", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert f"serving KV blocks on 127.0.0.1:{port}" in proc.stdout.readline()
        check_kv_connector(TCPConnector.from_config, {"port": port}, engines=False)
    finally:
        proc.terminate()
        proc.wait(30)


def test_in_bf16_with_the_batch_invariant_mode_the_loading_engine_gives_one_engine_s_tokens(tiny_model, tmp_path):
    bf16 = dict(OPTIONS, dtype="bfloat16", batch_invariant=True)
    alone = generate(LLM(model=tiny_model, **bf16))
    a = disk_engine(tiny_model, tmp_path, **bf16)
    assert generate(a) == alone
    a.engine.kv_transfers.flush()
    b = disk_engine(tiny_model, tmp_path, **bf16)
    assert generate(b) == alone
    assert b.engine.kv_transfers.stats.blocks_loaded == 3 * BLOCKS_PER_PROMPT
