"""Facts about this host that need no torch: CPU model, bf16 and int8 support, available RAM.

Shared by training's decisions (``trainyard.training.placement``, ``trainyard.training.device``),
the doctor and the benchmarks.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), per /proc/cpuinfo."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def x86_without_vnni() -> bool:
    """Whether this is an x86 CPU without int8 dot-product instructions (AVX-VNNI,
    AVX512-VNNI, AMX-INT8): ONNX Runtime's uint8 x int8 kernels may saturate there."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False
    flags = _cpu_flags()
    return bool(flags) and not flags & {"avx_vnni", "avx512_vnni", "amx_int8"}


def proc_bytes(path: str, key: str) -> int | None:
    """The ``key:  N kB`` line of a /proc file (meminfo, status, smaps_rollup) in bytes;
    None where the file or the line cannot be read (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_ram() -> int:
    """Bytes of RAM available now (MemAvailable), or 0 when it cannot be read."""
    if (available := proc_bytes("/proc/meminfo", "MemAvailable")) is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


# glibc's malloc hands a freed block of 128 KiB+ back to the kernel (munmap, or a trim of the
# heap's top), so the next training step's activations fault in fresh zeroed pages. A
# Lite0 step at 160 px, batch 32, on one CPU thread: 700 ms of its 1,450 ms of CPU in the
# kernel, 205,000 page faults a step; with these settings no fault and 570 ms in all.
# (PyTorch's CPU tuning guide advises jemalloc or tcmalloc for the same reason; this needs
# no preload.) The cost: up to TRIM_KEEP of freed memory stays with the process, and
# every block comes from the heap: a fit with 128-image val passes peaked at 2.10 GB
# (2.24 with the defaults), one with 1,024-image passes at 12.2 (10.9).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # malloc.h
TRIM_KEEP = 1 << 30
TOP_PAD = 256 << 20


def on_glibc() -> bool:
    """Whether this process's C library is glibc (not macOS's, musl or Windows')."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # not a name, or no confstr (Windows)
        return False


def keep_freed_memory() -> str:
    """Tell glibc's malloc to keep freed memory for reuse instead of returning it to the
    kernel (see above); what was done, for the log. A no-op off glibc (macOS, musl)."""
    if not on_glibc():
        return "malloc left as it is (not glibc)"
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "malloc left as it is (libc.so.6 not found)"
    ok = all(
        libc.mallopt(option, value) == 1
        for option, value in (
            # No block from mmap: glibc would mmap (and munmap at free) any block above its
            # threshold's 32 MiB ceiling, and an eval batch's activations are larger.
            (M_MMAP_MAX, 0),
            (M_TRIM_THRESHOLD, TRIM_KEEP),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        return "malloc left as it is (mallopt refused)"
    return (
        f"glibc malloc keeps freed memory (every block on the heap, up to {TRIM_KEEP >> 30} GiB "
        "kept): no fresh pages to fault in every step"
    )
