"""Giving a long-running worker's freed memory back to the operating system.

PyTorch's CPU tensors come from glibc's malloc, which keeps freed blocks for reuse: a training
worker's resident memory climbs to 2-3x what it really holds (measured on Office, TIGER, micro-batch
128: 2.2 GiB resident of which 1.5 GiB free after 4 optimizer steps in a thread, as Ray Train runs
the loop; ~5 GiB per worker over an epoch in a study), and two such workers on a 24 GiB machine with
other work beside them were killed by Ray's memory monitor. ``malloc_trim`` returns the free pages;
each call costs the page faults of re-touching them (trimming after every optimizer step cost 12%
more CPU), so :class:`MemoryReleaser` trims only when the resident size is above a soft limit, at most
once per ``min_interval_s``, plus once at each phase boundary (after training, after validation).
Elsewhere than glibc (macOS, musl) it does nothing.

The allocator itself is chosen for the processes that train (:func:`allocator_env`, set in their
environment at start): every step frees and re-allocates the same large tensors, and glibc serves
each block above 32 MB with a fresh ``mmap`` that it unmaps on free, so every step page-faults them
all in again (a TIGER CE + pairwise benchmark run spent ~40% of its CPU time in the kernel). tcmalloc keeps
them and returns free spans to the OS at its own pace, so under tcmalloc the releaser only acts at phase
boundaries (its periodic release cost APAO-pairwise 1.19x); where tcmalloc is not installed, glibc is told
to keep them (no mmap, no automatic trim), and the releaser returns what is free past its soft limit.
Measured in benchmarks/RESULTS.md.

A trial's memory cap (:class:`MemoryCap`) counts what the trial allocates past what its worker maps when the
trial starts: a worker with torch and Ray loaded maps 1-2.5 GiB before it trains (more under glibc, whose
per-thread arenas and thread stacks are counted as mapped), so a cap on the whole process meant a different
thing under each allocator and refused small trials under glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource  # POSIX only, as training/cost.py: Ray Train workers run on Linux and macOS
import time

SOFT_LIMIT_BYTES = int(1.5 * 2**30)
MIN_INTERVAL_S = 20.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


ALLOCATOR_ENV = "APAO_RAY_ALLOCATOR"  # the allocator of the processes that train (allocator_env)
ALLOCATORS = ("auto", "tcmalloc", "glibc-cached", "system")
TCMALLOC_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # Debian/Ubuntu: libtcmalloc-minimal4, conda: gperftools
GLIBC_CACHED = {"MALLOC_MMAP_MAX_": "0",  # large blocks from the heap, reused, not fresh mmaps
                "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),  # free heap top kept (the releaser trims)
                "MALLOC_TOP_PAD_": str(256 * 2**20)}  # the heap grows in 256 MB steps
# tcmalloc reports every allocation above 1 GB on stderr; a pairwise step makes several
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**50)}
_USER_ALLOCATOR_VARS = ("LD_PRELOAD", "GLIBC_TUNABLES")


def find_tcmalloc() -> str | None:
    """tcmalloc's shared library name (e.g. ``libtcmalloc_minimal.so.4``) when the dynamic linker
    finds it on this machine, else None."""
    for name in TCMALLOC_LIBRARIES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def allocator_env(choice: str | None = None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that give a process started with them the allocator ``choice``
    (default ``$APAO_RAY_ALLOCATOR``, else ``auto``).

    ``auto``: tcmalloc where installed, else glibc keeping its large blocks (``glibc-cached``); nothing
    when the environment already sets the allocator (``LD_PRELOAD``, ``GLIBC_TUNABLES`` or a
    ``MALLOC_*`` variable: the user's own choice wins). ``tcmalloc``: refused where not installed.
    ``system``: nothing (glibc's defaults, as before this setting existed).
    """
    environ = os.environ if environ is None else environ
    choice = choice or environ.get(ALLOCATOR_ENV) or "auto"
    if choice not in ALLOCATORS:
        raise ValueError(f"{ALLOCATOR_ENV}={choice!r} is not an allocator; choose one of {', '.join(ALLOCATORS)}")
    user_set = any(key in _USER_ALLOCATOR_VARS or key.startswith("MALLOC_") for key in environ)
    if choice == "system" or (choice == "auto" and user_set):
        return {}
    if choice in ("auto", "tcmalloc"):
        tcmalloc = find_tcmalloc()
        if tcmalloc:
            preload = " ".join(filter(None, (environ.get("LD_PRELOAD"), tcmalloc)))
            return {"LD_PRELOAD": preload, **TCMALLOC_QUIET}
        if choice == "tcmalloc":
            raise ValueError(f"{ALLOCATOR_ENV}=tcmalloc but no tcmalloc library is installed (looked for "
                             f"{', '.join('lib' + name for name in TCMALLOC_LIBRARIES)}): install it "
                             "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4) or choose auto")
    return dict(GLIBC_CACHED)


