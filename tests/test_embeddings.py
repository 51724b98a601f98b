"""Embedding and rerank models, beside sentence-transformers on the same weights: in the engine (every pooling,
batched), and over HTTP with the clients people use (openai, LangChain), hostile inputs, and the kind checks."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from conftest import Reference, Worker, assert_one_line_failure, run_worker_to_exit, start_worker, stop_worker
from encoder_zoo import decoder_embedder, extract_minilm, tiny_cross_encoder, tiny_embedder
from jobs import Job, make_engine
from llorch.engine.config import EngineConfig
from llorch.engine.engine import Engine
from llorch.engine.errors import RequestRejected
from llorch.engine.factory import build_engine
from llorch.engine.model_kinds import rank_tokens
from llorch.engine.request import GenerationRequest
from llorch.errors import ModelFileError
from llorch.weights.loader import LoadedModel

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "Embeddings turn text into vectors, so that texts of similar meaning lie close together.",
    "Zürich, Köln und Genève sind Städte; 東京 is a city too. ✓",
    "numbers 3.14159 and 2.71828, a URL https://example.com/a?b=c, and CODE_names_with_underscores",
    " ".join(["a long text that repeats itself"] * 12),
]
DOCUMENTS = {  # a small retrieval set: each query below has one right answer
    "cats": "Cats are small domesticated felines that purr, hunt mice and sleep most of the day.",
    "python": "Python is a programming language known for its readable syntax and large standard library.",
    "paris": "Paris is the capital of France, home to the Eiffel Tower and the Louvre museum.",
    "rain": "Rain forms when water vapour in clouds condenses into droplets heavy enough to fall.",
}
QUERIES = {"Which animal purrs and chases mice?": "cats", "What is the capital city of France?": "paris",
           "How do I write a program with a readable language?": "python", "Why does water fall from clouds?": "rain"}
PAIRS = [("what is a cat", "a cat is a small animal that purrs"), ("how hot is the sun", "the sun is very hot"),
         ("x", "y z"), ("where is paris", "Paris is the capital of France, on the Seine.")]


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_minilm(tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> dict[str, Path]:
    """A tiny random model per kind, saved by sentence-transformers."""
    root = tmp_path_factory.mktemp("encoders")
    return {"mean-dense-normalize": tiny_embedder(minilm, root / "mean", "mean", dense=True, normalize=True),
            "cls": tiny_embedder(minilm, root / "cls", "cls", dense=False, normalize=False),
            "last": tiny_embedder(minilm, root / "last", "lasttoken", dense=False, normalize=True),
            "rerank": tiny_cross_encoder(minilm, root / "rerank")}


def engine_for(path: Path, **config: Any) -> Engine:
    engine = build_engine(EngineConfig(model=str(path), **config))
    engine.start()
    return engine


def pooled(engine: Engine, requests: list[GenerationRequest]) -> list[list[float]]:
    """Submit every request at once (they share steps) and wait for their pooled values."""
    jobs = []
    for request in requests:
        job = Job()
        engine.submit(engine.prepare(request), job.emit)
        jobs.append(job)
    values = []
    for job in jobs:
        job.wait()
        (event,) = [e for e in job.events if e["type"] == "pooled"]
        assert job.terminal_events[0]["type"] == "end"
        values.append(event["values"])
    return values


def embed(engine: Engine, texts: list[str], truncate: bool = False) -> np.ndarray:
    return np.array(pooled(engine, [GenerationRequest(f"e{i}", t, 0, pooled=True, truncate=truncate)
                                    for i, t in enumerate(texts)]))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def sentence_transformer(path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize("kind", ["mean-dense-normalize", "cls", "last"])
def test_tiny_embedders_match_sentence_transformers(tiny: dict[str, Path], kind: str) -> None:
    engine = engine_for(tiny[kind])
    try:
        ours = embed(engine, TEXTS)
    finally:
        engine.stop()
    reference = sentence_transformer(tiny[kind]).encode(TEXTS)
    assert ours.shape == reference.shape
    assert cosines(ours, reference).min() >= 0.9999
    assert np.abs(ours - reference).max() < 1e-4  # the same vector, not only the same direction
    assert cosines(ours[:1], ours[2:3])[0] < 0.999  # different texts give different vectors


def test_minilm_matches_sentence_transformers_and_batches(minilm: Path) -> None:
    """The real model: every text batched into one step gives sentence-transformers' vector; a text past the
    model's 256 tokens is refused, or cut exactly as sentence-transformers cuts it when asked."""
    engine = build_engine(EngineConfig(model=str(minilm)))  # jobs are queued before the thread starts: one step
    try:
        jobs = []
        for i, text in enumerate(TEXTS):
            job = Job()
            engine.submit(engine.prepare(GenerationRequest(f"b{i}", text, 0, pooled=True)), job.emit)
            jobs.append(job)
        engine.start()
        for job in jobs:
            job.wait()
        ours = np.array([next(e["values"] for e in job.events if e["type"] == "pooled") for job in jobs])
        steps = engine.telemetry.registry.get_sample_value("llorch_batch_size_count")
        rows = engine.telemetry.registry.get_sample_value("llorch_batch_size_sum")
        assert (steps, rows) == (1, len(TEXTS))
        model = sentence_transformer(minilm)
        assert cosines(ours, model.encode(TEXTS)).min() >= 0.9999
        long = " ".join(f"word{i}" for i in range(400))
        with pytest.raises(Exception, match="256") as refused:
            engine.prepare(GenerationRequest("long", long, 0, pooled=True))
        assert getattr(refused.value, "code", None) == "context_length_exceeded"
        assert cosines(embed(engine, [long], truncate=True), model.encode([long]))[0] >= 0.9999
        assert engine.stats().jobs_in_flight == 0 and engine.stats().waiting == 0
    finally:
        engine.stop()


