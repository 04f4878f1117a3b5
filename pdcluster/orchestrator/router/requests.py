"""A client request before it reaches a replica: the body read within its size limit, validated
(4xx OpenAI-style error JSON for what the router or the P/D path cannot serve), and its prompt
size estimated for load balancing."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from pdcluster.errors import openai_error
from pdcluster.orchestrator.router.cache_index import Prompt
from pdcluster.orchestrator.router.continuation import COMPLETIONS_DEFAULT_MAX_TOKENS
from pdcluster.orchestrator.router.settings import RouterSettings

logger = logging.getLogger(__name__)

# Prompts up to this many characters (~1k tokens, ~1 ms) are tokenized on the event loop;
# longer ones in a thread (the fast tokenizer releases the GIL while it encodes).
INLINE_TOKENIZE_CHARS = 4096
MAX_JSON_DEPTH = 64  # OpenAI requests nest a few levels; deeper ones are refused, not recursed into
MAX_N = 64  # choices per request
MAX_REQUEST_ID_CHARS = 256  # a client's own request id, passed to the engines (longer: the router's own)


def error_response(
    status: int, message: str, err_type: str, code: str | int | None = None, param: str | None = None
) -> JSONResponse:
    """OpenAI-style error body."""
    return JSONResponse(status_code=status, content=openai_error(message, err_type, code or status, param))


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
        body = json.loads(text, parse_constant=_not_a_number, parse_float=_finite)
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


def _not_a_number(token: str) -> float:
    """NaN and Infinity: Python's JSON reads them, no engine request may carry them."""
    raise ValueError(f"{token} is not a JSON number")


def _finite(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"the number {token[:20]} is out of range")
    return value


def prompt_count(body: dict[str, Any], kind: str) -> int:
    """How many prompts the request holds: a completion's prompt may be a list of them."""
    prompt = body.get("prompt") if kind == "completions" else None
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return 1


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


# Keys of vllm_xargs (a request's extra_args) that vLLM's engine reads as KV controls
# (vllm/v1/request.py), bypassing the check on kv_transfer_params above: transfer params would reach
# the engines' KV connectors unchecked (a string there failed the request with a 500), and a "full" KV cache
# report mode re-publishes each prefix-cache hit as blocks stored, which the router's cache index
# would count as held after their eviction.
RESERVED_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


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
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):  # null: not streamed (OpenAI's, vLLM's)
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
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise BadRequest("'min_tokens' must be a non-negative integer.", param="min_tokens")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is None and kind == "completions":
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS  # the protocol's own: vLLM refuses more min_tokens
        if limit is not None and min_tokens > limit:
            raise BadRequest(
                f"'min_tokens' ({min_tokens}) must not exceed the output limit ({limit}).", param="min_tokens"
            )
    if not isinstance(body.get("stream_options") or {}, dict):
        raise BadRequest("'stream_options' must be an object.", param="stream_options")
    if "kv_transfer_params" in body:
        raise BadRequest("'kv_transfer_params' is set by the router, not by clients.", param="kv_transfer_params")
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise BadRequest("'vllm_xargs' must be an object.", param="vllm_xargs")
    for key in RESERVED_XARGS:
        if key in (xargs or {}):
            raise BadRequest(f"'vllm_xargs.{key}' is set by the cluster, not by clients.", param="vllm_xargs")
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


# Chat fields that change how the engine renders messages in ways the router does not repeat.
CUSTOM_RENDERING = ("chat_template", "chat_template_kwargs", "tools", "documents", "mm_processor_kwargs")


def _text_messages(messages: Any) -> list[dict[str, Any]] | None:
    """Chat messages with text content only, list-of-parts content joined as vLLM joins text
    parts for string templates ("\n"); None when a message holds anything else."""
    if not isinstance(messages, list):
        return None
    out = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                return None
            message = {**message, "content": "\n".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            return None
        out.append(message)
    return out


class PromptTokens:
    """A request's prompt tokens: for load balancing, and their ids for cache-aware routing.

    Tokenized with the model's tokenizer once it has loaded (in the background, from the router's
    start) as vLLM's frontend does: a completion's text with the special tokens (unless the
    request says otherwise), a chat's messages through the model's chat template. Until the
    tokenizer loads, or for what the router cannot render as the engine would (several prompts,
    non-text parts, tools, a request's own template), only their count, estimated from the
    text's length. Long texts are tokenized off the event loop so that other streams keep flowing."""

    def __init__(self, tokenizer_path: str | None):
        self.tokenizer_path = tokenizer_path
        self.tokenizer = None
        self.loading: asyncio.Future | None = None

    def load_in_background(self) -> None:
        if self.tokenizer_path:
            self.loading = asyncio.get_running_loop().run_in_executor(None, self._load)

    async def prompt(self, body: dict[str, Any], kind: str) -> Prompt:
        ids = await self.ids(body, kind)
        if ids is not None:
            salt = body.get("cache_salt")
            return Prompt(ids, len(ids), cache_salt=salt if isinstance(salt, str) and salt else None)
        return Prompt(None, await self.count(body, kind))

    async def ids(self, body: dict[str, Any], kind: str) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None (see the class docstring)."""
        tokenizer = self.tokenizer
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)
            if tokenizer is None or not isinstance(prompt, str):
                return None
            special = body.get("add_special_tokens", True) is not False
            return await self._encode(prompt, special)
        messages = _text_messages(body.get("messages"))
        if tokenizer is None or messages is None or any(body.get(k) for k in CUSTOM_RENDERING):
            return None
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True) is not False,
                continue_final_message=bool(body.get("continue_final_message")),
            )
        except Exception as exc:  # noqa: BLE001 - any template failure: the engine answers it; we route blind
            logger.debug("router: chat template failed (%s); routing without the prompt's ids", exc)
            return None
        return await self._encode(text, body.get("add_special_tokens") is True)

    async def _encode(self, text: str, special: bool) -> list[int]:
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]
        encoded = await asyncio.to_thread(self.tokenizer, text, add_special_tokens=special)
        return encoded["input_ids"]

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
