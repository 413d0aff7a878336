"""core.host.keep_freed_memory: a training step's freed blocks stay with the process instead
of being faulted in afresh (on a CPU half a fine-tune step's time was page faults)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trainyard.core.host import on_glibc

# A forward pass's shape: many blocks of a few MiB, all freed at the step's end. The page
# faults of ten such steps, in a fresh process (malloc's state is per process).
STEPS = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    if sys.argv[1] == "keep":
        from trainyard.core.host import keep_freed_memory
        print(keep_freed_memory())
    def step():
        blocks = [np.ones((1 + i % 4) << 17) for i in range(60)]  # 1-4 MiB each, 150 MiB
        return sum(b[0] for b in blocks)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    lines = [line for line in out if line]
    return lines[0] if mode == "keep" else "", int(lines[-1])


@pytest.mark.skipif(not on_glibc(), reason="glibc's malloc only")
def test_freed_blocks_are_reused_not_faulted_in_again() -> None:
    _, default = _faults("default")
    said, kept = _faults("keep")
    assert "keeps freed memory" in said
    # 150 MiB a step is ~38,000 pages: by default most are faulted in again every step
    assert default > 10 * 20_000, default
    assert kept < default / 20, (kept, default)


def test_off_glibc_malloc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainyard.core import host

    monkeypatch.setattr(host.os, "confstr", lambda name: "musl 1.2")
    assert host.keep_freed_memory() == "malloc left as it is (not glibc)"
