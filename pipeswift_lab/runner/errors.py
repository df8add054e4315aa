"""Why a run failed, read from what the workers left behind, naming the rank at fault.

A worker that raises writes its traceback (``rank{r}.error``); one that dies leaves only an
exit code (from torch's elastic agent) and its stderr; one that hangs is asked for its stack
(``SIGUSR1`` → ``rank{r}.stacks`` via ``faulthandler``) before it is killed. When one rank
fails its peers usually fail next with communication errors (a closed gloo connection), so
the diagnosis prefers a rank that died or raised something else over one that lost its peer.
"""

from __future__ import annotations

import glob
import os
import re
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Substrings of a traceback's last line that mark a rank failing *because a peer failed*.
_PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "DistNetworkError",
    "DistBackendError",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
    "ECONNRESET",
    "EPIPE",
    "gloo",
)
#: Function names at the top of a rank's stack that mean "waiting for a peer".
_WAITING = re.compile(
    r"in (_wait_batch_p2p|wait|barrier|recv|irecv|send|gather_object|all_gather\w*|broadcast\w*|_recv_meta|"
    r"recv_object_list|send_object_list|_store_based_barrier|init_process_group|rendezvous\w*|_warmup_\w+)\b"
)


class RunError(RuntimeError):
    """A real pipeline run failed.

    ``reason``: ``"raised"`` (a rank raised; ``traceback`` is its traceback), ``"died"`` (a rank
    exited without a Python traceback: ``os._exit``, a signal, a crash), ``"hung"`` (the run
    passed ``timeout_s``; ``stacks`` holds where each rank was), or ``"launch"`` (the launch
    itself failed; ``traceback`` then holds the launcher's own report, torch's
    ``ChildFailedError``). ``rank`` is the rank at fault when one can be named; ``pids`` the worker
    processes, all gone when the error is raised. ``step`` is the training step the run was in
    when it failed (the first one not completed, counted from 0 over the whole run, a resume's
    steps included), ``None`` when it failed before its first step.
    """

    def __init__(
        self,
        message: str,
        reason: str,
        rank: int | None = None,
        traceback: str = "",
        stacks: Mapping[int, str] | None = None,
        exitcodes: Mapping[int, int | None] | None = None,
        pids: Iterable[int] = (),
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.rank = rank
        self.step = step
        self.traceback = traceback
        self.stacks = dict(stacks or {})
        self.exitcodes = dict(exitcodes or {})
        self.pids = tuple(pids)
        self.result: Any = None  # the RunResult so far, when one was assembled (a non-finite loss)


def is_peer_error(summary: str) -> bool:
    """Whether an exception summary is a rank failing *because a peer failed* (a closed connection, a timeout)."""
    return any(marker in summary for marker in _PEER_ERRORS)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


_CHAIN = re.compile(
    r"\n\s*(?:The above exception was the direct cause of the following exception:|"
    r"During handling of the above exception, another exception occurred:)\s*\n"
)


def _exception_line(segment: str) -> str:
    """The ``Type: message`` line of one traceback (its first line when the message spans several)."""
    lines = segment.strip("\n").splitlines()
    in_frames = False
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            in_frames = True
            continue
        if in_frames and (line.startswith(" ") or not line.strip()):
            continue
        if in_frames:
            head = line.strip()
            if head.endswith(":"):  # the message starts on the next line
                rest = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
                head = f"{head} {rest}".strip()
            return head
    return _last_line(segment)


def exception_summary(tb: str) -> str:
    """``"Root: msg"`` of a formatted traceback, naming the exception it surfaced as when chained."""
    segments = _CHAIN.split(tb.strip())
    root, final = _exception_line(segments[0]), _exception_line(segments[-1])
    return root if root == final else f"{root} (surfacing as {final})"


def stderr_tail(run_dir: Path, rank: int, lines: int = 15) -> str:
    """The last ``lines`` lines of a local rank's stderr, from the elastic agent's log directory."""
    paths = sorted(glob.glob(str(run_dir / "logs" / "*" / "attempt_*" / str(rank) / "stderr.log")))
    if not paths:
        return ""
    return "\n".join(_read(Path(paths[-1])).rstrip().splitlines()[-lines:])


def _waiting(stack: str) -> bool:
    """Whether a faulthandler dump shows the main thread waiting on communication (its innermost frame)."""
    blocks = [b for b in stack.split("\n\n") if "most recent call first" in b]
    # the main thread received the signal ("Current thread"); helper threads (the caller watchdog) sleep elsewhere
    main = [b for b in blocks if "Current thread" in b] or [b for b in blocks if "Thread" in b]
    for block in main:
        frames = [line for line in block.splitlines() if line.strip().startswith("File ")]
        if frames:
            return bool(_WAITING.search(frames[0])) or "distributed_c10d.py" in frames[0]
    return False


def _raised(r: int, errors: dict[int, str], exitcodes: dict[int, int | None], pids: Iterable[int]) -> RunError:
    others = sorted(set(errors) - {r})
    note = f"\n(ranks {others} failed after it)" if others else ""
    return RunError(
        f"rank {r} raised {exception_summary(errors[r])}{note}\n\nTraceback of rank {r}:\n{errors[r]}",
        reason="raised",
        rank=r,
        traceback=errors[r],
        exitcodes=exitcodes,
        pids=pids,
    )


def failed_step(run_dir: Path) -> int | None:
    """The step a failed run was in: one past the last step its newest attempt completed (``steps.log``), or
    where that attempt started (``attempt{n}.json``); ``None`` when no attempt reached training."""
    import json

    run_dir = Path(run_dir)
    done: dict[int, int] = {}
    for line in _read(run_dir / "steps.log").splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[0].isdigit() and fields[1].isdigit():
            done[int(fields[0])] = max(done.get(int(fields[0]), -1), int(fields[1]))
    attempts = sorted(
        int(p.stem.removeprefix("attempt")) for p in run_dir.glob("attempt*.json") if p.stem[7:].isdigit()
    )
    latest = max(attempts + list(done), default=None)
    if latest is None:
        return None
    if latest in done:
        return done[latest] + 1
    try:
        return int(json.loads(_read(run_dir / f"attempt{latest}.json"))["first_step"])
    except (ValueError, KeyError, TypeError):
        return None


def diagnose(
    run_dir: Path,
    P: int,
    timeout_s: float,
    timed_out: bool,
    agent_error: BaseException | None,
    pids: Iterable[int],
) -> RunError:
    """Build the :class:`RunError` that explains a failed run from the files in ``run_dir`` (with the step it was
    in): the hang past ``timeout_s`` when ``timed_out``, else :func:`_failure`'s."""
    run_dir = Path(run_dir)
    started = {r for r in range(P) if (run_dir / f"rank{r}.pid").exists()}
    failures = getattr(agent_error, "failures", None) or {}
    exitcodes: dict[int, int | None] = {int(r): getattr(f, "exitcode", None) for r, f in failures.items()}
    if timed_out:
        error = _hung(run_dir, P, timeout_s, started, exitcodes, pids)
    else:
        error = _failure(run_dir, P, started, exitcodes, agent_error, pids)
    error.step = failed_step(run_dir)
    return error


def _failure(
    run_dir: Path,
    P: int,
    started: set[int],
    exitcodes: dict[int, int | None],
    agent_error: BaseException | None,
    pids: Iterable[int],
) -> RunError:
    """The failure first: a rank that raised something of its own, one that died, one that raised at all; else
    the launch."""
    errors = {r: _read(run_dir / f"rank{r}.error") for r in range(P) if (run_dir / f"rank{r}.error").exists()}
    died = _died_ranks(run_dir, P, started, errors, exitcodes)
    killed = [r for r in died if (exitcodes.get(r) or 0) < 0]

    def mtime(r: int) -> float:
        return os.path.getmtime(run_dir / f"rank{r}.error")

    own_errors = sorted((r for r in errors if not is_peer_error(exception_summary(errors[r]))), key=mtime)
    if own_errors and not killed:
        return _raised(own_errors[0], errors, exitcodes, pids)
    if died and (errors or exitcodes):
        first = (killed + [r for r in died if r not in killed])[0]
        return _died(run_dir, first, errors, exitcodes, pids)
    if errors:
        return _raised(sorted(errors, key=mtime)[0], errors, exitcodes, pids)
    return _launch_failed(run_dir, P, started, agent_error, exitcodes, pids)


def _died_ranks(
    run_dir: Path, P: int, started: set[int], errors: dict[int, str], exitcodes: dict[int, int | None]
) -> list[int]:
    """Ranks that ended without a traceback, and not because the launcher stopped them: those with an exit code
    first.

    The agent stops the survivors of a failure with SIGTERM (then SIGKILL): a worker notes every
    SIGTERM in rank{r}.sigterm, so a rank that ended by a signal *without* that note was killed from
    outside (the OOM killer, kill -9) or crashed: it failed first, whatever its peers raised after.
    """
    told_to_stop = {r for r in range(P) if (run_dir / f"rank{r}.sigterm").exists()}
    silent = [
        r
        for r in sorted(started)
        if r not in errors
        and not (run_dir / f"rank{r}.done").exists()
        and r not in told_to_stop
        and exitcodes.get(r) != 0
    ]
    return [r for r in silent if exitcodes.get(r) is not None] + [r for r in silent if exitcodes.get(r) is None]


def _died(
    run_dir: Path, r: int, errors: dict[int, str], exitcodes: dict[int, int | None], pids: Iterable[int]
) -> RunError:
    """The :class:`RunError` of rank ``r``, which died without a traceback (its exit, and its stderr's tail)."""
    code = exitcodes.get(r)
    if code is None:
        how = "ended (its exit code was not reported: a peer's failure was seen first)"
    elif code < 0 and -code in signal.Signals._value2member_map_:
        how = f"was killed by signal {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    tail = stderr_tail(run_dir, r)
    peers = sorted(errors)
    note = f"\n(ranks {peers} then failed because they lost their peer)" if peers else ""
    return RunError(
        f"rank {r} died: it {how} without a Python traceback (os._exit, a signal or a crash in native code).{note}"
        + (f"\nLast lines of its stderr:\n{tail}" if tail else ""),
        reason="died",
        rank=r,
        traceback=tail,
        exitcodes=exitcodes,
        pids=pids,
    )


def _hung(
    run_dir: Path,
    P: int,
    timeout_s: float,
    started: set[int],
    exitcodes: dict[int, int | None],
    pids: Iterable[int],
) -> RunError:
    """The :class:`RunError` of a run past its timeout: every rank's stack, naming the one rank that hung in its own
    work when there is one."""
    stacks = {r: _read(run_dir / f"rank{r}.stacks") for r in sorted(started)}
    not_started = sorted(set(range(P)) - started)
    busy = [r for r, s in stacks.items() if s.strip() and not _waiting(s)]
    lines = [f"the run did not finish within timeout_s={timeout_s:g} s; its workers were stopped."]
    if not_started:
        lines.append(f"ranks {not_started} had not started the runner yet (start-up is slower than the timeout?)")
    rank = busy[0] if len(busy) == 1 else None
    if busy:
        lines.append(
            f"rank{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy))} hung in "
            f"{'their' if len(busy) > 1 else 'its'} own work; the others were waiting for a peer."
        )
    for r, s in stacks.items():
        waiting = " (waiting for a peer)" if r not in busy and s.strip() else ""
        lines.append(f"\nStack of rank {r}{waiting}:\n{s.strip() or '(no stack dump)'}")
    return RunError(
        "\n".join(lines),
        reason="hung",
        rank=rank,
        traceback=stacks.get(rank, "") if rank is not None else "",
        stacks=stacks,
        exitcodes=exitcodes,
        pids=pids,
    )


def _launch_failed(
    run_dir: Path,
    P: int,
    started: set[int],
    agent_error: BaseException | None,
    exitcodes: dict[int, int | None],
    pids: Iterable[int],
) -> RunError:
    """The :class:`RunError` of a launch that failed before any rank could report: ranks that never started first."""
    tails = "\n".join(f"\nstderr of rank {r}:\n{stderr_tail(run_dir, r)}" for r in range(P) if stderr_tail(run_dir, r))
    detail = f"{type(agent_error).__name__}: {agent_error}" if agent_error is not None else "no result was written"
    never = sorted(set(range(P)) - started)
    if never:  # the cause first, in one line; the launcher's report (torch's ChildFailedError dump) in .traceback
        return RunError(
            f"ranks {never} never reached the runner: their processes failed while starting; the error is on this "
            "process's stderr and the launcher's report in RunError.traceback (forked workers first re-import "
            f'the __main__ module of a script: a script must call run() under `if __name__ == "__main__":`).{tails}',
            reason="launch",
            traceback=detail,
            exitcodes=exitcodes,
            pids=pids,
        )
    return RunError(f"the launch failed: {detail}{tails}", reason="launch", exitcodes=exitcodes, pids=pids)


__all__ = ["diagnose", "exception_summary", "failed_step", "is_peer_error", "RunError", "stderr_tail"]
