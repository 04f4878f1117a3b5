"""The probe the direct shm path's tests consult (tests/support/cma.py) tells a machine that
refuses copies between processes: tools/refuse_cross_process_copies.py stands in for a container
without CAP_SYS_PTRACE (a seccomp filter, as Docker's default profile has)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.engines import REPO

PROBE = "from tests.support.cma import cross_process_copies_refused as r; print(r() or 'allowed')"


def test_the_probe_tells_a_machine_that_refuses_copies_between_processes():
    refusing = [sys.executable, "tools/refuse_cross_process_copies.py"]
    probed = subprocess.run(
        [*refusing, sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert probed.returncode == 0, probed.stderr[-2000:]
    assert probed.stdout.startswith("process_vm_readv of another process refused here"), probed.stdout
    assert "Operation not permitted" in probed.stdout
