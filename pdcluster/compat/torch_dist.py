"""torch.distributed privates: standalone process groups for the collective KV transport
(kv_transfer/transports/collective.py). Shape-checked, not version-gated: torch differs by
hardware (CPU, CUDA, torch_npu), and none of this is vLLM's.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

from pdcluster.addresses import binds_every_address
from pdcluster.compat.guard import expect_attributes, resolve

C10D = "torch.distributed.distributed_c10d"
GLOO_CLASS_ATTRS = ("_Options", "create_device", "create_default_device")
GLOO_OPTION_ATTRS = ("_timeout", "_devices")


def gloo_options() -> tuple[Any, Any]:
    """ProcessGroupGloo and a fresh `_Options()`, both shape-checked (see gloo_pair_group)."""
    group_cls = resolve(C10D, "ProcessGroupGloo", vllm=False)
    expect_attributes(group_cls, f"{C10D}.ProcessGroupGloo", GLOO_CLASS_ATTRS)
    options = group_cls._Options()
    expect_attributes(options, f"{C10D}.ProcessGroupGloo._Options()", GLOO_OPTION_ATTRS)
    return group_cls, options


def gloo_pair_group(store: Any, rank: int, size: int, timeout: timedelta, host: str):
    """A standalone gloo process group of `size` ranks bound to `host` ("" or a wildcard: gloo's
    default device), never the default group.

    Upstream (torch): `ProcessGroupGloo._Options()` with `._timeout` and `._devices`, and
    `ProcessGroupGloo.create_device(hostname=)` / `create_default_device()`: torch's public
    `new_group` only builds groups under the default process group, which a KV pair between two
    engines must not touch."""
    group_cls, options = gloo_options()
    options._timeout = timeout
    options._devices = [
        group_cls.create_default_device() if binds_every_address(host) else group_cls.create_device(hostname=host)
    ]
    return group_cls(store, rank, size, options)


def options_with_timeout(group_cls: Any, symbol: str, timeout: timedelta) -> Any:
    """`group_cls.Options()` with its private `_timeout` set (NCCL and HCCL groups)."""
    expect_attributes(group_cls, symbol, ["Options"])
    options = group_cls.Options()
    expect_attributes(options, f"{symbol}.Options()", ["_timeout"])
    options._timeout = timeout
    return options


def nccl_pair_group(store: Any, rank: int, size: int, timeout: timedelta):
    """A standalone NCCL group. Upstream (torch): `ProcessGroupNCCL.Options()._timeout` (why: as
    gloo_pair_group; CUDA builds of torch only)."""
    group_cls = resolve(C10D, "ProcessGroupNCCL", vllm=False)
    return group_cls(store, rank, size, options_with_timeout(group_cls, f"{C10D}.ProcessGroupNCCL", timeout))


def hccl_pair_group(store: Any, rank: int, size: int, timeout: timedelta):
    """A standalone HCCL group. Upstream (torch_npu, Ascend hosts only):
    `torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()._timeout` (why: as gloo_pair_group)."""
    importlib.import_module("torch_npu")  # registers the NPU device and HCCL
    symbol = "torch_npu._C._distributed_c10d.ProcessGroupHCCL"
    group_cls = resolve("torch_npu._C._distributed_c10d", "ProcessGroupHCCL", vllm=False)
    return group_cls(store, rank, size, options_with_timeout(group_cls, symbol, timeout))
