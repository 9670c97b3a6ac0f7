"""Signals against a stepping engine: handlers that call it return, and an interrupted hand-over loses no output.

Three probes, on the CPU with the tiny random-init Llama (``hf_paged.cli.default_model.tiny_llama``); each run adds
a few greedy requests and steps until none is left while signals arrive at random times:

- ``abort``: one SIGTERM per run, sent by ``os.kill`` from a timer thread after a random delay within the run; its
  handler calls ``engine.abort_all()``. The run must return, report every request once, and end the requests the
  abort stopped with ``finish_reason="abort"``.
- ``stats``: one SIGUSR1 per run, sent the same way; its handler calls ``engine.stats()``, which must return the
  figures of the moment (the tokens generated so far in the run, the requests queued and running).
- ``hand-over``: one SIGALRM per step (``signal.setitimer``), after a random delay of up to twice a step's usual
  length; its handler raises while ``step()`` runs, and the loop steps again after each exception. Every request's
  output must be delivered exactly once: none lost (a hand-over interrupted after the engine took the outputs out),
  none twice; no step may fail (the engine's warning) and torch's grad and inference modes must stay as they were.

A run that does not return within ``--hang-after`` seconds (a handler waiting for ever on the engine's lock) ends the
probe: it prints which run hung and every thread's stack, and exits with status 1; a failed check exits with 1
after the summary. Each probe prints one line: runs, runs that returned, when the signals landed, and its counts.
The default (100 runs of each) takes well under a minute on one CPU core.

    python -m benchmarks.engine.signal_probe [--runs 100] [--handover-runs 100] [--seed 0] [--hang-after 30]
        [--probes abort,stats,hand-over]
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import random
import signal
import sys
import threading
import time
from collections import Counter

import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged.cli.default_model import tiny_llama

PROMPTS, NEW_TOKENS = 4, 24  # requests per run, and each one's new tokens (greedy, no EOS)
HANDOVER_TOKENS = 6  # each one's new tokens in the hand-over probe, whose runs take several tries per step


class Interrupted(BaseException):
    """What the hand-over probe's handler raises: like ``KeyboardInterrupt``, not an ``Exception`` (which the engine
    would take, raised in the forward, for the model's fault)."""


