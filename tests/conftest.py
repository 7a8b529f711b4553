"""Every test but the ``gpu`` ones runs on the CPU, also on a host with a GPU: CUDA is hidden from
them (in this process and in the processes they start), so ``device = "auto"`` means the CPU and a
test never builds its model on a GPU and then trains it on the CPU."""

import pytest


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
