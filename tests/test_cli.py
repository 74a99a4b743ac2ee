"""gdn's command line: ``gdn check`` selection by module (--ops) and by check function (--checks)."""
import torch

from gdn.checks import run_all
from gdn.cli import main as cli


def test_check_selects_check_functions(capsys):
    """--checks runs only the check functions whose names contain one of the strings; one that matches nothing
    leaves no result, which is a failure (exit 1), not a pass."""
    everything = run_all(torch.device("cpu"), only={"chunk_backward"}, names=["strong_decay"])
    assert everything and all(r.case.startswith("g=-30") for r in everything)
    assert cli(["check", "--device", "cpu", "--ops", "gate,norm", "--checks", "rmsnorm"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split()[0] for ln in out.splitlines()[2:] if ln.strip() and "passed," not in ln]
    assert rows and set(rows) == {"norm"}              # the gate module's check did not run
    assert cli(["check", "--device", "cpu", "--ops", "gate", "--checks", "no_such_check"]) == 1
    assert "0 passed, 0 failed" in capsys.readouterr().out