class Watchdog:
    """Ends the process (the stacks of every thread printed) when a run has not returned after ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds, self.what, self.done = seconds, "", threading.Event()

    def run(self, what: str):
        self.what, self.done = what, threading.Event()
        threading.Thread(target=self._watch, args=(self.done,), daemon=True).start()
        return self.done

    def _watch(self, done: threading.Event) -> None:
        if not done.wait(self.seconds):
            print(f"HUNG: {self.what} did not return within {self.seconds:.0f} s; every thread's stack:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
            os._exit(1)


def build_engine() -> hf_paged.Engine:
    torch.manual_seed(0)
    return hf_paged.Engine(tiny_llama(), num_blocks=64, block_size=16, max_num_seqs=8, max_batch_tokens=256)


def add_prompts(engine: hf_paged.Engine, rng: random.Random, new_tokens: int = NEW_TOKENS) -> list[str]:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return [engine.add_request([rng.randrange(3, 259) for _ in range(rng.randint(8, 40))], config)
            for _ in range(PROMPTS)]


def drain(engine: hf_paged.Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def signal_runs(engine: hf_paged.Engine, signum: int, handler, runs: int, rng: random.Random, watchdog: Watchdog,
                check) -> dict:
    """``runs`` runs, each with one ``signum`` sent after a random delay within a run's length; ``handler(record)``
    calls the engine and records what it got; ``check(ids, outs, record, stats_before)`` returns a failure or None."""
    t = time.perf_counter()
    add_prompts(engine, rng)
    drain(engine)
    length = time.perf_counter() - t  # a run's length without signals
    counts, failures = Counter(), []
    previous = signal.signal(signum, lambda s, f: record.append(handler()))
    try:
        for run in range(runs):
            record, before = [], engine.stats()
            done = watchdog.run(f"{signal.Signals(signum).name} run {run + 1} of {runs}")
            ids = add_prompts(engine, rng)
            timer = threading.Timer(rng.uniform(0, 0.9 * length), os.kill, (os.getpid(), signum))
            timer.start()
            outs = drain(engine)
            counts["landed during the steps"] += bool(record)
            timer.join()  # (a signal sent after the last step is handled here, in the main thread)
            counts["returned"] += 1
            done.set()
            failure = check(ids, outs, record, before)
            if failure:
                failures.append(f"run {run + 1}: {failure}")
    finally:
        signal.signal(signum, previous)
    return {"runs": runs, **counts, "failures": failures}


def reported_once(ids: list[str], outs: list) -> str | None:
    got = Counter(o.request_id for o in outs)
    if got != Counter(ids):
        return f"outputs {dict(got)} for requests {ids}"
    return None


def probe_abort(engine, runs, rng, watchdog) -> dict:
    def check(ids, outs, record, before):
        stopped = set(record[0]) if record else set()
        wrong = [o.request_id for o in outs if o.request_id in stopped and o.finish_reason != "abort"]
        return reported_once(ids, outs) or (f"{wrong} were aborted but finished otherwise" if wrong else None)

    return signal_runs(engine, signal.SIGTERM, engine.abort_all, runs, rng, watchdog, check)


def probe_stats(engine, runs, rng, watchdog) -> dict:
    def check(ids, outs, record, before):
        after = engine.stats()
        for got in record:  # the figures of the moment: between those before and after the run
            if not before["generated_tokens"] <= got["generated_tokens"] <= after["generated_tokens"]:
                return f"stats() said {got['generated_tokens']} tokens generated, outside the run's range"
            if got["running"] + got["waiting"] > len(ids):
                return f"stats() said {got['running']} running and {got['waiting']} waiting of {len(ids)}"
        return reported_once(ids, outs)

    return signal_runs(engine, signal.SIGUSR1, engine.stats, runs, rng, watchdog, check)


def probe_handover(engine, runs, rng, watchdog) -> dict:
    """Before each step, SIGALRM is set (``signal.setitimer``) to go off after a random delay of up to twice a step's
    usual length (about half of the signals land in a step). The handler raises only while ``step()`` runs
    (``state["in_step"]``: set and cleared by stores, at which Python does not check for signals), so every exception
    comes from inside the engine."""
    state = {"in_step": False}

    def raising(signum, frame):
        if state["in_step"]:
            raise Interrupted

    add_prompts(engine, rng, HANDOVER_TOKENS)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step_length = sorted(times)[len(times) // 2]
    counts, failures = Counter(), []
    failed_steps = _StepFailures()
    logging.getLogger("hf_paged").addHandler(failed_steps)
    grad = torch.is_grad_enabled()
    previous = signal.signal(signal.SIGALRM, raising)
    try:
        for run in range(runs):
            done = watchdog.run(f"hand-over run {run + 1} of {runs}")
            ids = add_prompts(engine, rng, HANDOVER_TOKENS)
            got: Counter[str] = Counter()
            while engine.has_unfinished():
                counts["steps"] += 1
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2 * step_length))
                try:
                    state["in_step"] = True
                    outs = engine.step()
                    state["in_step"] = False
                except Interrupted:
                    state["in_step"] = False
                    counts["interrupted"] += 1
                    continue
                except Exception as exc:  # the engine broken by an interrupt: the probe cannot go on
                    failures.append(f"run {run + 1}: step() raised {type(exc).__name__}: {exc}")
                    return {"runs": run + 1, "requests": (run + 1) * PROMPTS, **counts, "failures": failures}
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                got.update(o.request_id for o in outs)
            done.set()
            counts["outputs delivered"] += sum(got.values())
            counts["lost"] += sum(rid not in got for rid in ids)
            counts["delivered twice"] += sum(n > 1 for n in got.values())
            if set(got) != set(ids) or any(n > 1 for n in got.values()):
                failures.append(f"run {run + 1}: outputs {dict(got)} for requests {ids}")
            if (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) != (grad, False):
                failures.append(f"run {run + 1}: left grad mode {torch.is_grad_enabled()}, inference mode "
                                f"{torch.is_inference_mode_enabled()}")
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        logging.getLogger("hf_paged").removeHandler(failed_steps)
    failures += [f"a step failed: {message}" for message in failed_steps.messages[:5]]
    return {"runs": runs, "requests": runs * PROMPTS, **counts, "failed steps": len(failed_steps.messages),
            "failures": failures}


class _StepFailures(logging.Handler):
    """The engine's warnings that a step failed (it reruns the step one sequence at a time, so outputs stay right,
    but an interrupt broke something)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "failed" in record.getMessage():
            self.messages.append(record.getMessage())


PROBES = {"abort": probe_abort, "stats": probe_stats, "hand-over": probe_handover}


def run_probes(runs: int = 100, handover_runs: int = 100, seed: int = 0, hang_after: float = 30.0,
               probes: tuple[str, ...] = tuple(PROBES)) -> dict[str, dict]:
    """Each of ``probes`` on one engine (``runs`` runs of abort and stats, ``handover_runs`` of hand-over): per probe,
    its counts and ``failures`` (a list of lines). Signals reach the main thread only: call it there. A hung run ends
    the process (:class:`Watchdog`)."""
    rng, watchdog, engine = random.Random(seed), Watchdog(hang_after), build_engine()
    results = {name: PROBES[name](engine, handover_runs if name == "hand-over" else runs, rng, watchdog)
               for name in PROBES if name in probes}
    engine.check_invariants()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of each signal probe (abort, stats)")
    parser.add_argument("--handover-runs", type=int, default=100, help="runs of the hand-over probe")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the signals' times")
    parser.add_argument("--hang-after", type=float, default=30.0, help="seconds after which a run counts as hung")
    parser.add_argument("--probes", default="abort,stats,hand-over", help="which probes to run, comma-separated")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = run_probes(args.runs, args.handover_runs, args.seed, args.hang_after, tuple(args.probes.split(",")))
    for name, result in results.items():
        counts = {k: v for k, v in result.items() if k != "failures"}
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f", failed {len(result['failures'])}")
        for line in result["failures"][:5]:
            print(f"  {line}")
    failed = any(result["failures"] for result in results.values())
    print(f"{time.perf_counter() - start:.1f} s; {'FAILED' if failed else 'all runs returned, no output lost'}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
