"""Large CPU tensors get 2 MiB pages when asked; an engine's huge_pages setting off leaves its own alone."""

from pathlib import Path

import pytest
import torch

from pagoda.host import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="transparent huge pages are off on this machine")


def _huge_kib_in(start: int, end: int, field: str = "AnonHugePages") -> int:
    """``field`` (KiB) of the mappings overlapping [start, end), from /proc/self/smaps: AnonHugePages by default,
    Rss for what is resident."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and line.startswith(field + ":"):
            total += int(line.split()[1])
    return total


def _resident_kib(t: torch.Tensor) -> int:
    start = t.untyped_storage().data_ptr()
    return _huge_kib_in(start, start + t.untyped_storage().nbytes(), "Rss")


def test_only_whole_huge_pages_inside_a_range_are_advised():
    page = hugepages.HUGE_PAGE
    assert hugepages.advise_range(page + 1, 2 * page + 100) == 0  # no whole 2 MiB page inside
    buf = torch.empty(8 * page, dtype=torch.uint8)
    start = buf.data_ptr()
    advised = hugepages.advise_range(start, start + buf.numel())
    assert advised % page == 0 and 6 * page <= advised <= 8 * page


@needs_thp
def test_an_advised_tensor_is_backed_by_huge_pages_once_touched():
    t = torch.empty(32 << 20, dtype=torch.uint8)
    assert hugepages.advise_tensors([t]) >= 30 << 20
    t.fill_(1)
    assert _huge_kib_in(t.data_ptr(), t.data_ptr() + t.numel()) >= 2048


@needs_thp
def test_the_engine_backs_its_kv_cache_with_huge_pages(tmp_path):
    from pagoda import SamplingParams
    from pagoda.engine.llm import LLM
    from tiny_models import write_tiny_checkpoint

    llm = LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", kv_cache_memory_bytes=64 << 20,
              cpu_threads=1)
    cache = llm.engine.runner.kv_caches[0]
    start = cache.untyped_storage().data_ptr()
    end = start + cache.untyped_storage().nbytes()
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=2))  # its K/V: the cache's first touch
    assert _huge_kib_in(start, end) >= 2048


def test_populating_maps_every_page_and_keeps_what_was_written():
    from pagoda.host.malloc import zero_pages

    t = zero_pages((16 << 20,), torch.uint8)  # a mapping of its own, nothing resident yet
    t[12345], t[(9 << 20) + 7] = 3, 5
    assert _resident_kib(t) < 4 << 10
    assert hugepages.populate([t]) >= 0
    assert _resident_kib(t) >= 16 << 10
    assert int(t[12345]) == 3 and int(t[(9 << 20) + 7]) == 5 and int(t.sum()) == 8


@pytest.mark.parametrize("prefault", [True, False])
def test_the_engine_maps_its_whole_kv_cache_at_start_unless_told_not_to(tmp_path, prefault):
    from pagoda.engine.llm import LLM
    from tiny_models import write_tiny_checkpoint

    llm = LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", kv_cache_memory_bytes=16 << 20,
              cpu_threads=1, kv_cache_prefault=prefault)
    caches = llm.engine.runner.kv_caches
    resident = sum(_resident_kib(c) for c in caches)
    size_kib = sum(c.untyped_storage().nbytes() for c in caches) >> 10
    assert (llm.engine.runner.prefault_seconds is not None) == prefault
    assert resident >= size_kib if prefault else resident < size_kib // 2


def test_an_engine_built_without_huge_pages_advises_none(tmp_path, monkeypatch):
    from pagoda.engine.llm import LLM
    from tiny_models import write_tiny_checkpoint

    monkeypatch.setattr(hugepages, "_madvise", lambda: pytest.fail("advised with huge pages off"))
    LLM(model=str(write_tiny_checkpoint(tmp_path)), load_format="dummy", kv_cache_memory_bytes=64 << 20,
        cpu_threads=1, huge_pages=False, kv_cache_prefault=False)


@needs_thp
def test_the_engine_s_weights_load_into_huge_pages_without_a_collapse(tmp_path, monkeypatch):
    """The weights are advised before the loader writes them, so its writes fault in huge pages: no copy of the
    loaded weights into huge pages (MADV_COLLAPSE, here made a no-op) is needed."""
    import json

    from pagoda.engine.llm import LLM
    from tiny_models import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    # a 48 MiB float32 embedding: a mapping of its own (above malloc's mmap threshold), untouched until loaded
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_size": 256, "intermediate_size": 512}))
    monkeypatch.setattr(hugepages, "_MADV_COLLAPSE", hugepages._MADV_HUGEPAGE)
    llm = LLM(model=str(model_dir), load_format="dummy", dtype="float32", kv_cache_memory_bytes=8 << 20,
              cpu_threads=1)
    embedding = max(llm.engine.model.parameters(), key=lambda p: p.numel())
    start = embedding.untyped_storage().data_ptr()
    assert embedding.numel() * 4 >= 40 << 20
    assert _huge_kib_in(start, start + embedding.untyped_storage().nbytes()) >= 32 << 10
