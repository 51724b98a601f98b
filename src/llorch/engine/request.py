"""What crosses the api <-> engine boundary: plain requests in, plain events out. No tensors."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar, Literal

IGNORE_EOS = 1 << 31  # min_tokens that outlasts any job: generation ends at max_tokens or a stop sequence


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI-style penalties on tokens already generated (not the prompt).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # Added to the named tokens' logits before anything else (OpenAI's logit_bias): (token id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # End-of-generation tokens cannot be drawn before this many tokens are out (IGNORE_EOS: never).
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Constraint:
    """Output the job must match: a JSON schema (as JSON text), a regular expression or a Lark grammar.

    `field` is the request field it came from, so a grammar that does not compile is a 400 naming it.
    """

    kind: Literal["json_schema", "regex", "lark"]
    source: str
    field: str


@dataclass(frozen=True)
class ChatOptions:
    """How chat messages render: the generation prompt, or continuing the last (assistant) message instead;
    extra variables for the template (e.g. `enable_thinking`), as sorted (name, value) pairs."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """What an API asks the engine for: a prompt as text or token ids, or chat messages to render first."""

    job_id: str
    prompt: str | None
    # None: generate to an end-of-generation token or the end of the context; 0: only read (and score) the prompt.
    max_tokens: int | None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    # Report the chosen token's log-probability and this many top alternatives (None: off).
    logprobs: int | None = None
    # False for prompts that already carry their special tokens (rendered chat templates).
    add_special_tokens: bool = True
    # Chat messages ({"role", "content"}), rendered through the model's chat template instead of `prompt`.
    messages: tuple[dict[str, Any], ...] | None = None
    # Tool definitions handed to the chat template with the messages (OpenAI's `tools`, as the template reads them).
    tools: tuple[dict[str, Any], ...] | None = None
    chat_options: ChatOptions = field(default_factory=ChatOptions)
    # Constrained decoding: every generated token keeps the output a prefix of this grammar's language.
    constraint: Constraint | None = None
    # The prompt as token ids, used exactly as given (no special tokens added); `prompt` is then None.
    prompt_ids: tuple[int, ...] | None = None
    # Score the prompt: each prompt token's log-probability given the tokens before it, with this many
    # top alternatives (None: off). The first token has none.
    prompt_logprobs: int | None = None
    # A prompt-only job of an embedding or rerank model: its output is one pooled vector (or score), not
    # tokens. `pair` is a rerank pair's second text (the document); `truncate` cuts a text longer than the
    # model's context instead of refusing it.
    pooled: bool = False
    pair: str | None = None
    truncate: bool = False


@dataclass(frozen=True)
class PreparedJob:
    """A request the engine has tokenized and checked (Engine.prepare): ready to submit."""

    request: GenerationRequest
    prompt_ids: tuple[int, ...]
    max_tokens: int  # resolved: the request's, or what the context leaves
    grammar: Any = None  # the compiled constraint (engine.grammar.CompiledGrammar), when the request has one
    # BOS was put in front of token ids given without it: prompt_ids[0] is not the client's.
    added_bos: bool = False
    type_ids: tuple[int, ...] = ()  # a pooled job's segment of each token (an encoder's pair: 0 query, 1 document)

    def for_choice(self, job_id: str, sampling: SamplingParams) -> PreparedJob:
        """The same prompt as another job (one of an OpenAI request's n choices)."""
        return replace(self, request=replace(self.request, job_id=job_id, sampling=sampling))


class StopReason(str, Enum):
    MAX_TOKENS = "MAX_TOKENS"
    EOS = "EOS"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    CANCELLED = "CANCELLED"


class ErrorCode(str, Enum):
    VRAM_OOM = "VRAM_OOM"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    INFERENCE_FAILED = "INFERENCE_FAILED"


@dataclass(frozen=True)
class Event:
    """Base of the events one job produces; `to_dict` gives the wire form."""

    type: ClassVar[str]
    terminal: ClassVar[bool] = False  # exactly one terminal event ends every accepted job

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type}
        body.update({k: (v.value if isinstance(v, Enum) else v) for k, v in asdict(self).items()})
        return body


@dataclass(frozen=True)
class Started(Event):
    job_id: str
    model: str
    started_at: str

    type: ClassVar[str] = "started"


@dataclass(frozen=True)
class TokenText(Event):
    t: str
    i: int

    type: ClassVar[str] = "token"

    def to_dict(self) -> dict[str, Any]:  # the one event per token: built directly, not through asdict's copies
        return {"type": "token", "t": self.t, "i": self.i}


@dataclass(frozen=True)
class TokenLogprob(Event):
    """The log-softmax of the model's logits at one sampled token (only when asked for)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]

    type: ClassVar[str] = "logprob"


@dataclass(frozen=True)
class PromptLogprobs(Event):
    """Log-probabilities of prompt tokens `start`, `start` + 1, ... (only when asked), in prompt order.

    They all come before the job's first generated token.
    """

    start: int
    entries: tuple[TokenLogprob, ...]

    type: ClassVar[str] = "prompt_logprobs"


@dataclass(frozen=True)
class Pooled(Event):
    """A pooled job's output: its embedding, or its relevance score as one value; the `end` follows."""

    values: tuple[float, ...]
    prompt_tokens: int

    type: ClassVar[str] = "pooled"


@dataclass(frozen=True)
class Metrics(Event):
    tokens_per_sec: float
    vram_bytes: int

    type: ClassVar[str] = "metrics"


@dataclass(frozen=True)
class End(Event):
    tokens_out: int
    decode_time_ms: float
    stop_reason: StopReason
    stop_sequence_matched: str | None = None

    type: ClassVar[str] = "end"
    terminal: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        if body["stop_sequence_matched"] is None:
            del body["stop_sequence_matched"]
        return body


@dataclass(frozen=True)
class Error(Event):
    code: ErrorCode
    message: str

    type: ClassVar[str] = "error"
    terminal: ClassVar[bool] = True
