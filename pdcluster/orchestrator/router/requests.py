"""A client request before it reaches a replica: the body read within its size limit, validated
(4xx OpenAI-style error JSON for what the router or the P/D path cannot serve), and its prompt
size estimated for load balancing."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pdcluster.orchestrator.router.settings import RouterSettings

logger = logging.getLogger(__name__)

# Prompts up to this many characters (~1k tokens, ~1 ms) are tokenized on the event loop;
# longer ones in a thread (the fast tokenizer releases the GIL while it encodes).
INLINE_TOKENIZE_CHARS = 4096
MAX_JSON_DEPTH = 64  # OpenAI requests nest a few levels; deeper ones are refused, not recursed into
MAX_N = 64  # choices per request


def error_response(
    status: int, message: str, err_type: str, code: str | int | None = None, param: str | None = None
) -> JSONResponse:
    """OpenAI-style error body."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type, "param": param, "code": code or status}},
    )


class BadRequest(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        err_type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.param = param
        self.status = status
        self.err_type = err_type
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, str(self), self.err_type, self.code, self.param)


async def read_body(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object, read no further than `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"Request body exceeds {limit} bytes.", status=413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"Request body exceeds {limit} bytes.", status=413, code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("Request body is not valid UTF-8.") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(
            f"Request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from None
    except RecursionError:
        raise BadRequest(f"Request body nests deeper than {MAX_JSON_DEPTH} levels.") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise BadRequest(f"Request body is not usable JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object.")
    if _depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"Request body nests deeper than {MAX_JSON_DEPTH} levels.")
    return body


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def validate(body: dict[str, Any], kind: str, settings: RouterSettings) -> None:
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required.", param="model")
    if model != settings.model_name:
        raise BadRequest(
            f"The model '{model}' does not exist; this endpoint serves '{settings.model_name}'.",
            param="model",
            status=404,
            code="model_not_found",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean.", param="stream")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise BadRequest(f"'n' must be an integer from 1 to {MAX_N}.", param="n")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{key}' must be an integer.", param=key)
        if value < 1:
            raise BadRequest(f"'{key}' must be at least 1.", param=key)
        if settings.max_model_len and value > settings.max_model_len:
            raise BadRequest(
                f"'{key}' ({value}) exceeds the model's context length ({settings.max_model_len}).", param=key
            )
    if "kv_transfer_params" in body:
        raise BadRequest("'kv_transfer_params' is set by the router, not by clients.", param="kv_transfer_params")
    if kind == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is required.", param="prompt")
        if prompt == "" or prompt == [] or prompt == [[]]:
            raise BadRequest("'prompt' must not be empty.", param="prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list.", param="messages")


class PromptTokens:
    """Estimated prompt tokens, for load balancing only (the engine counts exactly).

    Counted with the model's tokenizer once it has loaded (in the background, from the router's
    start); until then, or if it does not load, estimated from the text's length. Long texts are
    tokenized off the event loop so that other streams keep flowing."""

    def __init__(self, tokenizer_path: str | None):
        self.tokenizer_path = tokenizer_path
        self.tokenizer = None
        self.loading: asyncio.Future | None = None

    def load_in_background(self) -> None:
        if self.tokenizer_path:
            self.loading = asyncio.get_running_loop().run_in_executor(None, self._load)

    async def count(self, body: dict[str, Any], kind: str) -> int:
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        else:
            text = json.dumps(body.get("messages"))
        tokenizer = self.tokenizer
        if tokenizer is None:
            return max(1, len(text) // 4)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return len(tokenizer(text)["input_ids"])
        return len((await asyncio.to_thread(tokenizer, text))["input_ids"])

    def _load(self) -> None:
        """Runs in a thread: importing transformers and loading a tokenizer takes seconds, which
        on the event loop would stall every request that arrived meanwhile."""
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        except (OSError, ValueError, ImportError) as exc:
            logger.warning(
                "router: tokenizer %s did not load (%s); prompt sizes are estimated from their length",
                self.tokenizer_path,
                exc,
            )
