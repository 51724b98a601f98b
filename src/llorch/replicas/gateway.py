"""The cluster's front: one HTTP surface over many engine replicas.

Every request but /health and /metrics is relayed whole to one replica, which answers it with the
worker's own app. The front adds only what one worker cannot know:
- where to send it (the router: prefix affinity, then least loaded);
- a busy replica's 503 with Retry-After goes to another replica, until each was tried;
- a replica that vanishes before answering: the request goes to another; after it began
  streaming: the stream ends with one terminal error event in its API's framing;
- /cancel goes to the replica holding the job; /health and /metrics gather every replica's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llorch.api.body import BadRequest, read_body
from llorch.api.errors import RETRY, OpenAIError, error_for_path, family_of, worker_error, worker_errors
from llorch.api.streaming import NDJSON, SSE, frame, sse
from llorch.replicas.directory import known_replicas
from llorch.replicas.relay import RelayedRequest, RelayedStart, lenient_json, routing_text

log = logging.getLogger("llorch.replicas")

CONTROL_TIMEOUT_S = 3.0  # a replica's /health, /metrics or /cancel answer, or it counts as gone
REPLICA_HEADER = "X-Llorch-Replica"  # names the replica that answered (for operators and tests)
VANISHED_RETRIES = 2  # a request whose replica died before answering is sent again this often
STATUS_ORDER = ("healthy", "draining", "loading", "unhealthy")  # the cluster is the best of its replicas


class ReplicaGone(Exception):
    """The replica died or became unreachable before it answered."""


class Gateway:
    def __init__(self, engines: DeploymentHandle, engine_deployment: str) -> None:
        self.engines = engines
        self.engine_deployment = engine_deployment
        self.jobs: dict[str, str] = {}  # worker API job_id -> the replica streaming it
        self.registry = CollectorRegistry()
        self.retries = Counter("llorch_front_retries", "Requests sent again to another replica, by reason",
                               ["reason"], registry=self.registry)
        self.lost_streams = Counter("llorch_front_lost_streams",
                                    "Streams ended with an error event because their replica died",
                                    registry=self.registry)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/health":
            return JSONResponse(await self.health())
        if request.method == "GET" and path == "/metrics":
            return Response(await self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")
        try:
            body = await read_body(request)
        except BadRequest as exc:  # too large: refused here, in the worker's words and its API's shape
            if family_of(path) == "worker":
                return worker_errors(exc.status, exc.errors)
            return error_for_path(path, exc.status, exc.errors[0]["message"])
        parsed = lenient_json(body) if body else None
        call = RelayedRequest(
            method=request.method, path=path, query=request.url.query.encode(), body=body,
            headers=tuple((k, v) for k, v in request.headers.items() if k not in ("host", "content-length")),
            client=(request.client.host, request.client.port) if request.client else None,
            routing_text=routing_text(path, parsed))
        if path == "/cancel" and isinstance(parsed, dict) and isinstance(parsed.get("job_id"), str):
            holder = self.jobs.get(parsed["job_id"])
            if holder:  # "" while the job is still being placed: any replica answers
                call = replace(call, pin=holder)
        job_id = parsed.get("job_id") if path == "/execute" and isinstance(parsed, dict) else None
        if not isinstance(job_id, str):
            return await self.relay(call, None)
        # job_id is unique among the cluster's jobs in flight, as it is in one worker: reserved here
        # before any replica sees it, held while its stream lasts.
        if job_id in self.jobs:
            return worker_error(409, "job_id", "unique among jobs in flight",
                                f"job {job_id[:200]} is already queued or running")
        self.jobs[job_id] = ""
        try:
            response = await self.relay(call, job_id)
        except BaseException:
            self.jobs.pop(job_id, None)
            raise
        if not isinstance(response, StreamingResponse):  # refused: the stream never began
            self.jobs.pop(job_id, None)
        return response

    # -- relaying ------------------------------------------------------------------------------
    async def relay(self, call: RelayedRequest, job_id: str | None) -> Response:
        busy: list[str] = []
        vanished = 0
        while True:
            try:
                start, stream = await self._open(replace(call, avoid=tuple(busy)))
            except ReplicaGone as exc:
                if vanished < VANISHED_RETRIES and call.pin is None:
                    vanished += 1
                    self.retries.labels(reason="replica_gone").inc()
                    await asyncio.sleep(0.2)  # let the router hear of the death
                    continue
                return unavailable(call.path, f"no replica could answer: {exc}")
            if start.status == 503 and start.header("retry-after") and call.pin is None:
                rest = await _drain(stream)
                untried = set(known_replicas(self.engine_deployment)) - {*busy, start.replica}
                if untried:
                    busy.append(start.replica)
                    self.retries.labels(reason="busy").inc()
                    continue
                return Response(rest, start.status, headers=_headers(start))
            if job_id is not None:
                self.jobs[job_id] = start.replica  # until its stream ends (_body)
            return StreamingResponse(self._body(call.path, start, stream, job_id), start.status,
                                     headers=_headers(start))

    async def _open(self, call: RelayedRequest) -> tuple[RelayedStart, DeploymentResponseGenerator]:
        stream = self.engines.options(stream=True).relay.remote(call)
        try:
            first = await (asyncio.wait_for(stream.__anext__(), CONTROL_TIMEOUT_S) if call.pin
                           else stream.__anext__())
        except (RayError, StopAsyncIteration, asyncio.TimeoutError) as exc:
            stream.cancel()
            raise ReplicaGone(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
        except asyncio.CancelledError:  # the client went away before the answer began: so does the job
            stream.cancel()
            raise
        assert isinstance(first, RelayedStart)
        return first, stream

    async def _body(self, path: str, start: RelayedStart, stream: DeploymentResponseGenerator,
                    job_id: str | None) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        except RayError:
            finished = True
            self.lost_streams.inc()
            log.warning("a replica died while streaming", extra={"replica": start.replica, "path": path})
            yield lost_stream_ending(path, start.header("content-type") or "")
        finally:
            if job_id is not None:
                self.jobs.pop(job_id, None)
            if not finished:  # the client went away: the replica cancels the job
                stream.cancel()

    # -- what the front gathers from every replica -----------------------------------------------
    async def _each_replica(self, method: str) -> list[Any]:
        replicas = known_replicas(self.engine_deployment)
        if not replicas:  # the router learns the replicas on its first call
            await self._ask(method, None)
            replicas = known_replicas(self.engine_deployment)
        # One at a time: Ray Serve gives every call made while serving one request the same internal id,
        # and its router can hand a replica to the wrong one of two such calls routed at once.
        answers = [await self._ask(method, r) for r in replicas]
        return [a for a in answers if a is not None]

    async def _ask(self, method: str, replica: str | None) -> Any:
        call = RelayedRequest("GET", "", b"", (), b"", pin=replica)
        try:
            return await asyncio.wait_for(getattr(self.engines, method).remote(call), CONTROL_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError):
            return None

    async def health(self) -> dict[str, Any]:
        replicas = sorted(await self._each_replica("health"), key=lambda h: h["replica"])
        statuses = [h["status"] for h in replicas]
        # No answer at all: still starting when no replica was ever known, else every known one is down.
        silent = "unhealthy" if known_replicas(self.engine_deployment) else "loading"
        status = next((s for s in STATUS_ORDER if s in statuses), silent)
        first = replicas[0] if replicas else {}
        return {"status": status, "vram_bytes": sum(h["vram_bytes"] for h in replicas),
                "backend": first.get("backend", ""), "device": first.get("device", ""),
                "model": first.get("model", ""), "replicas": replicas}

    async def metrics(self) -> bytes:
        return merge_expositions(await self._each_replica("metrics")) + generate_latest(self.registry)


def _headers(start: RelayedStart) -> dict[str, str]:
    headers = {k: v for k, v in start.headers if k.lower() not in ("content-length", "transfer-encoding")}
    headers[REPLICA_HEADER] = start.replica
    return headers


async def _drain(stream: DeploymentResponseGenerator) -> bytes:
    try:
        return b"".join([chunk async for chunk in stream])
    except RayError:
        return b""


def lost_stream_ending(path: str, content_type: str) -> bytes:
    """The one terminal event a stream gets when its replica dies mid-way, in its own framing."""
    message = "the replica serving this job stopped; the job is lost (retry it)"
    family = family_of(path)
    if family != "worker":
        if family != "openai" or not content_type.startswith(SSE):
            return b""  # a plain JSON answer cut short: the connection closes
        body = OpenAIError(503, message, code="replica_lost", kind="server_error").body()
        return sse(body) + b"data: [DONE]\n\n"
    media = NDJSON if content_type.startswith(NDJSON) else SSE
    return frame(media, {"type": "error", "code": "INFERENCE_FAILED", "message": message})


def unavailable(path: str, message: str) -> Response:
    return error_for_path(path, 503, message, code="unavailable", field="worker", constraint="a replica to answer",
                          headers=RETRY)


def merge_expositions(answers: list[dict[str, str]]) -> bytes:
    """Every replica's Prometheus text as one exposition: each family once, with every replica's
    samples under it, each sample labelled with its replica."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for answer in answers:
        label = f'replica="{answer["replica"]}"'
        family = ""
        for line in answer["text"].splitlines():
            if line.startswith("# "):  # "# HELP name ..." or "# TYPE name ..." opens a family
                family = line.split(" ", 3)[2]
                if family not in samples:
                    headers.setdefault(family, []).append(line)
            elif line:
                samples.setdefault(family, []).append(_with_label(line, label))
    lines = [line for family in headers for line in (*headers[family], *samples.get(family, []))]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _with_label(sample: str, label: str) -> str:
    name_end = next((i for i, c in enumerate(sample) if c in "{ "), len(sample))
    if sample[name_end:name_end + 2] == "{}":
        return f"{sample[:name_end]}{{{label}}}{sample[name_end + 2:]}"
    if sample[name_end:name_end + 1] == "{":
        return f"{sample[:name_end]}{{{label},{sample[name_end + 1:]}"
    return f"{sample[:name_end]}{{{label}}}{sample[name_end:]}"
