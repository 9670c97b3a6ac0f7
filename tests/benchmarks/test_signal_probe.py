"""What ``benchmarks/engine/signal_probe.py``'s hand-over probe found, pinned: a signal's handler that raises while
a step's device work runs (the forward, without the engine's lock) runs once that work has ended, so that no exception
lands inside torch's own Python code (between an inference-mode context's entry and its exit, which would leave the
mode switched for the thread and break later steps); the step is dropped and the next ones deliver every output."""

from __future__ import annotations

import random
import signal

import torch

from benchmarks.engine import signal_probe


def test_a_handler_raising_during_the_forward_runs_after_it_and_the_outputs_are_those_of_a_clean_run():
    def run(interrupt: bool) -> dict:
        engine = signal_probe.build_engine()
        ids = signal_probe.add_prompts(engine, random.Random(3), new_tokens=5)
        forward, ran, seen = engine.runner.forward, [], []

        def interrupted_forward(*args, **kwargs):
            engine.runner.forward = forward  # (once)
            signal.raise_signal(signal.SIGALRM)
            out = forward(*args, **kwargs)
            ran.append(True)
            return out

        def handler(signum, frame):
            seen.append(bool(ran))
            raise signal_probe.Interrupted

        previous = signal.signal(signal.SIGALRM, handler)
        try:
            if interrupt:
                engine.runner.forward = interrupted_forward
                try:
                    engine.step()
                except signal_probe.Interrupted:
                    pass
            outs = signal_probe.drain(engine)
        finally:
            signal.signal(signal.SIGALRM, previous)
        assert seen == ([True] if interrupt else [])  # the handler ran once the forward was over
        engine.check_invariants()
        assert sorted(o.request_id for o in outs) == sorted(ids)
        return {o.request_id: (list(o.token_ids), o.finish_reason) for o in outs}

    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    assert run(interrupt=True) == run(interrupt=False)
    assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == (grad, inference)
