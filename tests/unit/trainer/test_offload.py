"""DeviceOffload on CPU: nothing moves, nothing changes (the CUDA path: tests/integration/gpu)."""

import torch

from trainer.offload import DeviceOffload


def test_a_cpu_model_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    offload = DeviceOffload(model, lambda: opt)
    report = offload.release()
    assert report.moved_bytes == 0 and not offload.released
    assert offload.reclaim().moved_bytes == 0
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before


def test_the_slots_cover_parameters_gradients_buffers_and_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    kinds = {}
    for (kind, _), _get, _put in DeviceOffload(model, lambda: opt)._slots():
        kinds[kind] = kinds.get(kind, 0) + 1
    # 4 parameters with gradients, BatchNorm's 3 buffers, AdamW's 2 moments per parameter (steps: 0-dim)
    assert kinds == {"param": 4, "grad": 4, "buffer": 3, "state": 8}