def allocator_in_use() -> str:
    """The allocator this process runs on: ``tcmalloc``, ``glibc-cached`` or ``system``."""
    if _TCMALLOC_RELEASE is not None:
        return "tcmalloc"
    return "glibc-cached" if os.environ.get("MALLOC_MMAP_MAX_") == "0" else "system"


def _symbol(library: str | None, name: str):
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


def _release_function():
    """A no-argument call that returns the allocator's free pages to the OS, or None."""
    if _TCMALLOC_RELEASE is not None:
        return _TCMALLOC_RELEASE
    malloc_trim = _symbol(ctypes.util.find_library("c") or "libc.so.6", "malloc_trim")
    return None if malloc_trim is None else lambda: malloc_trim(0)


_TCMALLOC_RELEASE = _symbol(None, "MallocExtension_ReleaseFreeMemory")  # only when tcmalloc is loaded
_TRIM = _release_function()


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux), else None."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (``VmData``, ``VmHWM``) in bytes (Linux), else None."""
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


class MemoryCap:
    """Caps what this process allocates from now on at ``max_bytes`` past what it maps now.

    Enforced by the kernel on the data segment (RLIMIT_DATA at today's ``VmData`` + ``max_bytes``): heap, tensors,
    thread stacks and anything else mapped private and writable, counted when allocated, touched or not. An
    allocation past it fails at once (torch: "can't allocate memory", Python: MemoryError), so the trial fails as
    out of memory instead of the node's OOM killer taking down whatever it picks. A resident-memory watchdog would
    only act between steps, after a step's peak had already been taken from the machine.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"memory cap {max_bytes} bytes must be > 0")
        self.max_bytes = max_bytes
        self.start_bytes = _status_bytes("VmData")
        if self.start_bytes is None:  # no /proc (macOS): the cap is Ray's reservation alone
            return
        try:  # the resident high-water mark from here on (a reused worker process carries its last trial's)
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass
        self.start_resident = resident_bytes() or 0
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = self.start_bytes + max_bytes
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))

    def describe(self) -> str:
        """The cap, what the trial held of it now (where an allocation failed) and its resident peak, e.g.
        ``memory cap 2.50 GiB: 2.45 GiB allocated past the worker's 2.53 GiB at the trial's start, resident peak +2.45 GiB``."""
        gib = 2**30
        text = f"memory cap {self.max_bytes / gib:.2f} GiB"
        now, peak = _status_bytes("VmData"), _status_bytes("VmHWM")
        if self.start_bytes is None or now is None:
            return text
        text += (f": {(now - self.start_bytes) / gib:.2f} GiB allocated past the worker's {self.start_bytes / gib:.2f} GiB "
                 "at the trial's start")
        if peak is not None:
            text += f", resident peak +{max(0, peak - self.start_resident) / gib:.2f} GiB"
        return text


def release_free_memory() -> bool:
    """Returns the allocator's free pages to the OS; False where that is not possible."""
    if _TRIM is None:
        return False
    _TRIM()
    return True


class MemoryReleaser:
    """Call :meth:`step` often (e.g. after every optimizer step); it trims when the resident size
    exceeds ``soft_limit_bytes``, rate-limited to one trim per ``min_interval_s``."""

    def __init__(self, soft_limit_bytes: int = SOFT_LIMIT_BYTES, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.soft_limit_bytes, self.min_interval_s = soft_limit_bytes, min_interval_s
        self._last = -float("inf")
        self.releases = 0

    def step(self) -> None:
        now = time.monotonic()
        # tcmalloc returns free spans to the OS on its own (TCMALLOC_RELEASE_RATE): releasing all of them
        # every 20 s only made the next steps fault them in again (APAO-pairwise ran 1.19x slower, RESULTS.md)
        if _TRIM is None or _TCMALLOC_RELEASE is not None or now - self._last < self.min_interval_s:
            return
        rss = resident_bytes()
        if rss is not None and rss > self.soft_limit_bytes:
            self.release(now)

    def release(self, now: float | None = None) -> None:
        if release_free_memory():
            self.releases += 1
            self._last = time.monotonic() if now is None else now
