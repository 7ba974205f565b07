"""A training worker gives malloc's free pages back to the OS (training/memory.py)."""
from __future__ import annotations

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
        out["before"] = memory.resident_bytes()
        out["released"] = memory.release_free_memory() if sys.argv[1] == "trim" else False
        out["after"] = memory.resident_bytes()
        out["keep"] = float(keep[0])

    out = {}
    thread = threading.Thread(target=work, args=(out,)); thread.start(); thread.join()  # as in a Ray Train worker
    print(json.dumps(out))
""")


@needs_glibc
def test_free_blocks_stay_resident_until_released():
    import json

    runs = {}
    for mode in ("keep", "trim"):
        done = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    kept, trimmed = runs["keep"], runs["trim"]
    assert kept["after"] > kept["before"] - 100 * 2**20  # without a trim the ~600 MB freed stays resident
    assert trimmed["released"] and trimmed["before"] - trimmed["after"] > 400 * 2**20


@needs_glibc
def test_releaser_trims_above_its_soft_limit_at_most_once_per_interval():
    releaser = memory.MemoryReleaser(soft_limit_bytes=0, min_interval_s=3600)
    releaser.step()
    releaser.step()
    assert releaser.releases == 1
    high = memory.MemoryReleaser(soft_limit_bytes=2**62, min_interval_s=0)
    high.step()
    assert high.releases == 0  # below the limit: no trim, no page faults
    high.release()
    assert high.releases == 1
