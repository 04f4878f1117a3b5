"""Prefill workers: vLLM engines acting as KV producers (kv_role=kv_producer)."""

from pdcluster.prefill_worker.actor import PrefillWorker

__all__ = ["PrefillWorker"]
