"""trainer.megatron.cpu_compat: the CUDA-only spots of megatron-core are where we expect them (this test
fails loudly when a new megatron-core moves one), the redirects work on CPU, are idempotent, are
skipped where CUDA exists, and are never applied by importing the module."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)")

from trainer.megatron import cpu_compat

NEEDS_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@pytest.fixture(autouse=True)
def _clean():
    cpu_compat.remove_cpu_redirects()
    yield
    cpu_compat.remove_cpu_redirects()


def test_spots_are_where_megatron_core_0_16_1_has_them():
    # If this fails after a megatron-core upgrade, the message names the version and the spot.
    cpu_compat.check_cpu_redirect_targets()


def test_installed_version_is_the_tested_one():
    assert cpu_compat.megatron_core_version() == cpu_compat.TESTED_MEGATRON_CORE_VERSION


def test_import_applies_nothing():
    code = (
        "import sys, trainer.megatron.cpu_compat as c; "
        "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron imported'; "
        "assert c.active_cpu_redirects() == ()"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, cwd=pathlib.Path(__file__).resolve().parents[3]
    )


@NEEDS_NO_CUDA
def test_redirects_make_the_spots_work_on_cpu():
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer import utils
    from megatron.core.utils import GlobalMemoryBuffer

    rotary = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    with pytest.raises((AssertionError, RuntimeError)):  # torch without CUDA
        rotary.get_emb(4)
    with pytest.raises(Exception, match="not added"), CudaRNGStatesTracker().fork():
        pass
    original_current_device = torch.cuda.current_device

    active = cpu_compat.apply_cpu_redirects()
    assert "current_device" in active and "rng fork" in active
    assert any(name.startswith("causal mask") for name in active)

    emb = rotary.get_emb(4)
    assert emb.device.type == "cpu" and emb.shape == (4, 1, 1, 8)
    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t").device.type == "cpu"
    expected = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    assert torch.equal(utils.get_default_causal_mask(3), expected)
    assert fused_softmax.get_default_causal_mask is utils.get_default_causal_mask
    with CudaRNGStatesTracker().fork():
        pass
    assert torch.cuda.current_device is original_current_device  # the process's torch is untouched


@NEEDS_NO_CUDA
def test_idempotent_and_removable():
    from megatron.core.transformer import utils

    original_mask = utils.get_default_causal_mask
    first = cpu_compat.apply_cpu_redirects()
    patched_mask = utils.get_default_causal_mask
    assert cpu_compat.apply_cpu_redirects() == first
    assert utils.get_default_causal_mask is patched_mask is not original_mask
    cpu_compat.remove_cpu_redirects()
    assert utils.get_default_causal_mask is original_mask
    assert cpu_compat.active_cpu_redirects() == ()


def test_nothing_applied_where_cuda_exists(monkeypatch):
    from megatron.core.transformer import utils

    original_mask = utils.get_default_causal_mask
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.apply_cpu_redirects() == ()
    assert utils.get_default_causal_mask is original_mask


MOVED = [
    ("megatron.core.transformer.utils", "get_default_causal_mask", lambda sq, skv: None, "get_default_causal_mask"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask", lambda sq: None, "fused_softmax"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", object, "CudaRNGStatesTracker"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding", object, "get_emb"),
]


@pytest.mark.parametrize("module_name,attribute,replacement,spot", MOVED)
def test_a_moved_spot_fails_loudly_and_changes_nothing(monkeypatch, module_name, attribute, replacement, spot):
    import importlib

    from megatron.core.transformer import utils

    original_mask = utils.get_default_causal_mask
    monkeypatch.setattr(importlib.import_module(module_name), attribute, replacement)
    with pytest.raises(RuntimeError, match=rf"megatron-core {cpu_compat.megatron_core_version()} moved.*{spot}"):
        cpu_compat.apply_cpu_redirects(force=True)
    assert cpu_compat.active_cpu_redirects() == ()
    assert utils.get_default_causal_mask is original_mask or attribute == "get_default_causal_mask"
