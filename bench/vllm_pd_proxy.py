"""Minimal P/D proxy for vLLM's own disaggregation (the baseline in bench/serve.py).

What vLLM's example proxy does, and nothing more: send the request to the prefill server with
max_tokens=1 and `kv_transfer_params={"do_remote_decode": true, ...}`, then send it to the decode
server with the `kv_transfer_params` the prefill returned, streaming the answer back. One prefill
and one decode server; no retries, no routing policy.

Usage: python bench/vllm_pd_proxy.py --prefill URL --decode URL --port N
"""

from __future__ import annotations

import argparse
import copy

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=httpx.Limits(max_connections=2048))

    @app.get("/v1/models")
    async def models():
        response = await client.get(decode + "/v1/models")
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    async def handle(request: Request, path: str):
        body = await request.json()
        prefill_body = copy.deepcopy(body)
        prefill_body.update(
            max_tokens=1,
            stream=False,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        first = await client.post(prefill + path, json=prefill_body)
        if first.status_code != 200:
            return Response(first.content, status_code=first.status_code, media_type="application/json")
        body["kv_transfer_params"] = first.json().get("kv_transfer_params")
        if not body.get("stream"):
            second = await client.post(decode + path, json=body)
            return Response(second.content, status_code=second.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", decode + path, json=body), stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return JSONResponse(status_code=upstream.status_code, content={"error": content.decode(errors="replace")})

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
