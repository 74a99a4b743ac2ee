"""Seeded serving schedule (prefills with/without initial states and checkpoints, decodes, speculative verifies,
commits) over one pool with -1 padding against a float64 replay; the large version is ``gdn check --ops serving``."""
import pytest
import torch

from gdn.checks.serving import run_schedule

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed,layout,state_dtype", [(0, "v_last", torch.float32), (1, "k_last", torch.bfloat16)])
def test_serving_schedule(seed, layout, state_dtype):
    sim = run_schedule(seed, 24, DEV, layout=layout, state_dtype=state_dtype)
    assert not sim.bad, sim.bad
    assert "state" in sim.worst and "o" in sim.worst  # the schedule wrote states and produced outputs