def test_a_step_takes_whole_texts_within_its_token_budget(minilm: Path) -> None:
    """Queued texts are read in arrival order, as many per step as fit --max-batch-tokens (a longer text alone)."""
    engine = build_engine(EngineConfig(model=str(minilm), max_batch_tokens=40))
    try:
        jobs, lengths = [], []
        for i, text in enumerate(TEXTS):
            job, prepared = Job(), engine.prepare(GenerationRequest(f"t{i}", text, 0, pooled=True))
            engine.submit(prepared, job.emit)
            jobs.append(job)
            lengths.append(len(prepared.prompt_ids))
        engine.start()
        for job in jobs:
            job.wait()
    finally:
        engine.stop()
    steps, tokens = 0, None
    for length in lengths:  # the rule, counted independently
        if tokens is None or tokens + length > 40:
            steps, tokens = steps + 1, length
        else:
            tokens += length
    assert max(lengths) > 40 and steps > 2
    assert engine.telemetry.registry.get_sample_value("llorch_batch_size_count") == steps


def test_cross_encoder_scores_match_sentence_transformers(tiny: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    engine = engine_for(tiny["rerank"])
    try:
        assert engine.kind == "rerank"
        ours = np.array(pooled(engine, [GenerationRequest(f"r{i}", q, 0, pooled=True, pair=d)
                                        for i, (q, d) in enumerate(PAIRS)]))[:, 0]
    finally:
        engine.stop()
    reference = CrossEncoder(str(tiny["rerank"]), device="cpu").predict(PAIRS)
    assert np.abs(ours - reference).max() < 1e-4
    assert np.ptp(reference) > 0.05  # the pairs score differently: the comparison can fail


# -- over HTTP ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory, minilm: Path) -> Iterator[Worker]:
    live = start_worker(tmp_path_factory.mktemp("embedder"), "--model", str(minilm))
    yield live
    stop_worker(live)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path]) -> Iterator[Worker]:
    live = start_worker(tmp_path_factory.mktemp("reranker"), "--model", str(tiny["rerank"]))
    yield live
    stop_worker(live)


