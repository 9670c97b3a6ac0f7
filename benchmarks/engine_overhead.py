"""The engine's own cost per step on a CPU: scheduling + planning + sampling, with a model that costs nothing.

256 running requests with ~1k tokens of context each decode one token per step; the stub model returns fixed
logits, so the time per ``engine.step()`` is the engine's overhead alone. Goal: at most 1 ms per step.

    python benchmarks/engine_overhead.py [--vocab 1024] [--steps 200]
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from transformers import GenerationConfig, LlamaConfig

import hf_paged


class StubModel(torch.nn.Module):
    """Quacks like a causal LM for the engine; ``forward`` returns the same logits every time."""

    def __init__(self, vocab: int):
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, max_position_embeddings=4096)
        self.config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
        self.generation_config = GenerationConfig(eos_token_id=None)
        self.register_buffer("logits", torch.randn(1, 4096, vocab))
        self.eval()

    @property
    def device(self):
        return self.logits.device

    @property
    def dtype(self):
        return self.logits.dtype

    def forward(self, input_ids, position_ids, past_key_values, use_cache, logits_to_keep):
        return SimpleNamespace(logits=self.logits[:, : logits_to_keep.numel()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    block_size = 16
    prefill_steps = args.requests * (args.context + 50) // 2048 + 2  # early requests decode meanwhile
    blocks = args.requests * -(-(args.context + 50 + prefill_steps + args.steps) // block_size)
    engine = hf_paged.Engine(StubModel(args.vocab), num_blocks=blocks, block_size=block_size,
                             max_batch_tokens=2048, max_num_seqs=args.requests, enable_prefix_caching=True)
    config = GenerationConfig(max_new_tokens=10**6, do_sample=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.requests):
        n = args.context + int(torch.randint(-50, 50, (), generator=g))
        engine.add_request(torch.randint(0, args.vocab, (n,), generator=g).tolist(), config)
    while engine.stats()["waiting"] or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()  # prefill everything first
    engine.counters.phase_seconds.clear()
    engine.counters.steps = 0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    stats = engine.stats()
    assert stats["running"] == args.requests and stats["preemptions"] == 0, stats
    print(f"{args.requests} running requests, ~{args.context} tokens of context, vocab {args.vocab}, "
          f"1 CPU thread, torch {torch.__version__}")
    print(f"engine overhead per decode step: median {statistics.median(times) * 1e3:.3f} ms, "
          f"mean {statistics.mean(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms (goal <= 1 ms)")
    print("mean per phase:", ", ".join(f"{k} {v:.3f} ms" for k, v in stats["ms_per_step"].items()))


if __name__ == "__main__":
    main()
