"""The cores tests bind engines to: the first two this process may run on, as strings for
cpu_bind and VLLM_CPU_OMP_THREADS_BIND. Not cores 0 and 1 by number: a machine's (a container's)
CPU set may leave them out, and binding to a core outside it fails."""

from __future__ import annotations

import os

ALLOWED = sorted(os.sched_getaffinity(0))
FIRST = str(ALLOWED[0])  # prefill's, and the reference engine's
SECOND = str(ALLOWED[1 % len(ALLOWED)])  # decode's (the same core where there is one)
