"""Without a GPU, the Triton kernels run in Triton's interpreter: set before gdn's kernels are imported."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest-xdist runs one worker per core: more intra-op threads per worker only oversubscribe the CPU
    torch.set_num_threads(1)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# GPU-only tests (64-bit offsets on multi-GB pools, CUDA-graph replay, inductor) run on the GPU machine through
# bench/gpu_session.py; without CUDA they are not collected at all rather than reported as skipped.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]


@pytest.fixture(autouse=True)
def _fresh_seed():
    # fresh random inputs every run; the seed is printed on failure through the test's own messages where needed
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    yield


@pytest.fixture(autouse=True)
def _fresh_host_plans():
    # host plans recorded by an earlier test would replay past a later test's monkeypatched internals
    from gdn.kernels import host_plan

    host_plan.clear()
    yield


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty fills new float tensors with NaN, so an element a kernel forgets to write shows up."""
    # torch._dynamo keeps the torch functions it sees when first imported; a first import under this patch (a
    # TorchDispatchMode's first operator imports it: host plans record under one) would make later torch.compile
    # calls treat the real torch.empty as an unknown builtin
    import torch._dynamo  # noqa: F401

    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    yield
