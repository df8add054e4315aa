"""Peak memory per rank: the memory model's prediction against the measure, and what measuring costs.

**Accuracy** (``--device cpu``, the default). Real runs (gloo, one CPU process per rank, Adam) of
the reference GPT (default size) at a fixed micro-batch of 2 sequences, for GPipe, 1F1B,
Interleaved1F1B and ZBVZeroBubble at P=2 and m in {2, 4, 8}, 1F1B at P=4 (a 6-block GPT), and a
Hugging Face Llama (4 layers, width 32, vocabulary 64; ``layers="auto"``) at P=2, m=4. Per rank:
``RunResult.memory``'s ``predicted_peak_bytes`` against ``measured_peak_bytes`` (the tensor-level
peak of the run's second step: every storage alive at once), the relative error, and the
resident high-water above the start (``resident_peak_bytes``, which adds the allocator's and the
libraries' memory). The goal: median |error| <= 5% and max <= 10% at the tensor level.

**Cost.** The resident high-water is read once at the end of a run (nothing per step); the tensor
level runs on one step of each run (the second), under a dispatch mode that sees every operator.
Measured in this process on one rank's work (the reference GPT's first two stages' worth: the
whole model, m=4 micro-batches forward and backward, Adam), alternating plain and measured steps,
``--steps`` (>= 30) of each: the median step with and without, the interquartile ranges, the
probed step's overhead, the walk over the garbage collector's objects that finds its baseline (before the
step starts, outside its time), and the overhead spread over the run it is one step of (``--run-steps``).

**One rank on a device** (``--device cuda``): each rank of a balanced 1F1B and GPipe partition
is emulated on the GPU one at a time, its stage's forwards and backwards in the rank's own order
(with its receive buffers), Adam's step after; ``torch.cuda.max_memory_allocated`` of the second
step against the prediction for that rank. With ``--device cpu`` the same emulation runs under
the CPU measure beside the real runs (a check of the emulation). Without CUDA, ``--device cuda``
says so and exits.

**The zoo** (``--zoo``): 28 runs of models nobody tuned the memory model to (FFN blocks with GELU, ReLU
and SwiGLU, attention blocks, Hugging Face Llama, GPT-2 and BERT; every schedule; P in {2, 3}; m in {2, 4,
8}; SGD and Adam; :mod:`memory_zoo`), a third of them held out and reported apart: per rank, measured
against predicted, the error, and the term that is off. ``--in-sample`` / ``--held-out`` run one part.

Run: ``python benchmarks/bench_memory.py [--quick] [--device cpu|cuda] [--zoo [--in-sample|--held-out]]``
(about three minutes on 2 cores, the zoo about ten; ``--quick``: m in {2, 8}, fewer cost steps). Figures
are reported, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import pandas as pd
import torch
import torch.nn.functional as F

import pipeswift_lab as psl
from pipeswift_lab.core.live_bytes import LiveTensorBytes, live_tensors, memory_meter
from pipeswift_lab.core.schedule_orders import compute_orders

MICRO = 2
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _rows(result, model: str) -> list[dict]:
    columns = ["rank", "measured_peak_bytes", "predicted_peak_bytes", "error", "resident_peak_bytes", "peak_at"]
    out = result.memory[columns].assign(model=model, schedule=result.schedule, P=result.P, m=result.m)
    return out.to_dict("records")


def gpt_runs(ms: tuple[int, ...]) -> list[dict]:
    """The reference GPT's runs: every schedule at P=2 and each m, and 1F1B at P=4."""
    setup = psl.models.reference("gpt", batch_size=MICRO)
    prof = psl.profile(setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, progress=False)
    rows = []
    for schedule in SCHEDULES:
        v = 2 if schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 1
        for m in ms:
            big = psl.models.reference("gpt", batch_size=MICRO * m)
            part = psl.partition(prof, 2, v=v, schedule=schedule, m=m)
            batch = (big.inputs, big.targets)
            result = psl.run(
                big.model, batch, big.loss_fn, part, m, schedule=schedule, steps=3, optimizer=adam, progress=False
            )
            rows += _rows(result, "gpt")
    deep = psl.models.reference("gpt", batch_size=MICRO * 4, n_layers=6)
    prof6 = psl.profile(
        deep.model, deep.inputs[:MICRO], target=deep.targets[:MICRO], loss_fn=deep.loss_fn, progress=False
    )
    part = psl.partition(prof6, 4, schedule="1F1B", m=4)
    result = psl.run(
        deep.model, (deep.inputs, deep.targets), deep.loss_fn, part, 4, steps=3, optimizer=adam, progress=False
    )
    return rows + _rows(result, "gpt (6 blocks)")