@pytest.fixture(scope="module")
def embed_client(embedder: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedder.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_float_and_base64(embed_client: openai.OpenAI, minilm: Path) -> None:
    model = embed_client.models.list().data[0]
    assert model.model_extra is not None and model.model_extra["kind"] == "embed"
    assert model.model_extra["dimensions"] == 384
    floats = embed_client.embeddings.create(model=model.id, input=TEXTS, encoding_format="float")
    default = embed_client.embeddings.create(model=model.id, input=TEXTS)  # the client asks for base64, decodes it
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    ours = np.array([d.embedding for d in floats.data])
    # Batched texts may share a step with other texts or not, which moves float rounding (~1e-7), nothing more.
    assert np.allclose(ours, np.array([d.embedding for d in default.data]), atol=1e-6)
    assert cosines(ours, sentence_transformer(minilm).encode(TEXTS)).min() >= 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    raw = httpx.post(f"{embed_client.base_url}embeddings", json={"input": "hello", "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    single = embed_client.embeddings.create(model=model.id, input="hello", encoding_format="float")
    assert np.array_equal(vector, np.array(single.data[0].embedding, dtype=np.float32))
    ids = embed_client.embeddings.create(model=model.id, input=[[101, 7592, 102]], encoding_format="float")
    assert np.allclose(ids.data[0].embedding, single.data[0].embedding, atol=1e-6)  # "hello" as token ids


def test_langchain_retrieval_round_trip(embedder: Worker) -> None:
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: the worker tokenizes (the client would fetch a tokenizer from the web).
    client = OpenAIEmbeddings(model="all-MiniLM-L6-v2", base_url=f"{embedder.base_url}/v1", api_key="unused",
                              check_embedding_ctx_length=False)
    names = list(DOCUMENTS)
    index = np.array(client.embed_documents([DOCUMENTS[n] for n in names]))
    for query, answer in QUERIES.items():
        vector = np.array(client.embed_query(query))
        assert names[int(np.argmax(index @ vector))] == answer, query


def test_llamaindex_openai_like_embedding(embedder: Worker, minilm: Path) -> None:
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    client = OpenAILikeEmbedding(model_name="all-MiniLM-L6-v2", api_base=f"{embedder.base_url}/v1", api_key="unused",
                                 embed_batch_size=4, max_retries=0)
    ours = np.array(client.get_text_embedding_batch(TEXTS))  # in batches of 4: two requests
    assert cosines(ours, sentence_transformer(minilm).encode(TEXTS)).min() >= 0.9999
    query = np.array(client.get_query_embedding("Which animal purrs and chases mice?"))
    index = np.array(client.get_text_embedding_batch(list(DOCUMENTS.values())))
    assert list(DOCUMENTS)[int(np.argmax(index @ query))] == "cats"


def test_dimensions_only_where_trained(embed_client: openai.OpenAI) -> None:
    assert len(embed_client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=384).data[0]
               .embedding) == 384
    with pytest.raises(openai.BadRequestError, match="not trained for shortened embeddings"):
        embed_client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=100)


@pytest.mark.parametrize(("body", "status", "fragment"), [
    ({"input": ["x"] * 10_000}, 400, "input"),
    ({"input": ""}, 400, "empty string"),
    ({"input": ["fine", ""]}, 400, "input[1] is an empty string"),
    ({"input": []}, 400, "empty list"),
    ({"input": [[101, 30522, 102]]}, 400, "outside this model's vocabulary"),
    ({"input": ["a " * 300]}, 400, "at most 256"),
    ({"input": "x" * 40_000}, 400, "32768"),
    ({"input": "x" * (1 << 20)}, 413, "too large"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "model": "another"}, 404, "another"),
])
def test_hostile_inputs_are_clear_4xx(embedder: Worker, body: dict[str, Any], status: int, fragment: str) -> None:
    response = httpx.post(f"{embedder.base_url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]
    metrics = httpx.get(f"{embedder.base_url}/metrics").text
    assert "llorch_queue_depth 0.0" in metrics  # nothing held afterwards


def test_many_clients_share_steps(embedder: Worker) -> None:
    def one(i: int) -> list[float]:
        response = httpx.post(f"{embedder.base_url}/v1/embeddings", json={"input": [f"text number {i}"] * 4},
                              timeout=60)
        response.raise_for_status()
        return response.json()["data"][0]["embedding"]

    before = httpx.get(f"{embedder.base_url}/metrics").text
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        vectors = list(pool.map(one, range(48)))
    assert len({tuple(v) for v in vectors}) == 48
    after = httpx.get(f"{embedder.base_url}/metrics").text

    def count(text: str, name: str) -> float:
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    steps = count(after, "llorch_batch_size_count") - count(before, "llorch_batch_size_count")
    assert steps < 48 * 4 / 2  # rows of different requests shared steps


def test_a_client_that_goes_away_cancels_its_inputs(embedder: Worker) -> None:
    """A client that closes its connection once its 1000 inputs are queued: what was not computed yet is
    cancelled, and every accepted input ends."""
    def sample(name: str) -> float:
        metrics = httpx.get(f"{embedder.base_url}/metrics").text
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))

    names = {"accepted": "llorch_jobs_accepted_total", "queued": "llorch_queue_depth",
             "cancelled": 'llorch_requests_total{outcome="cancelled"}',
             "pooled": 'llorch_requests_total{outcome="pooled"}'}
    before = {key: sample(name) for key, name in names.items()}
    text = " ".join(f"token{i}" for i in range(60))  # about 150 tokens: a minute of work for 1000 of them
    body = json.dumps({"input": [text] * 1000}).encode()
    host, port = embedder.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while sample(names["accepted"]) - before["accepted"] < 1000 and time.monotonic() < deadline:
            time.sleep(0.05)  # all or none: the request's inputs are queued together
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = {key: sample(name) - before.get(key, 0) for key, name in names.items()}
        if now["accepted"] == now["cancelled"] + now["pooled"]:
            break
        time.sleep(0.2)
    assert now["accepted"] == 1000 and now["accepted"] == now["cancelled"] + now["pooled"], now
    assert now["cancelled"] > 500 and sample(names["queued"]) == 0, now


