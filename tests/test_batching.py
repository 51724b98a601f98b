"""Continuous batching: concurrent jobs share forward steps over a paged, prefix-cached KV pool.

What holds, by weight type (the runner-level tests measure it):
- GGUF blocks on the CPU (the C step): every row is computed on its own in a fixed order,
  so a job's logits in a batch are bit-identical to the job alone.
- dense float32 weights (torch ops): a job's logits in a batch differ from the job alone
  by float rounding only (measured about 2e-5 on logits of size 20-30; the test allows
  1e-3), so greedy tokens are the same.
- bfloat16 compute: activations are rounded to 8 bits of mantissa, and a different
  batch shape rounds differently: measured up to 2% of the largest logit; the test
  allows 5%, and requires the same top token wherever the alone top-2 margin exceeds
  twice the measured difference. Greedy text may therefore diverge at a near-tie.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from conftest import Worker, start_worker, stop_worker
from jobs import GREEDY, Job, make_engine, run, steps_larger_than
from llorch.api.app import create_app
from llorch.api.state import WorkerState
from llorch.engine.engine import Engine
from llorch.engine.errors import QueueFull
from llorch.engine.factory import kv_dtype
from llorch.engine.kv.blocks import BlockAllocator
from llorch.engine.kv.pool import bytes_per_block
from llorch.engine.request import GenerationRequest, SamplingParams
from llorch.engine.runner import ChunkInput, ModelRunner
from llorch.weights.default_model import default_model_path
from llorch.weights.loader import LoadedModel, load_model
from soak import SoakReport, soak
from tiny_model import write_tiny_gemma3

pytestmark = pytest.mark.cpu

# Different lengths (one spans several KV blocks and prefill chunks) and different max_tokens.
PROMPTS = [
    ("The capital of France is", 14),
    ("Write a short poem about the sea and the sky, in four lines:\n", 22),
    ("def fibonacci(n):\n    ", 18),
    ("List the prime numbers below 50: 2, 3, 5,", 30),
    ("Translate to German: 'The weather is nice today.'", 12),
    ("Once upon a time, in a kingdom far away, there lived a " + "very " * 40 + "old king who", 25),
    ("Q: What is 12 times 12?\nA:", 10),
    ("Les chats et les chiens sont", 20),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_gemma3(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return load_model(path, torch.device("cpu"), torch.float32)


def submit_all(engine: Engine, jobs: list[tuple[str, str, int]], sampling: SamplingParams = GREEDY) -> list[Job]:
    return [run(engine, job_id, prompt, max_tokens, sampling) for job_id, prompt, max_tokens in jobs]


@pytest.mark.parametrize("weights", ["ours", "served"], ids=["float32-weights", "gguf-block-weights"])
def test_concurrent_greedy_jobs_equal_each_job_alone_in_f32(weights: str, request: pytest.FixtureRequest) -> None:
    ours: LoadedModel = request.getfixturevalue(weights)
    jobs = [(f"job-{i}", prompt, max_tokens) for i, (prompt, max_tokens) in enumerate(PROMPTS)]
    # A small prompt budget makes the long prompt arrive in chunks while others decode.
    engine = make_engine(ours, max_running=8, max_batch_tokens=64)
    try:
        alone = [job.wait() and job for job in (run(engine, *spec) for spec in jobs)]
        assert steps_larger_than(engine, 1) == 0
        together = submit_all(engine, jobs)
        for job in together:
            job.wait()
    finally:
        engine.stop()
    assert steps_larger_than(engine, 7) > 0 and steps_larger_than(engine, 8) == 0, "all eight shared a step"
    for spec, one, many in zip(jobs, alone, together, strict=True):
        assert many.events[-1] == one.events[-1] | {"decode_time_ms": many.events[-1]["decode_time_ms"]}, spec
        assert many.text == one.text, spec
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("weights, dtype, relative_tolerance", [
    ("float32", torch.float32, 1e-3 / 30), ("gguf-blocks", torch.float32, 0.0), ("bfloat16", torch.bfloat16, 0.05)])
def test_batched_logits_equal_alone_within_the_dtype_tolerance(
    ours: LoadedModel, served: LoadedModel, weights: str, dtype: torch.dtype, relative_tolerance: float
) -> None:
    """GGUF blocks: decoding rows and a prompt chunk's rows share one C step, and each row's
    arithmetic is its own: exactly the bits it gets alone."""
    loaded = {"float32": ours, "gguf-blocks": served}.get(weights) or load_model(default_model_path(),
                                                                                 torch.device("cpu"), dtype)
    runner = ModelRunner(loaded.model, torch.device("cpu"), dtype, kv_cache_bytes=64 * 2**20)
    prompts = [loaded.tokenizer.encode(p) for p, _ in PROMPTS[:5]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]
    alone = torch.stack([runner.forward([ChunkInput(ids, 0, table, True)])[0]
                         for ids, table in zip(prompts, tables, strict=True)]).float()
    # One step: four sequences re-feed their last token (decode shape), the fifth reads
    # the rest of its prompt after a first chunk was cached in an earlier step.
    last = prompts[4]
    runner.forward([ChunkInput(last[:7], 0, tables[4], False)])
    step = [ChunkInput(ids[-1:], len(ids) - 1, table, True) for ids, table in zip(prompts[:4], tables[:4], strict=True)]
    together = runner.forward([*step, ChunkInput(last[7:], 7, tables[4], True)]).float()
    scale = alone.abs().max()
    difference = (together - alone).abs().max()
    assert difference <= relative_tolerance * scale
    top2 = alone.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * difference
    assert torch.equal(together.argmax(-1)[clear], alone.argmax(-1)[clear])


def test_prefix_cache_hits_are_exact(ours: LoadedModel) -> None:
    system = ("You are a helpful assistant. Answer in one short sentence, politely, and never "
              "mention that you are a model. Today is a sunny day in Paris and the user is curious. ")
    questions = ["What is the capital of Italy?", "Name a red fruit.", "What is 2 + 2?", "Say hello."]
    jobs = [(f"q{i}", system + q, 12) for i, q in enumerate(questions)]
    shared_blocks = len(ours.tokenizer.encode(system)) // 16
    assert shared_blocks >= 2
    cached = make_engine(ours, prefix_caching=True)
    uncached = make_engine(ours, prefix_caching=False)
    try:
        plain = [job.wait() and job for job in (run(uncached, *spec) for spec in jobs)]
        sequential = [job.wait() and job for job in (run(cached, *spec) for spec in jobs)]
        hits_after_sequential = cached.stats().prefix_cache_hit_tokens
        # The same prompts again, all at once and once more exactly (a full hit recomputes the last token).
        concurrent = submit_all(cached, [(f"again-{job_id}", prompt, n) for job_id, prompt, n in jobs])
        repeat = run(cached, "repeat", jobs[0][1], 12)
        for job in [*concurrent, repeat]:
            job.wait()
    finally:
        cached.stop()
        uncached.stop()
    assert uncached.stats().prefix_cache_hit_tokens == 0
    assert hits_after_sequential >= 3 * shared_blocks * 16, "later jobs reused the system prompt's blocks"
    for one, two, three in zip(plain, sequential, concurrent, strict=True):
        assert one.text == two.text == three.text
    assert repeat.text == plain[0].text
    assert cached.stats().kv_blocks_used == 0 and cached.stats().kv_blocks_cached > 0


def test_bounded_stress_every_job_ends_once_and_the_pool_empties(tiny: LoadedModel) -> None:
    """A pool too small for everyone (preemption), a short queue (QueueFull), random cancels."""
    rng = random.Random(7)
    # 24 blocks of 16 tokens: six jobs of up to ~100 tokens cannot all fit at once.
    engine = make_engine(tiny, max_running=6, kv_cache_bytes=25 * bytes_per_block(tiny.config, kv_dtype(tiny)),
                         max_queue=6, max_batch_tokens=32)
    words = ["the", "a", "of", "to", "is", "and", "in", "e", "t"]
    accepted: dict[str, Job] = {}
    rejected = 0
    try:
        alone = {}
        for i in range(40):
            # Six long jobs first: together they outgrow the pool, whatever the machine's speed.
            prompt = " ".join(rng.choices(words, k=40 if i < 6 else rng.randint(1, 40)))
            max_tokens = 60 if i < 6 else rng.randint(1, 60)
            request = GenerationRequest(f"s{i}", prompt, max_tokens, GREEDY)
            job = Job()
            try:
                engine.submit(engine.prepare(request), job.emit)
            except QueueFull:
                rejected += 1
                time.sleep(0.02)
                continue
            accepted[request.job_id] = job
            alone[request.job_id] = (prompt, max_tokens)
            # The six long jobs are never cancelled: a cancel landing before one of them is admitted
            # could leave the rest fitting the pool, and then nothing would be preempted.
            if rng.random() < 0.25 and i >= 6:
                threading.Timer(rng.uniform(0, 0.05), engine.cancel, (request.job_id,)).start()
        for job in accepted.values():
            job.wait(60)
        assert engine.stats().preemptions > 0, "the pool was small enough to preempt"
        # Jobs that ran to the end produced what they produce alone, preempted or not.
        for job_id, job in accepted.items():
            if job.events[-1].get("stop_reason") in ("MAX_TOKENS", "EOS"):
                solo = run(engine, f"solo-{job_id}", *alone[job_id])
                solo.wait()
                assert solo.text == job.text, job_id
    finally:
        engine.stop()
    assert rejected > 0 and len(accepted) > 10
    for job_id, job in accepted.items():
        assert len(job.terminal_events) == 1 and job.events[-1] is job.terminal_events[0], job_id
        assert job.events[0]["type"] == "started", job_id
    assert any(job.events[-1].get("stop_reason") == "CANCELLED" for job in accepted.values())
    assert engine.stats().kv_blocks_used == 0
    assert engine.stats().jobs_in_flight == 0


@pytest.fixture
def tiny_worker(tmp_path: Path) -> Iterator[Worker]:
    model = write_tiny_gemma3(tmp_path / "tiny.gguf")
    worker = start_worker(tmp_path, "--model", str(model), "--max-running", "4", "--max-queue", "2",
                          "--kv-cache-mb", "1")
    try:
        yield worker
    finally:
        stop_worker(worker)


def test_http_stress_disconnects_cancels_and_busy_answers(tiny_worker: Worker) -> None:
    def enough(report: SoakReport) -> bool:  # on a loaded machine the clients go on until they have seen each case
        return report.busy_503 > 0 and report.accepted > 20 and report.disconnected > 0 and report.cancelled > 0

    report = soak(tiny_worker.base_url, tiny_worker.process.pid, clients=10, seconds=8, enough=enough, longest=90)
    assert report.busy_503 > 0, "more clients than slots + queue get 503 with Retry-After"
    assert report.accepted > 20 and report.disconnected > 0 and report.cancelled > 0
    assert report.server_errors_5xx == 0
    assert report.exactly_one_terminal == report.completed + report.cancelled
    assert report.accepted_by_worker >= report.accepted  # abandoned non-streaming jobs come on top
    assert report.ended_by_worker == report.accepted_by_worker
    assert report.in_flight_after == 0 and report.kv_bytes_after == 0
    assert report.slow_connections > 0 and report.slow_closed_in_time == report.slow_connections
    assert not report.problems and report.ok


def test_block_pool_reference_counts_and_evicts_least_recently_released() -> None:
    pool = BlockAllocator(num_blocks=5, block_size=4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (1, 2) and pool.free_blocks == 2
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.take(pool.lookup([b"A", b"B"]))  # a second holder shares both
    pool.release([a, b])
    assert pool.used_blocks == 2  # still held once
    pool.release([b])
    pool.release([a])
    assert pool.used_blocks == 0 and pool.cached_blocks == 2
    # Blank blocks go first, then cached ones, least recently released (b) first.
    assert [pool.allocate(), pool.allocate()] == [3, 4]
    assert pool.allocate() == b and pool.lookup([b"A", b"B"]) == [a]
    assert pool.allocate() == a and pool.allocate() is None
    with pytest.raises(AssertionError):
        pool.release([a, a])


def test_rope_positions_follow_the_block_table_not_the_slot(ours: LoadedModel) -> None:
    """The same tokens in scattered blocks give the same logits as in consecutive ones."""
    runner = ModelRunner(ours.model, torch.device("cpu"), torch.float32, kv_cache_bytes=64 * 2**20)
    ids = ours.tokenizer.encode(PROMPTS[5][0])
    blocks = runner.kv.num_blocks
    scattered = list(np.random.default_rng(0).permutation(np.arange(1, blocks))[:8])
    first = runner.forward([ChunkInput(ids, 0, list(range(1, 9)), True)])
    second = runner.forward([ChunkInput(ids, 0, [int(b) for b in scattered], True)])
    assert (first - second).abs().max() < 1e-4


def tiny_client(loaded: LoadedModel, kv_blocks: int, **config: int) -> tuple[TestClient, Engine]:
    """The app over an engine whose loop is not started: submitted jobs stay queued."""
    block = bytes_per_block(loaded.config, kv_dtype(loaded))
    engine = make_engine(loaded, start=False, kv_cache_bytes=kv_blocks * block, **config)
    state = WorkerState("cpu", "cpu", telemetry=engine.telemetry)
    state.attach(engine)
    return TestClient(create_app(state)), engine


def test_a_full_queue_answers_503_with_retry_after_on_both_apis(tiny: LoadedModel) -> None:
    client, engine = tiny_client(tiny, kv_blocks=64, max_running=1, max_queue=1)
    run(engine, "slotted", "the a of", 4)  # takes the one free slot (it is admitted when the loop runs)
    run(engine, "waiting", "the a of", 4)
    response = client.post("/execute", json={"job_id": "one-too-many", "prompt": "the", "max_tokens": 4})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["errors"][0]["field"] == "worker"
    assert "busy" in response.json()["errors"][0]["message"]
    response = client.post("/v1/completions", json={"model": tiny.model_id, "prompt": "the", "max_tokens": 4})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "server_busy"
    assert engine.stats().jobs_in_flight == 2  # only the jobs already accepted


def test_a_burst_faster_than_admission_fills_the_free_slots_before_the_queue(tiny: LoadedModel) -> None:
    """Jobs that arrive before the loop admits any of them are not refused while slots are free."""
    _, engine = tiny_client(tiny, kv_blocks=64, max_running=4, max_queue=1)
    for i in range(5):  # 4 free slots and 1 place in the queue
        run(engine, f"burst-{i}", "the a of", 4)
    with pytest.raises(QueueFull):
        run(engine, "one-too-many", "the a of", 4)
    assert engine.stats().jobs_in_flight == 5


def test_a_job_larger_than_the_whole_kv_pool_is_refused_with_400(tiny: LoadedModel) -> None:
    client, engine = tiny_client(tiny, kv_blocks=8)  # 7 usable blocks of 16 tokens
    response = client.post("/execute", json={"job_id": "huge", "prompt": "the a", "max_tokens": 200})
    assert response.status_code == 400
    error = response.json()["errors"][0]
    assert error["field"] == "max_tokens" and "--kv-cache-mb" in error["message"]
    assert error["constraint"] == f"prompt_tokens + max_tokens <= {7 * 16}"
    assert engine.stats().jobs_in_flight == 0



def test_a_long_prompts_rows_give_cache_hits_the_bits_of_a_miss(served: LoadedModel) -> None:
    """A prompt of 32 tokens or more has its own tokens computed as prompt rows: on a CPU with AMX-BF16 by a
    kernel of their own (csrc/amx_bf16.c), whose last bits are not the decoding rows'. So a cached block serves
    only a job that would compute it the same way: the same prompt again, and a conversation sent back with
    the answer in it, get exactly the log-probabilities a cold cache gives, batched or not."""
    prompt = served.tokenizer.encode(PROMPTS[5][0])
    assert len(prompt) >= 48

    def submit(engine: Engine, job_id: str, ids: list[int], max_tokens: int) -> Job:
        job = Job()
        request = GenerationRequest(job_id, None, max_tokens, GREEDY, logprobs=2, prompt_ids=tuple(ids))
        engine.submit(engine.prepare(request), job.emit)
        return job

    def logprobs(job: Job) -> list[dict]:
        job.wait()
        return [e for e in job.events if e["type"] == "logprob"]

    # One engine at a time: two would share the one C step's buffers.
    cached = make_engine(served, prefix_caching=True, max_batch_tokens=48)
    try:
        first = logprobs(submit(cached, "first", prompt, 16))
        # The conversation sent back: the prompt, the answer's very tokens, and more (blocks of the answer are cached).
        more = served.tokenizer.encode(" And then", add_special_tokens=False)
        follow = prompt + [e["token_id"] for e in first] + more
        specs = [("again", prompt, 16), ("follow", follow, 12), ("short", prompt[:20], 8)]
        hot = [logprobs(job) for job in [submit(cached, *spec) for spec in specs]]  # together
        hits = cached.stats().prefix_cache_hit_tokens
    finally:
        cached.stop()
    cold = make_engine(served, prefix_caching=False, max_batch_tokens=48)
    try:
        plain = [logprobs(submit(cold, *spec)) for spec in specs]  # one at a time
    finally:
        cold.stop()
    assert hits >= 3 * 16, "the prompt's blocks were reused"
    assert len(first) == 16 and first == hot[0] == plain[0]
    for spec, one, other in zip(specs, hot, plain, strict=True):
        assert one and one == other, spec[0]
