"""Decode workers: vLLM engines acting as KV consumers (kv_role=kv_consumer), running MTP
speculative decoding with async scheduling where the platform allows it."""

from pdcluster.decode_worker.actor import DecodeWorker

__all__ = ["DecodeWorker"]