def test_kind_mismatch_is_a_400_naming_the_kind(embed_client: openai.OpenAI, embedder: Worker,
                                                 client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError, match="serves an embedding model"):
        embed_client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
    message = [{"role": "user", "content": "hi"}]
    for path, body in [("/execute", {"job_id": "x", "prompt": "hi", "max_tokens": 4}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/messages", {"model": "all-MiniLM-L6-v2", "max_tokens": 4, "messages": message}),
                       ("/v1/responses", {"model": "all-MiniLM-L6-v2", "input": "hi"}),
                       ("/api/chat", {"model": "all-MiniLM-L6-v2", "messages": message}),
                       ("/api/generate", {"model": "all-MiniLM-L6-v2", "prompt": "hi"}),
                       ("/completion", {"prompt": "hi"})]:
        answer = httpx.post(f"{embedder.base_url}{path}", json=body, timeout=30)
        assert answer.status_code == 400 and "serves an embedding model" in answer.text, (path, answer.text)
    with pytest.raises(openai.BadRequestError, match="serves a generation model"):
        client.embeddings.create(model=model_id, input="hi")


def test_rerank_matches_cross_encoder_in_both_shapes(reranker: Worker, tiny: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    query, documents = "what is a cat", [d for _, d in PAIRS]
    reference = CrossEncoder(str(tiny["rerank"]), device="cpu").predict([(query, d) for d in documents])
    for path in ("/v1/rerank", "/rerank"):
        body = httpx.post(f"{reranker.base_url}{path}", json={"query": query, "documents": documents}).json()
        scores = [r["relevance_score"] for r in body["results"]]
        assert scores == sorted(scores, reverse=True)
        for result in body["results"]:
            assert abs(result["relevance_score"] - reference[result["index"]]) < 1e-4
            assert result["document"]["text"] == documents[result["index"]]
        assert body["usage"]["total_tokens"] > len(documents)
    top = httpx.post(f"{reranker.base_url}/v1/rerank", json={
        "query": query, "documents": [{"text": d} for d in documents], "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == list(np.argsort(-reference)[:2])
    assert all("document" not in r for r in top["results"])
    refused = httpx.post(f"{reranker.base_url}/v1/embeddings", json={"input": "hi"})
    assert refused.status_code == 400 and "reranking model" in refused.text
    empty = httpx.post(f"{reranker.base_url}/v1/rerank", json={"query": query, "documents": []})
    assert empty.status_code == 400 and "documents" in empty.text


def test_ollama_client_embeds(embedder: Worker, minilm: Path) -> None:
    import ollama

    client = ollama.Client(host=embedder.base_url)
    answer = client.embed(model="all-MiniLM-L6-v2", input=TEXTS)
    ours = np.array(answer.embeddings)
    assert cosines(ours, sentence_transformer(minilm).encode(TEXTS)).min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-6)
    assert answer.prompt_eval_count is not None and answer.prompt_eval_count > len(TEXTS)
    legacy = client.embeddings(model="all-MiniLM-L6-v2:latest", prompt=TEXTS[0])
    assert cosines(np.array([legacy.embedding]), ours[:1])[0] >= 0.9999
    long = " ".join(f"word{i}" for i in range(400))  # Ollama cuts past the context unless told not to
    assert len(client.embed(model="all-MiniLM-L6-v2", input=long).embeddings[0]) == 384
    with pytest.raises(ollama.ResponseError, match="at most 256"):
        client.embed(model="all-MiniLM-L6-v2", input=long, truncate=False)
    assert client.show("all-MiniLM-L6-v2").capabilities == ["embedding"]
    with pytest.raises(ollama.ResponseError, match="not found"):
        client.embed(model="other", input="hi")


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, minilm: Path, tiny: dict[str, Path]) -> dict[str, Path]:
    """The models converted to GGUF by llama.cpp's own converter (from its pinned source)."""
    from llama_build import convert_hf_to_gguf

    root = tmp_path_factory.mktemp("gguf")
    files = {"minilm-f32": (minilm, "f32"), "minilm-f16": (minilm, "f16"), "cls": (tiny["cls"], "f32"),
             "rerank": (tiny["rerank"], "f32")}
    for name, (source, outtype) in files.items():
        convert_hf_to_gguf(source, root / f"{name}.gguf", outtype)
    return {name: root / f"{name}.gguf" for name in files}


@pytest.mark.parametrize("name", ["minilm-f32", "minilm-f16", "cls"])
def test_gguf_from_llama_cpp_converter_matches_sentence_transformers(converted: dict[str, Path], minilm: Path,
                                                                     tiny: dict[str, Path], name: str) -> None:
    engine = engine_for(converted[name])
    try:
        ours = embed(engine, TEXTS)
    finally:
        engine.stop()
    reference = sentence_transformer(minilm if name.startswith("minilm") else tiny["cls"]).encode(TEXTS)
    assert cosines(ours, reference).min() >= 0.9999


def test_gguf_bert_classifier_without_pooler_is_refused(converted: dict[str, Path]) -> None:
    """llama.cpp's converter drops BERT's pooler, without which a cross-encoder's score cannot be computed."""
    with pytest.raises(Exception, match="without its pooler"):
        build_engine(EngineConfig(model=str(converted["rerank"])))


def mutated(source: Path, target: Path, change: Callable[[Path], None]) -> Path:
    shutil.copytree(source, target)
    change(target)
    return target


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda d: write_json(d / "modules.json", [{"idx": 0, "name": "0", "path": "../../etc", "type": "x.Pooling"}]),
     "points outside the model directory"),
    (lambda d: write_json(d / "1_Pooling" / "config.json", {"pooling_mode": "max"}), "pooling mode 'max'"),
    (lambda d: write_json(d / "modules.json", [{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"},
                                               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.LSTM"}]),
     "module x.LSTM is not supported"),
    (lambda d: write_json(d / "config.json", {**json.loads((d / "config.json").read_text()), "hidden_act": "relu"}),
     "activation 'relu'"),
    (lambda d: write_json(d / "config.json", {**json.loads((d / "config.json").read_text()), "num_hidden_layers": 3}),
     "is missing"),
])
def test_hostile_encoder_files_are_refused_by_name(tmp_path: Path, tiny: dict[str, Path],
                                                   change: Callable[[Path], None], fragment: str) -> None:
    directory = mutated(tiny["cls"], tmp_path / "model", change)
    with pytest.raises(ModelFileError, match=re.escape(fragment)):
        build_engine(EngineConfig(model=str(directory)))


def test_weights_that_compute_nan_are_refused_in_one_line(tmp_path: Path, tiny: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    def poison(directory: Path) -> None:
        weights = load_file(directory / "model.safetensors")
        weights["embeddings.LayerNorm.weight"][0] = float("nan")
        save_file(weights, directory / "model.safetensors")

    directory = mutated(tiny["cls"], tmp_path / "model", poison)
    assert_one_line_failure(run_worker_to_exit("--model", str(directory)), "not finite")


# -- a decoder as a reranker ----------------------------------------------------------------------------------------

RERANK_QUERY = "What is the capital of France?"
RERANK_DOCUMENTS = ["Bananas are yellow fruit rich in potassium.", "Paris is the capital and largest city of France.",
                    "Berlin is the capital of Germany.", "The Seine flows through Paris, the French capital."]


def decoder_scores(engine: Engine) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    requests = [GenerationRequest(f"d{i}", RERANK_QUERY, 0, pooled=True, pair=document)
                for i, document in enumerate(RERANK_DOCUMENTS)]
    prompts = [engine.prepare(r).prompt_ids for r in requests]
    return np.array(pooled(engine, requests))[:, 0], prompts


def test_decoder_reranker_scores_match_transformers(ours: LoadedModel, served: LoadedModel,
                                                    reference: Reference) -> None:
    """--pooling rank on a generating model: a pair's score is P(yes) against P(no) after Qwen3-Reranker's prompt,
    as transformers computes it on the same prompt; the C step on the file's blocks is close."""
    import torch

    engine = make_engine(ours, pooling="rank")
    try:
        assert engine.kind == "rerank"
        ours_scores, prompts = decoder_scores(engine)
        no, yes = rank_tokens(ours)
        text = engine.tokens.decode(prompts[1], skip_special=False)
        assert "<Query>: What is the capital of France?" in text and "<Document>: Paris" in text
    finally:
        engine.stop()
    with torch.no_grad():
        expected = np.array([float(torch.softmax(reference.model(torch.tensor([ids])).logits[0, -1, [no, yes]],
                                                 dim=-1)[1]) for ids in prompts])
    assert np.abs(ours_scores - expected).max() < 1e-4
    assert np.ptp(expected) > 0.05
    quantized = make_engine(served, pooling="rank")
    try:
        # one pair alone first: its prompt's blocks are then cached when the pairs arrive together, whatever
        # order they are admitted in (submitted at once, they could all start before any block was shared)
        pooled(quantized, [GenerationRequest("first", RERANK_QUERY, 0, pooled=True, pair=RERANK_DOCUMENTS[0])])
        blocks, _ = decoder_scores(quantized)
        assert quantized.telemetry.registry.get_sample_value("llorch_prefix_cache_hit_tokens_total") > 0
    finally:
        quantized.stop()
    # Q4_K_M blocks move each score a little (near ties may swap); the best and the worst stay.
    assert np.abs(blocks - expected).max() < 0.05
    assert (np.argmax(blocks), np.argmin(blocks)) == (np.argmax(expected), np.argmin(expected)) == (1, 0)


def test_decoder_pooling_other_than_rank_is_refused_in_one_line() -> None:
    assert_one_line_failure(run_worker_to_exit("--pooling", "mean"), "not supported yet")


def test_decoder_reranker_cuts_a_long_document_only_when_asked(served: LoadedModel) -> None:
    engine = make_engine(served, pooling="rank", ctx_size=256, start=False)
    long = " ".join(["Paris is the capital of France."] * 80)
    with pytest.raises(RequestRejected, match="256") as refused:
        engine.prepare(GenerationRequest("long", RERANK_QUERY, 0, pooled=True, pair=long))
    assert refused.value.field == "documents"
    job = engine.prepare(GenerationRequest("cut", RERANK_QUERY, 0, pooled=True, pair=long, truncate=True))
    text = engine.tokens.decode(job.prompt_ids, skip_special=False)
    assert 200 < len(job.prompt_ids) <= 256 and text.rstrip().endswith("model") and "<Document>: Paris" in text


def test_decoder_embedder_matches_transformers_last_token(zoo: dict[str, Path], tmp_path: Path) -> None:
    """A generating model in Qwen3-Embedding's layout (modules.json: last-token pooling, normalized) embeds a text
    as transformers' final hidden state of its last token, normalized; --pooling last does the same on the bare
    model directory."""
    import torch
    import transformers

    reference = transformers.AutoModel.from_pretrained(str(zoo["qwen3"]), dtype=torch.float32).eval()
    for engine in (engine_for(decoder_embedder(zoo["qwen3"], tmp_path / "qwen3-embedding")),
                   engine_for(zoo["qwen3"], pooling="last")):
        try:
            assert engine.kind == "embed" and engine.embedding is not None and engine.embedding.normalized
            ours = embed(engine, TEXTS[:4])
            prompts = [engine.prepare(GenerationRequest("p", t, 0, pooled=True)).prompt_ids for t in TEXTS[:4]]
        finally:
            engine.stop()
        with torch.no_grad():
            expected = np.array([torch.nn.functional.normalize(reference(torch.tensor([ids])).last_hidden_state[
                0, -1], dim=-1).numpy() for ids in prompts])
        assert np.abs(ours - expected).max() < 1e-5
        assert cosines(ours[:1], ours[1:2])[0] < 0.999
