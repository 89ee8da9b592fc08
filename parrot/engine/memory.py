"""Memory: what this process may still take, what loading a model would take, and handing the
heap's free memory back to the OS."""

from __future__ import annotations

import ctypes
import os

from parrot.engine.source import ModelTooLargeError

# mallopt's parameter for the number of heaps ("arenas") glibc may create (malloc.h: M_ARENA_MAX)
_M_ARENA_MAX = -8


def release_free_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    glibc keeps freed chunks in the process unless asked. Loading frees copies it no longer needs
    (q and k rows reordered, then packed): 46 MB on a 1B Q4_K_M file. A KV cache is one
    allocation of up to tens of MB per request; once glibc has freed a chunk that large it raises
    its mmap threshold past it, so later caches come from the heap, and freed heap memory stays.
    Measured with ``make soak`` (1,824 requests in three soaks on one server): resident memory at
    idle read 667, 684 and 653 MB after each soak, 614, 618 and 618 MB once trimmed. The
    scheduler calls it when the engine goes idle, where it delays no pass (trimming 300 MB of
    freed heap takes about 30 ms), and loading calls it at its end. It returns all of the free
    memory only with one heap (:func:`share_one_heap`)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def share_one_heap() -> None:
    """Have every thread started from now on allocate from glibc's main heap (``mallopt
    M_ARENA_MAX`` 1). By default each thread gets a heap of its own, and ``malloc_trim`` hands
    back the free memory at the top of the main heap only: in another thread's heap it stays.
    The engine thread loads the model and runs every pass, so its KV caches and the buffers of
    its passes sat on top of the weights in such a heap; served, the embedded model's resident
    memory read 412 MB when ready and 428 MB at idle after 30 chat requests, against 409 MB with
    one heap (2026-11-25, AVX2 EPYC). One heap costs nothing measurable: the threads that
    allocate are Python threads, one at a time under the GIL; the kernels' workers allocate
    nothing. Called before the engine thread starts (threads that allocated already keep theirs)."""
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # not glibc
        pass


def available_bytes() -> int | None:
    """Memory this process can still take: MemAvailable, capped by a cgroup limit (None: unknown)."""
    values = []
    try:
        with open("/proc/meminfo") as f:
            values += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            if limit != "max":
                values.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(values) if values else None


def resident_bytes() -> int:
    """This process's resident memory (VmRSS; 0 where /proc is not there)."""
    try:
        with open("/proc/self/status") as f:
            line = next((line for line in f if line.startswith("VmRSS:")), "")
    except OSError:
        return 0
    return int(line.split()[1]) * 1024 if line else 0


def gguf_load_bytes(gguf_path: str, float32: bool) -> tuple[int, str]:
    """Bytes loading this GGUF takes at its peak, and how they were counted: its blocks
    (memory-mapped), and with ``float32`` its weights in float32 (the transformers path builds
    them once). Reads the header only."""
    from parrot.engine.source import ModelNotFoundError
    from parrot.gguf_file import GGUFFile

    try:
        gguf = GGUFFile(gguf_path)
        gguf.release_header()
        weights = sum(t.n_elements for t in gguf.tensors)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read {gguf_path}: {exc}") from exc
    how = "in float32 while loading, beside the file's blocks" if float32 else "in the file's blocks"
    return (4 * weights if float32 else 0) + os.path.getsize(gguf_path), f"{weights / 1e9:.2f}B weights {how}"


def check_fits(name: str, need: tuple[int, str] | None) -> None:
    """Raise ModelTooLargeError, before anything is loaded, when ``need`` (bytes, how counted)
    exceeds the memory available."""
    available = available_bytes()
    if need is None or available is None or need[0] <= available:
        return
    raise ModelTooLargeError(f"{name} needs about {need[0] / 2**30:.1f} GiB to load ({need[1]}); "
                             f"{available / 2**30:.1f} GiB is available")
