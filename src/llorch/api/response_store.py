"""Stored responses (`store: true`, the default): what `previous_response_id`, GET and DELETE read.

In memory, bounded both in count and in bytes; the oldest response goes first when either
bound is reached. Each entry is kept as JSON bytes: its size is exact, and nothing a
later request does can change what was stored.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("llorch.api")

MAX_STORED_RESPONSES = 1000
MAX_STORED_BYTES = 64 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # its input items, the earlier turns' included (instructions are not)


class ResponseStore:
    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        text = json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        if len(text) > self.max_bytes:  # it would evict everything and still not fit
            log.warning("response too large to store", extra={"job_id": response["id"], "bytes": len(text)})
            return
        self.delete(response["id"])
        self._entries[response["id"]] = text
        self.bytes += len(text)
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= len(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        text = self._entries.get(response_id)
        if text is None:
            return None
        entry = json.loads(text)
        return StoredResponse(entry["response"], entry["conversation"])

    def delete(self, response_id: str) -> bool:
        text = self._entries.pop(response_id, None)
        if text is None:
            return False
        self.bytes -= len(text)
        return True
