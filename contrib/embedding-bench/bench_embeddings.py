"""Embeddings per second: pagoda's pooling engine against sentence-transformers, alternated in one window.

Writes a random BERT-base-sized encoder (12 layers, hidden 768, 12 heads, vocab 30522) with transformers and
its sentence-transformers files (mean pooling, Normalize), then embeds the same texts of ``--tokens`` tokens
with each in turn, ``--repeat`` times, same batch size and threads, and prints the ratio of the medians.

    python contrib/embedding-bench/bench_embeddings.py --texts 64 --tokens 128 --repeat 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def write_bert_base(folder: Path, layers: int) -> None:
    from transformers import BertConfig, BertModel, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(30522 - 5)]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizer(vocab=str(folder / "vocab.txt"), model_max_length=512).save_pretrained(str(folder))
    torch.manual_seed(0)
    BertModel(BertConfig(num_hidden_layers=layers), add_pooling_layer=False).save_pretrained(str(folder))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 768,
                                                                  "pooling_mode_mean_tokens": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per text, [CLS] and [SEP] included")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)

    from sentence_transformers import SentenceTransformer

    from pagoda.engine.engine_args import EngineArgs
    from pagoda.engine.pooling import PoolingEngine

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bert-base"
        write_bert_base(folder, ns.layers)
        rng = random.Random(0)
        texts = [" ".join(f"w{rng.randrange(30517)}" for _ in range(ns.tokens - 2)) for _ in range(ns.texts)]
        st = SentenceTransformer(str(folder), device="cpu")
        pagoda = PoolingEngine(EngineArgs(model=str(folder), max_num_batched_tokens=ns.batch_size * ns.tokens),
                               "embed")
        items = [pagoda.tokenize(t) for t in texts]
        assert all(len(i.token_ids) == ns.tokens for i in items)

        def run_pagoda() -> None:
            pagoda.encode([pagoda.tokenize(t) for t in texts])  # tokenizing counted, as sentence-transformers'

        def run_st() -> None:
            st.encode(texts, batch_size=ns.batch_size, convert_to_tensor=True)

        run_pagoda(), run_st()  # warm-up
        times: dict[str, list[float]] = {"pagoda": [], "sentence-transformers": []}
        for _ in range(ns.repeat):
            for name, fn in (("pagoda", run_pagoda), ("sentence-transformers", run_st)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        print(f"CPU: {cpu_name()}; threads {ns.threads}; load average {load}; {ns.texts} texts x {ns.tokens} "
              f"tokens, batch {ns.batch_size}, {ns.layers} layers (BERT-base shapes), float32")
        rates = {}
        for name, ts in times.items():
            rates[name] = ns.texts / statistics.median(ts)
            print(f"  {name:22s} {rates[name]:8.1f} embeddings/s (median of {ns.repeat}: "
                  f"{', '.join(f'{t:.2f}' for t in ts)} s)")
        print(f"  pagoda / sentence-transformers: {rates['pagoda'] / rates['sentence-transformers']:.2f}x")


if __name__ == "__main__":
    main()
