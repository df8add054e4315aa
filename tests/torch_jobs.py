"""Plain ``torch.distributed.pipelining`` jobs (``examples/torch_pipeline_job.py``, no pipeswift_lab in the
workers) launched with torch's own launcher, as a cluster runs them, for the traces they write."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "torch_pipeline_job.py"


def torch_job(trace_dir, schedule, *args, nprocs=2, timeout=180):
    """Run the example job under ``torchrun --standalone`` with a profiler trace per rank into ``trace_dir``;
    returns ``trace_dir`` (a Path). Fails the test with the launcher's output when the job fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the workers import torch only
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", str(JOB)]
    cmd += ["--schedule", schedule, "--trace-dir", str(trace_dir), *map(str, args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return Path(trace_dir)


def job_module():
    """The example job as a module (its ``build_model``, the model the traced job trained)."""
    spec = importlib.util.spec_from_file_location("torch_pipeline_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