def llama_run() -> list[dict]:
    """A Hugging Face Llama built from a small config, 1F1B at P=2, m=4."""
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: the Llama row is skipped")
        return []
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)

    def lm_loss(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    prof = psl.profile(model, x[:2], target=y[:2], loss_fn=lm_loss, layers="auto", progress=False)
    part = psl.partition(prof, 2, schedule="1F1B", m=4)
    result = psl.run(model, (x, y), lm_loss, part, 4, steps=3, optimizer=adam, progress=False)
    return _rows(result, "llama (HF)")


def measuring_cost(steps: int, run_steps: int) -> pd.DataFrame:
    """Plain and measured steps of one rank's work, alternating; their medians, IQRs and the overhead."""
    torch.manual_seed(0)
    setup = psl.models.reference("gpt", batch_size=MICRO * 4)
    model, optimizer = setup.model, adam(setup.model.parameters())
    chunks = list(zip(setup.inputs.chunk(4), setup.targets.chunk(4)))

    def step() -> None:
        for x, y in chunks:
            (setup.loss_fn(model(x), y) / len(chunks)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # Adam's state
    plain, probed, walks = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        plain.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        tracker = LiveTensorBytes()
        tracker.adopt(live_tensors())  # the baseline: before the step starts, as in the runner
        walks.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        with tracker:
            step()
        probed.append((time.perf_counter() - t0) * 1e3)

    def iqr(xs: list[float]) -> float:
        q = statistics.quantiles(xs, n=4)
        return q[2] - q[0]

    overhead = statistics.median(probed) / statistics.median(plain) - 1
    return pd.DataFrame(
        [
            {
                "steps_each": steps,
                "plain_step_ms": statistics.median(plain),
                "plain_iqr_ms": iqr(plain),
                "probed_step_ms": statistics.median(probed),
                "probed_iqr_ms": iqr(probed),
                "probed_step_overhead": overhead,
                "baseline_walk_ms": statistics.median(walks),
                "run_steps": run_steps,
                "overhead_per_step_of_the_run": overhead / run_steps,
            }
        ]
    )


def one_rank(device: torch.device, schedule: str, m: int = 4, P: int = 2) -> list[dict]:
    """Each rank of a balanced partition of the reference GPT emulated alone on ``device``: its stage's actions in
    the rank's order, Adam's step; the second step's peak against the prediction for that rank."""
    setup = psl.models.reference("gpt", batch_size=MICRO * m)
    prof = psl.profile(
        setup.model,
        setup.inputs[:MICRO],
        target=setup.targets[:MICRO],
        loss_fn=setup.loss_fn,
        device=device,
        progress=False,
    )
    part = psl.partition(prof, P, schedule=schedule, m=m)
    predicted = part.memory(micro_batch_size=MICRO, optimizer="adam")
    children = list(setup.model.children())
    rows = []
    for rank in range(P):
        ((a, b),) = [part.bounds[s] for s in range(part.n_stages) if part.stage_to_rank[s] == rank]
        stage = torch.nn.Sequential(*children[a:b]).to(device)
        optimizer = torch.optim.Adam(stage.parameters(), lr=1e-3)
        inputs = setup.inputs.to(device).chunk(m)
        targets = setup.targets.to(device).chunk(m)
        with torch.no_grad():  # what this rank receives, and the shape of what it sends
            before = torch.nn.Sequential(*children[:a]).to(device)
            received = [before(x) for x in inputs] if a > 0 else list(inputs)
            sent_shape = None if b == len(children) else stage(received[0]).shape
            del before
        last = sent_shape is None
        tracker = LiveTensorBytes() if device.type == "cpu" else None
        meter = memory_meter(device, tracker)
        peak = 0
        for step in range(2):
            buffers = [r.clone().requires_grad_(a > 0) for r in received]  # the stage's receive buffers
            grads = None if last else [torch.ones(sent_shape, device=device) for _ in range(m)]
            if step == 1:
                if tracker is not None:  # what the device would hold: this stage, its optimizer state, its buffers
                    state = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
                    tracker.adopt([*stage.parameters(), *state, *buffers, *received, *targets, *(grads or [])])
                    tracker.__enter__()
                meter.reset_peak()
            held = {}
            for kind, _, mb in compute_orders(P, m, schedule)[rank]:
                if kind == "F":
                    out = stage(buffers[mb])  # kept until its backward, as torch's stage keeps it
                    held[mb] = (out, setup.loss_fn(out, targets[mb]) / m if last else None)
                else:
                    out, loss = held.pop(mb)
                    torch.autograd.backward(loss if last else out, None if last else grads[mb])
                    del out, loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 1:
                peak = meter.peak()
                if tracker is not None:
                    tracker.__exit__(None, None, None)
        pred = float(predicted.loc[rank, "predicted_peak_bytes"])
        rows.append(
            {
                "device": str(device),
                "schedule": schedule,
                "rank": rank,
                "measured_peak_bytes": peak,
                "predicted_peak_bytes": pred,
                "error": pred / peak - 1,
            }
        )
    return rows


def zoo(held_out: bool | None = None) -> None:
    """Print the memory zoo's table and its summary (``held_out``: only that part; None: every case)."""
    import memory_zoo

    cases = tuple(c for c in memory_zoo.CASES if held_out is None or c.held_out == held_out)
    table = memory_zoo.zoo_table(cases)
    print(f"Memory zoo: {len(cases)} runs (gloo, CPU), tensor-level peak per rank, predicted against measured")
    shown = table.drop(columns=["index"])
    print(shown.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print()
    print(memory_zoo.summary(table).to_string(index=False, float_format=lambda x: f"{x:.1%}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="m in {2, 8}; 30 cost steps of each kind")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=40, help="measured and plain steps each, interleaved (>= 30)")
    parser.add_argument("--run-steps", type=int, default=100, help="the run the probed step is one step of")
    parser.add_argument("--cost-only", action="store_true", help="only what measuring costs")
    parser.add_argument("--zoo", action="store_true", help="the memory zoo: 28 runs, a third held out")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--in-sample", action="store_true", help="with --zoo: only the cases decisions were made on")
    part.add_argument("--held-out", action="store_true", help="with --zoo: only the held-out third")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 20)
    if args.zoo:
        zoo(held_out=True if args.held_out else False if args.in_sample else None)
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to measure with --device cuda")
            return
        device = torch.device("cuda", torch.cuda.current_device())
        table = pd.DataFrame(one_rank(device, "1F1B") + one_rank(device, "GPipe"))
        print(f"One rank at a time on {torch.cuda.get_device_name(device)}: max_memory_allocated vs predicted")
        print(table.to_string(index=False))
        print(f"median |error| {table['error'].abs().median():.1%}, max {table['error'].abs().max():.1%}")
        return
    steps = max(30, 30 if args.quick else args.steps)
    if args.cost_only:
        print(measuring_cost(steps, args.run_steps).T.to_string(header=False))
        return
    ms = (2, 8) if args.quick else (2, 4, 8)
    table = pd.DataFrame(gpt_runs(ms) + llama_run())
    mib = table.assign(
        measured_MiB=table["measured_peak_bytes"] / 2**20,
        predicted_MiB=table["predicted_peak_bytes"] / 2**20,
        resident_MiB=table["resident_peak_bytes"] / 2**20,
    )
    print("Tensor-level peak per rank, predicted against measured (real runs, CPU)")
    print(
        mib[
            ["model", "schedule", "P", "m", "rank", "measured_MiB", "predicted_MiB", "error", "resident_MiB", "peak_at"]
        ].to_string(index=False, float_format=lambda x: f"{x:.3f}")
    )
    errors = table["error"].abs()
    print(
        f"\nmedian |error| {errors.median():.1%} (goal <= 5%), max {errors.max():.1%} (goal <= 10%) over "
        f"{len(table)} ranks of {len(table.groupby(['model', 'schedule', 'P', 'm']))} runs"
    )
    resident = table["resident_peak_bytes"] / table["measured_peak_bytes"]
    print(f"resident high-water / tensor-level peak: median {resident.median():.2f}, max {resident.max():.2f}")
    emulated = pd.DataFrame(one_rank(torch.device("cpu"), "1F1B") + one_rank(torch.device("cpu"), "GPipe"))
    print("\nOne rank at a time, emulated in this process (the --device cuda path), CPU measure:")
    print(emulated.to_string(index=False))
    print("\nWhat measuring costs (one rank's work of the reference GPT, m=4, Adam; this process):")
    print(measuring_cost(steps, args.run_steps).T.to_string(header=False))


if __name__ == "__main__":
    sys.exit(main())
