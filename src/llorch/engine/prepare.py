"""The engine's front door: a request becomes a PreparedJob, or a RequestRejected naming the field.

Both APIs come in here: chat messages are rendered through the chat template into a
prompt, the prompt is tokenized, the job is checked against the prompt limit, the
context and the KV pool, and its output constraint, if any, is compiled. Nothing
else tokenizes or sizes a job.
"""

from __future__ import annotations

from dataclasses import replace

from llorch.engine.errors import RequestRejected
from llorch.engine.grammar import Grammars
from llorch.engine.request import ChatOptions, GenerationRequest, PreparedJob
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError
from llorch.weights.tokenizer import TokenizationError, Tokenizer

# A decoder reranker's prompt, as Qwen3-Reranker was trained: the answer is "yes" or "no".
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RANK_OPTIONS = ChatOptions(template_kwargs=(("enable_thinking", False),))


class FrontDoor:
    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate | None, ctx_size: int, pool_tokens: int,
                 max_prompt_tokens: int | None, grammars: Grammars | None, vocab_size: int, kind: str = "generate"
                 ) -> None:
        self.tokenizer = tokenizer
        self.kind = kind  # what the model is served for: "generate", "embed" or "rerank"
        self.vocab_size = vocab_size  # the model's: token ids at or past it have no embedding
        self.grammars = grammars
        self.chat_template = chat_template
        self.ctx_size = ctx_size
        self.pool_tokens = pool_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self._leading_bos = tokenizer.leading_bos

    @property
    def max_sequence_tokens(self) -> int:
        """The most prompt + generated tokens one job may hold: the context, or the whole KV pool."""
        return min(self.ctx_size, self.pool_tokens)

    def prepare(self, request: GenerationRequest) -> PreparedJob:
        self.check_kind(request)
        if request.pooled:
            return self.prepare_pooled(request)
        given: list[int] = []
        if request.messages is not None:
            # The template spells BOS itself.
            prompt, add_special = self.render_chat(request.messages, request.tools, request.chat_options), False
        elif request.prompt_ids is not None:
            prompt, add_special = None, False
        elif request.prompt is not None:
            prompt, add_special = request.prompt, request.add_special_tokens
        else:
            raise RequestRejected("prompt", "required", "a job needs a prompt or chat messages")
        if prompt is None:
            given = self.check_token_ids(request.prompt_ids or ())
            ids = self.with_bos(given)
        else:
            ids = self.encode(prompt, add_special, "messages" if request.messages is not None else "prompt")
        if not ids:
            raise RequestRejected("prompt", "at least one token", "the prompt is empty: it has no tokens",
                                  code="empty_prompt")
        self.check_logit_bias(request.sampling.logit_bias)
        max_tokens = request.max_tokens
        if max_tokens is None:  # as much as the context leaves
            max_tokens = max(1, self.max_sequence_tokens - len(ids))
        self.check_fits(len(ids), max_tokens)
        # Compiled after the cheap checks: a grammar can take a while, and the job may not fit anyway.
        grammar = self.grammars.compile(request.constraint) if request.constraint is not None else None  # type: ignore[union-attr]
        prepared = replace(request, prompt=prompt, add_special_tokens=add_special, messages=None, tools=None)
        added_bos = prompt is None and len(ids) > len(given)
        return PreparedJob(prepared, tuple(ids), max_tokens, grammar, added_bos=added_bos)

    def check_kind(self, request: GenerationRequest) -> None:
        """A generation request to an embedding or rerank model, or the reverse, is refused naming the model's kind."""
        wanted = ("rerank" if request.pair is not None else "embed") if request.pooled else "generate"
        if wanted == self.kind:
            return
        served = {"generate": "a generation model", "embed": "an embedding model (POST /v1/embeddings)",
                  "rerank": "a reranking model (POST /v1/rerank)"}[self.kind]
        asked = {"generate": "generate text", "embed": "embed text", "rerank": "rerank documents"}[wanted]
        raise RequestRejected("model", f"a {wanted} model", f"this worker serves {served}; it cannot {asked}",
                              code="model_kind_mismatch")

    def prepare_pooled(self, request: GenerationRequest) -> PreparedJob:
        """An input to embed or a pair to score: tokenized with the model's special tokens, within its context."""
        field = "input" if request.pair is None else "documents"
        if request.pair is not None and self.chat_template is not None:  # a decoder reranker: its yes/no prompt
            ids, types, length = self.rank_prompt(request.prompt or "", request.pair, request.truncate)
        elif request.prompt_ids is not None:
            ids, types = self.check_token_ids(request.prompt_ids, field), [0] * len(request.prompt_ids)
            length = len(ids)
            if request.truncate:
                ids, types = ids[: self.ctx_size], types[: self.ctx_size]
        else:
            try:
                ids, types, length = self.tokenizer.encode_for_pooling(
                    request.prompt or "", request.pair, self.ctx_size if request.truncate else None)
            except TokenizationError as exc:
                raise RequestRejected(field, "tokenizes with the model's tokenizer", str(exc)) from exc
        if not ids:
            raise RequestRejected(field, "at least one token", "an input is empty: it has no tokens",
                                  code="empty_prompt")
        if len(ids) > self.ctx_size:
            raise RequestRejected(field, f"<= {self.ctx_size} tokens", f"an input is {length} tokens; this model reads "
                                  f"at most {self.ctx_size} (ask for truncation to cut it)",
                                  code="context_length_exceeded")
        self.check_fits(len(ids), 0)  # --max-prompt-tokens
        return PreparedJob(request, tuple(ids), 0, type_ids=tuple(types))

    def rank_prompt(self, query: str, document: str, truncate: bool) -> tuple[list[int], list[int], int]:
        """A decoder reranker's prompt for a pair (Qwen3-Reranker's): the judge's instruction as the system turn,
        the query and document as the user's, the answer's start with thinking off. Truncation cuts the document."""
        for _ in range(4):  # a cut document can tokenize a little longer at its new end: cut again
            content = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
            messages = ({"role": "system", "content": RERANK_SYSTEM}, {"role": "user", "content": content})
            ids = self.encode(self.render_chat(messages, None, RANK_OPTIONS), False, "documents")
            if not truncate or len(ids) <= self.ctx_size:
                break
            kept = self.tokenizer.encode(document, add_special_tokens=False)
            document = self.tokenizer.decode(kept[: max(0, len(kept) - (len(ids) - self.ctx_size) - 1)])
        return ids, [0] * len(ids), len(ids)

    def encode(self, text: str, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        """The text's token ids; a tokenizer failure is this request's 400, not the server's error."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TokenizationError as exc:
            raise RequestRejected(field, "tokenizes with the model's tokenizer", str(exc)) from exc

    def check_token_ids(self, ids: tuple[int, ...], field: str = "prompt") -> list[int]:
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < self.vocab_size:
                raise RequestRejected(field, f"token ids in [0, {self.vocab_size})",
                                      f"token {position} of {field} is {token_id}, outside this model's "
                                      f"vocabulary of {self.vocab_size} tokens")
        return list(ids)

    def with_bos(self, ids: list[int]) -> list[int]:
        """Token ids as given, after the model's BOS when it starts every prompt with one and they do not.

        Evaluation harnesses send ids tokenized without special tokens; a model trained to see
        BOS first (Gemma, Llama) answers such prompts with noise.
        """
        bos = self._leading_bos
        return [bos, *ids] if bos is not None and ids and ids[0] != bos else ids

    def check_logit_bias(self, bias: tuple[tuple[int, float], ...]) -> None:
        for token_id, _ in bias:
            if not 0 <= token_id < self.vocab_size:
                raise RequestRejected("logit_bias", f"token ids in [0, {self.vocab_size})",
                                      f"logit_bias names token {token_id}, outside this model's vocabulary of "
                                      f"{self.vocab_size} tokens")

    def render_chat(self, messages: tuple[dict[str, object], ...], tools: tuple[dict[str, object], ...] | None = None,
                    options: ChatOptions | None = None) -> str:
        options = options or ChatOptions()
        if self.chat_template is None:
            raise RequestRejected("messages", "a chat template", "this model has no chat template; use "
                                  "/v1/completions or start the worker with --chat-template-file",
                                  code="chat_template_missing")
        continuing = options.continue_final_message
        try:
            prompt = self.chat_template.render(list(messages), options.add_generation_prompt and not continuing,
                                               tools=list(tools) if tools else None,
                                               extra=dict(options.template_kwargs))
        except ChatTemplateError as exc:
            raise RequestRejected("messages", "renders with the chat template", str(exc)) from exc
        return continued(prompt, messages[-1]) if continuing else prompt

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise RequestRejected(
                "prompt", f"<= {self.max_prompt_tokens} tokens",
                f"the prompt is {prompt_tokens} tokens; this worker accepts at most {self.max_prompt_tokens}",
                code="prompt_too_long")
        if prompt_tokens + max_tokens > self.ctx_size:
            raise RequestRejected(
                "max_tokens", f"prompt_tokens + max_tokens <= {self.ctx_size}",
                f"the prompt is {prompt_tokens} tokens; with max_tokens={max_tokens} it exceeds "
                f"the context size of {self.ctx_size} tokens", code="context_length_exceeded")
        if prompt_tokens + max_tokens > self.pool_tokens:
            raise RequestRejected(
                "max_tokens", f"prompt_tokens + max_tokens <= {self.pool_tokens}",
                f"the prompt is {prompt_tokens} tokens; with max_tokens={max_tokens} it needs more KV cache "
                f"than this worker's whole pool holds ({self.pool_tokens} tokens, see --kv-cache-mb)",
                code="context_length_exceeded")


def continued(prompt: str, final: dict[str, object]) -> str:
    """The rendered conversation cut right after the final message's text, so the model continues it."""
    text = final.get("content")
    if final.get("role") != "assistant" or not isinstance(text, str) or not text:
        raise RequestRejected("continue_final_message", "a final assistant message with text",
                              "continue_final_message needs the last message to be an assistant message with text")
    at = prompt.rfind(text)
    if at < 0:
        raise RequestRejected("continue_final_message", "the template keeps the final message's text",
                              "the chat template does not render the final message's text as given, so it "
                              "cannot be continued")
    return prompt[: at + len(text)]
