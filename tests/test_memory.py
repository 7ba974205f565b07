"""A training worker gives malloc's free pages back to the OS (training/memory.py)."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from apao_ray.training import memory

needs_glibc = pytest.mark.skipif(memory._TRIM is None or memory.resident_bytes() is None,
                                 reason="malloc_trim and /proc are glibc/Linux only")

# freed tensors stay resident: one big free raises glibc's mmap threshold, so the 2 MB blocks come from
# the heap; the last one stays alive so the heap's top cannot shrink by itself
_FRAGMENT = textwrap.dedent("""
    import json, sys, threading
    import torch
    from apao_ray.training import memory

    def work(out):
        torch.ones(8 * 2**20 // 4); blocks = [torch.ones(2**19) for _ in range(300)]  # 300 x 2 MB
        keep = blocks[-1]; del blocks
        out["freed"] = memory.resident_bytes()  # the ~600 MB freed, still resident
        out["released"] = memory.release_free_memory()
        out["trimmed"] = memory.resident_bytes()
        out["keep"] = float(keep[0])
        out["allocator"] = memory.allocator_in_use()

    out = {}
    thread = threading.Thread(target=work, args=(out,)); thread.start(); thread.join()  # as in a Ray Train worker
    print(json.dumps(out))
""")


needs_tcmalloc = pytest.mark.skipif(memory.find_tcmalloc() is None, reason="tcmalloc is not installed")
ALLOCATORS = ["system", "glibc-cached", pytest.param("tcmalloc", marks=needs_tcmalloc)]


def _env(allocator: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "LD_PRELOAD", memory.ALLOCATOR_ENV))}
    return {**clean, **memory.allocator_env(allocator, clean)}


def _run(script: str, allocator: str) -> dict:
    """Runs ``script`` in a new process on ``allocator``; returns the JSON it printed last."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=_env(allocator))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_glibc
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_free_blocks_stay_resident_until_released(allocator):
    run = _run(_FRAGMENT, allocator)
    assert run["allocator"] == allocator
    # the freed blocks stayed resident until the trim gave them back
    assert run["released"] and run["freed"] - run["trimmed"] > 400 * 2**20


_RELEASER = textwrap.dedent("""
    import json
    from apao_ray.training import memory

    releaser = memory.MemoryReleaser(soft_limit_bytes=0, min_interval_s=3600)
    releaser.step(); releaser.step()
    high = memory.MemoryReleaser(soft_limit_bytes=2**62, min_interval_s=0)
    high.step()
    below = high.releases
    high.release()
    print(json.dumps({"periodic": releaser.releases, "below": below, "explicit": high.releases,
                      "allocator": memory.allocator_in_use()}))
""")


@needs_glibc
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_releaser_trims_above_its_soft_limit_at_most_once_per_interval_except_under_tcmalloc(allocator):
    """glibc keeps what is freed: trimmed above the soft limit, at most once per interval. tcmalloc returns
    free spans by itself, and a periodic release of all of them only made the next steps fault them in again
    (APAO-pairwise 1.19x faster without): there only the explicit releases at phase boundaries remain."""
    run = _run(_RELEASER, allocator)
    assert run["allocator"] == allocator
    assert run["periodic"] == (0 if allocator == "tcmalloc" else 1)
    assert run["below"] == 0 and run["explicit"] == 1  # below the limit no trim; an explicit release always


# every step of a training loop frees and re-allocates tensors of tens of MB
_REALLOCATE = textwrap.dedent("""
    import json, resource
    import torch
    from apao_ray.training import memory

    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(12):  # warm-up: glibc's heap takes ~8 rounds to settle into reusing the freed block
        torch.ones(16 * 2**20)  # 64 MB filled and freed
    start = faults()
    for _ in range(20):
        torch.ones(16 * 2**20)
    print(json.dumps({"faults": faults() - start, "allocator": memory.allocator_in_use()}))
""")


@functools.lru_cache(maxsize=None)  # the system allocator's count is every caching allocator's baseline
def _reallocation_faults(allocator: str) -> dict:
    return _run(_REALLOCATE, allocator)


@needs_glibc
@pytest.mark.parametrize("allocator", ["glibc-cached", pytest.param("tcmalloc", marks=needs_tcmalloc)])
def test_a_caching_allocator_reuses_large_blocks_without_page_faults(allocator):
    """glibc's defaults give a 64 MB tensor a fresh mmap and unmap it on free: re-touched every time."""
    system, cached = _reallocation_faults("system"), _reallocation_faults(allocator)
    assert system["allocator"] == "system" and cached["allocator"] == allocator
    assert system["faults"] >= 20 and cached["faults"] < system["faults"] / 10, (system, cached)


# a worker that already maps 1 GiB before its trial (as torch and Ray do, 0.5-2.5 GiB by allocator) gets a 0.5 GiB cap
_CAPPED = textwrap.dedent("""
    import json, threading
    import torch
    from apao_ray.training import memory
    from apao_ray.training.failures import is_out_of_memory

    GIB = 2**30
    ballast = torch.ones(GIB // 4)  # mapped and touched before the cap: not the trial's

    def trial(out):
        cap = memory.MemoryCap(GIB // 2)
        held = []
        for size in (0.1, 0.2, 0.3):  # 0.3 GiB held fits; 0.3 more passes the cap
            try:
                held.append(torch.ones(int(size * GIB) // 4))
            except Exception as error:
                out["failed_at"], out["is_out_of_memory"] = size, is_out_of_memory(error)
                break
        out["describe"] = cap.describe()
        out["allocator"] = memory.allocator_in_use()

    out = {}
    thread = threading.Thread(target=trial, args=(out,)); thread.start(); thread.join()  # as in a Ray worker
    print(json.dumps(out))
""")


@needs_glibc
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_the_memory_cap_counts_what_the_trial_allocates_after_its_start_under_every_allocator(allocator):
    run = _run(_CAPPED, allocator)
    assert run["allocator"] == allocator
    assert run["failed_at"] == 0.3 and run["is_out_of_memory"], run
    # the cap and what the trial held of it (0.3 GiB of tensors; up to the cap with the allocator's own reserve)
    cap, held, start, peak = re.match(r"memory cap (\S+) GiB: (\S+) GiB allocated past the worker's (\S+) GiB at the "
                                      r"trial's start, resident peak \+(\S+) GiB$", run["describe"]).groups()
    assert cap == "0.50" and 0.29 <= float(held) <= 0.5 and float(start) > 1.0 and 0.29 <= float(peak) <= 0.5, run


def test_allocator_choice_auto_prefers_tcmalloc_and_respects_the_users_own(monkeypatch):
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert memory.allocator_env(environ={})["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert memory.allocator_env(environ={memory.ALLOCATOR_ENV: "glibc-cached"}) == memory.GLIBC_CACHED
    assert memory.allocator_env(environ={"MALLOC_ARENA_MAX": "2"}) == {}  # the user set glibc up: untouched
    assert memory.allocator_env(environ={"LD_PRELOAD": "libjemalloc.so.2"}) == {}
    explicit = memory.allocator_env("tcmalloc", environ={"LD_PRELOAD": "libfoo.so"})
    assert explicit["LD_PRELOAD"] == "libfoo.so libtcmalloc_minimal.so.4"  # asked for: added to the user's
    assert memory.allocator_env("system", environ={}) == {}
    monkeypatch.setattr(memory, "find_tcmalloc", lambda: None)
    assert memory.allocator_env(environ={}) == memory.GLIBC_CACHED
    with pytest.raises(ValueError, match="tcmalloc.*libtcmalloc-minimal4"):
        memory.allocator_env("tcmalloc", environ={})
    with pytest.raises(ValueError, match="APAO_RAY_ALLOCATOR='jemalloc'.*auto, tcmalloc, glibc-cached, system"):
        memory.allocator_env(environ={memory.ALLOCATOR_ENV: "jemalloc"})
