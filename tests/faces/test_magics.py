"""Tests for pipeswift_lab.faces.magics: %pipeswift_profile in both forms, through a real IPython shell."""

import time

import pytest
import torch
from IPython.core.error import UsageError
from IPython.testing.globalipapp import get_ipython
from IPython.utils.capture import capture_output
from sleep_layers import Sleep
from torch import nn

import pipeswift_lab.faces.magics
from pipeswift_lab.profiling.table import Profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLACK_MS = 25.0  # scheduler noise allowed above a sleep (shared machine)


class Tower(nn.Module):
    """Not an nn.Sequential: a ModuleList of residual blocks and a head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


@pytest.fixture(scope="module")
def shell():
    ip = get_ipython()
    pipeswift_lab.faces.magics.load_ipython_extension(ip)
    torch.manual_seed(0)
    ip.user_ns.update(
        torch=torch,
        nn=nn,
        time=time,
        model=nn.Sequential(Sleep(0.030, 0.0), Sleep(0.0, 0.030)),
        tower=Tower(),
        x=torch.randn(4, 8),
        y=torch.randn(4, 8),
        mse=nn.functional.mse_loss,
    )
    return ip


def test_extension_registers_line_and_cell_magic(shell):
    magics = shell.magics_manager.magics
    assert "pipeswift_profile" in magics["line"] and "pipeswift_profile" in magics["cell"]
    shell.run_line_magic("load_ext", "pipeswift_lab.faces.magics")  # the %load_ext spelling works as well


def test_line_form_profiles_model_of_x(shell):
    prof = shell.run_line_magic("pipeswift_profile", "-n 3 -w 1 -o -q model x")
    assert isinstance(prof, Profile)
    assert prof.layer_names == ("0", "1") and prof.meta["source"] == "profile"
    assert prof.meta["repeats"] == 3 and prof.meta["warmup"] == 1 and prof.meta["batch_shape"] == [4, 8]
    fwd, bwd = prof.df["fwd_ms"].tolist(), prof.df["bwd_ms"].tolist()
    assert 30 - 0.5 <= fwd[0] <= 30 + SLACK_MS and fwd[1] < SLACK_MS
    assert 30 - 0.5 <= bwd[1] <= 30 + SLACK_MS and bwd[0] < SLACK_MS


def test_line_form_with_loss_target_layers_and_variable(shell):
    result = shell.run_line_magic(
        "pipeswift_profile", "-n 2 -w 0 -q --layers blocks.*,head --loss mse --target y[:,:2] -v tower_prof tower x"
    )
    assert result is None  # without -o nothing is returned
    prof = shell.user_ns["tower_prof"]
    assert prof.layer_names == ("blocks.0", "blocks.1", "blocks.2", "head")
    assert prof.meta["loss"] == "mse_loss" and list(prof.df["params"]) == [72, 72, 72, 18]


def test_cell_form_runs_the_cell_as_the_step(shell):
    shell.user_ns["runs"] = 0
    shell.run_cell("opt = torch.optim.SGD(model.parameters(), lr=0.1)\nbefore = model[0].lin.weight.detach().clone()")
    cell = "opt.zero_grad()\nloss = model(x).pow(2).mean()\nloss.backward()\nopt.step()\ntime.sleep(0.06)\nruns += 1\n"
    result = shell.run_cell_magic("pipeswift_profile", "-n 3 -w 2 -q -v step_prof model", cell)
    assert result is None
    prof = shell.user_ns["step_prof"]
    assert shell.user_ns["runs"] == 5  # warm-up and measured runs of the cell
    assert not torch.equal(
        shell.user_ns["before"], shell.user_ns["model"][0].lin.weight
    )  # the optimizer really stepped
    assert prof.meta["source"] == "step" and prof.meta["repeats"] == 3
    fwd, bwd = prof.df["fwd_ms"].tolist(), prof.df["bwd_ms"].tolist()
    assert 30 - 0.5 <= fwd[0] <= 30 + SLACK_MS and 30 - 0.5 <= bwd[1] <= 30 + SLACK_MS
    assert 0.25 < prof.coverage < 0.6  # the 60 ms sleep and the optimizer are outside the layers


def test_display_unless_quiet(shell):
    with capture_output() as shown:
        shell.run_line_magic("pipeswift_profile", "-n 1 -w 0 tower x --layers blocks.*")
    assert len(shown.outputs) == 2  # the Profile card and the plot
    assert "Profile of Tower" in shown.outputs[0].data["text/plain"]
    assert "Figure" in shown.outputs[1].data["text/plain"]
    with capture_output() as shown:
        prof = shell.run_line_magic("pipeswift_profile", "-n 1 -w 0 -o --layers blocks.* tower x")
    assert len(shown.outputs) == 1 and isinstance(prof, Profile)  # -o: the returned Profile is the card
    with capture_output() as shown:
        shell.run_line_magic("pipeswift_profile", "-n 1 -w 0 -q --layers blocks.* tower x")
    assert shown.outputs == [] and shown.stdout == ""


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "-n 1 nothing x",
            r"model 'nothing' could not be evaluated in the notebook: NameError: name 'nothing' is not defined",
        ),
        ("-n 1 model", r"give the sample input after the model: %pipeswift_profile model x"),
        ("-n 0 model x", r"repeats=0 is invalid; it must be >= 1"),
        (
            "-n 1 -w 0 tower x",
            r"layers=None takes the children of an nn.Sequential, but model is a Tower; "
            r".*layers=\['blocks\.\*', 'head'\]",
        ),
        (
            "-n 1 --layers blocks.*,tail tower x",
            r"layers pattern 'tail' matches no submodule of the Tower; available names: 'blocks', 'head'",
        ),
        (
            "-n 1 -w 0 model torch.randn(4,3)",
            r"the sample does not fit the model: RuntimeError in unit '0' at layer '0.lin' \(Linear\) "
            r"with input shapes \{'input': \[4, 3\]\}",
        ),
        ("-n 1 --target y model x", r"--target needs --loss"),
        ("-n 1 -v 1x model x", r"-v '1x' is not a valid Python name"),
        ("-n 1 --bogus model x", r"unrecognized arguments: --bogus"),
    ],
)
def test_line_errors_are_one_line_usage_errors(shell, line, message):
    with pytest.raises(UsageError, match=message) as info:
        shell.run_line_magic("pipeswift_profile", line)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "line, cell, message",
    [
        ("-n 1 model x", "model(x).sum().backward()", "the cell form takes only the model"),
        ("-n 1 model", "   \n", "the cell is empty"),
        ("-n 1 model", "raise KeyError('boom')", r"the cell raised KeyError: 'boom'"),
        ("-n 1 -w 0 --layers blocks.0 tower", "y.sum()", r"layers \['blocks.0'\] never ran in the step"),
    ],
)
def test_cell_errors_are_one_line_usage_errors(shell, line, cell, message):
    with pytest.raises(UsageError, match=message) as info:
        shell.run_cell_magic("pipeswift_profile", line, cell)
    assert "\n" not in str(info.value)


def test_errors_in_a_notebook_cell_show_no_traceback(shell):
    with capture_output() as shown:
        result = shell.run_cell("%pipeswift_profile -n 1 nothing x")
    assert isinstance(result.error_in_exec, UsageError)
    assert "Traceback" not in shown.stdout + shown.stderr


def test_arguments_split_as_a_shell_would(shell):
    """The help shows --layers 'embed,blocks.*,head'; pasted with its quotes it must work."""
    prof = shell.run_line_magic("pipeswift_profile", "-n 1 -w 0 -o -q --layers 'blocks.*,head' tower x")
    assert prof.layer_names == ("blocks.0", "blocks.1", "blocks.2", "head")
    prof = shell.run_line_magic("pipeswift_profile", '-n 1 -w 0 -o -q --layers "blocks.0" tower x')
    assert prof.layer_names == ("blocks.0",)
    with pytest.raises(UsageError, match="could not split the arguments"):
        shell.run_line_magic("pipeswift_profile", "-n 1 --layers 'blocks.* tower x")


def test_quiet_shows_no_progress_bar(shell, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # the suite turns bars off; -q must do it by itself
    with capture_output() as shown:
        shell.run_line_magic("pipeswift_profile", "-n 2 -w 0 -q --layers blocks.* tower x")
    assert shown.outputs == [] and shown.stdout == "" and shown.stderr == ""
    with capture_output() as shown:
        shell.run_line_magic("pipeswift_profile", "-n 2 -w 0 --layers blocks.* tower x")
    assert "profiling Tower" in shown.stderr  # without -q the bar shows: the check above can fail


def test_layers_auto_finds_the_repeated_blocks(shell, capsys):
    prof = shell.run_line_magic("pipeswift_profile", "-n 1 -w 0 -o -q --layers auto tower x")
    chosen = capsys.readouterr().out
    assert 'layers="auto"' in chosen and "blocks" in chosen
    assert any(name.startswith("blocks.") for name in prof.df["name"])
