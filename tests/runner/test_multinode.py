"""The spec written by ``Launch(save_spec=...)`` runs as two torchrun "nodes" on this machine and trains like the
local run.

Two ``torchrun`` agents, one per node, meet through the static rendezvous (``--nnodes 2
--node-rank 0|1 --master-addr 127.0.0.1 --master-port PORT``) or through c10d
(``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``), as on two machines of a cluster.
With ``D=2`` each node holds one replica's stages (pipeline traffic stays on the node; the
all-reduce crosses nodes). Cold interpreters: this module takes a while.
"""

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from test_torchrun import (
    Affine,
    assert_no_gloo_threads_after_teardown,
)  # a layer of the test suite: the saved spec carries it by value
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import load_result, load_spec, run

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

ROOT = Path(__file__).resolve().parents[2]


def local_run(tmp_path, D):
    model = nn.Sequential(*[Affine(6, s) for s in range(4)])
    g = torch.Generator().manual_seed(5)
    batch = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    part = Partition.from_bounds(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)], schedule="1F1B"
    )
    spec_path = tmp_path / "job.pkl"
    result = run(
        model,
        batch,
        nn.functional.mse_loss,
        part,
        2,
        steps=2,
        progress=False,
        launch=Launch(timeout_s=120, save_spec=spec_path),
        D=D,
    )
    return result, spec_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(spec_path, out, nproc, rendezvous):
    """Start both nodes' torchrun agents, wait for both; return their CompletedProcess-like (returncode, stdout,
    stderr)."""
    launcher = (
        [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    port, rdzv_id = free_port(), uuid.uuid4().hex[:8]
    procs = []
    for node in (0, 1):
        if rendezvous == "static":
            rdzv = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        else:
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id]
        cmd = (
            launcher
            + ["--nnodes", "2", "--nproc-per-node", str(nproc)]
            + rdzv
            + ["-m", "pipeswift_lab.runner", str(spec_path), "--out", str(out)]
        )
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            outputs.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def assert_same_run(again, result):
    assert list(again.state_dict()) == list(result.state_dict())
    for key, want in result.state_dict().items():
        assert ((again.state_dict()[key] - want).norm() / want.norm()).item() <= 1e-6, key
    assert again.losses == pytest.approx(result.losses, rel=1e-6)


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    """The D=1 local run and its saved spec, once for both rendezvous (each test only reads them)."""
    return local_run(tmp_path_factory.mktemp("one_replica"), D=1)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_run_the_saved_spec_like_the_local_run(tmp_path, rendezvous, one_replica):
    result, spec_path = one_replica
    out = tmp_path / "out"
    outputs = two_nodes(spec_path, out, nproc=1, rendezvous=rendezvous)
    for code, _stdout, stderr in outputs:
        assert code == 0, stderr[-3000:]
    assert any("RunResult 1F1B P=2 m=2" in stdout for _, stdout, _ in outputs)
    again = load_result(out)
    assert again.meta["launched_by"] == "torchrun"
    assert_same_run(again, result)


def test_two_nodes_hold_one_pipeline_rank_of_each_replica(tmp_path):
    result, spec_path = local_run(tmp_path, D=2)
    spec = load_spec(spec_path)
    assert (spec.P, spec.D, spec.world_size) == (2, 2, 4)
    # the mesh is (pp, dp, fsdp, tp), torchtitan's order: replica d runs on global ranks pp * D + d, so a node holds
    # one pipeline rank of every replica and only the pipeline's point-to-point traffic crosses nodes
    assert spec.meta["placement"] == [[0, 2], [1, 3]]
    out = tmp_path / "out"
    outputs = two_nodes(spec_path, out, nproc=2, rendezvous="static")
    for code, _, stderr in outputs:
        assert code == 0, stderr[-3000:]
    again = load_result(out)
    assert_same_run(again, result)
    assert (
        len(again.timeline.df.query("kind == 'REDUCE_GRAD'")) == 2 * 2 * 2
    )  # the replicas' all-reduce, now inside a node: steps x replicas x stages
    ranks = again.ranks.set_index("rank")
    assert len(ranks) == 4
    assert_no_gloo_threads_after_teardown(out, ranks=4)  # DDP and the 2-D mesh's groups too
