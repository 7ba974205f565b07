"""--precision: 'auto' follows the CPU's native bf16 support; configs and checkpoints record it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apao_ray.config import TrainConfig
from apao_ray.training import precision


def cpuinfo_has_native_bf16() -> bool:
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux /proc/cpuinfo")
def test_auto_is_bf16_exactly_on_cpus_with_native_bf16():
    expected = "bf16" if cpuinfo_has_native_bf16() else "fp32"
    assert precision.resolve_precision("auto", "cpu") == expected
    assert precision.cpu_has_native_bf16() == cpuinfo_has_native_bf16()


def test_cpuinfo_is_asked_when_torch_cannot_tell(monkeypatch, tmp_path):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    monkeypatch.setattr(precision, "Path", lambda _: tmp_path / "cpuinfo")
    (tmp_path / "cpuinfo").write_text("processor : 0\nflags : fpu sse2 avx512f avx512_bf16\n")
    assert precision.cpu_has_native_bf16() and precision.resolve_precision("auto", "cpu") == "bf16"
    (tmp_path / "cpuinfo").write_text("processor : 0\nflags : fpu sse2 avx2\n")
    assert not precision.cpu_has_native_bf16() and precision.resolve_precision("auto", "cpu") == "fp32"


def test_explicit_precisions_pass_and_unknown_ones_are_named():
    assert precision.resolve_precision("fp32", "cpu") == "fp32"
    assert precision.resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match=r"unknown precision 'fp16'; choose from \['auto', 'fp32', 'bf16'\]"):
        precision.resolve_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="TrainConfig.precision='half' is not allowed"):
        TrainConfig(precision="half")
    with pytest.raises(ValueError, match="resolve 'auto'"):
        precision.autocast_dtype("auto")


def test_autocast_runs_bf16_matmuls_only_when_asked():
    x = torch.randn(4, 8)
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        with precision.autocast(name, "cpu"):
            assert (x @ x.T).dtype == dtype


def test_configs_from_before_precision_read_their_bf16_flag():
    assert TrainConfig.from_dict({"bf16": True}).precision == "bf16"
    assert TrainConfig.from_dict({"bf16": False}).precision == "fp32"
    assert TrainConfig.from_dict({}).precision == "auto"
