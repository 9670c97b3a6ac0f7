"""Real TRL training (GRPO, RLOO) generating its rollouts with hf_paged through ``use_hf_paged`` (docs/guides/rl.md).

A tiny random-init Llama over the byte tokenizer trains on the CPU for four optimizer steps with the Trainer's default
fused AdamW, gradient checkpointing, and dropout on (the model generates in eval mode regardless): GRPO the whole
model with TRL's defaults (``bf16=True``, on which TRL casts the model to bfloat16 before every generation) and in
float32 (``bf16=False``, also loaded with ``attn_implementation="hf_paged"``), RLOO peft LoRA adapters in bfloat16
where the CPU has it. The kept engine is made before training, so TRL's cast changes the dtype under it. After every
optimizer step a callback checks the kept engine against oracles on the updated weights: greedy completions equal
eager ``generate``, seeded completions equal a fresh engine's, and (float32) the processed logprobs equal the
trainer's own log-probabilities of the same tokens within 1e-4. The prompts are longer than a KV block, so the kept
engine's prefix cache holds their KV from the step before: KV of stale weights changes the completions. After
training, transformers' own ``generate_batch`` serves the model again.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM, TrainerCallback

import hf_paged
from hf_paged.cli.default_model import byte_tokenizer
from hf_paged.integrations.trl import disable_generate_batch, use_hf_paged

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over it", "A longer prompt: twenty bytes or more", "Sing, muse, of a tiny Llama",
           "Reinforcement learning from rewards"]
NEW_TOKENS = 6
TEMPERATURE = 0.7
STEPS = 4
#: GRPOConfig and RLOOConfig default to bf16=True, on which TRL casts the model to bfloat16 before every generation:
#: float32 training must turn it off.
FLOAT32 = {"bf16": False}


def _model(attention: str = "sdpa") -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, attention_dropout=0.2,  # (eval mode must turn it off)
                         attn_implementation=attention)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _reward(completions, **kwargs) -> list[float]:
    """Spread rewards (the bytes' sum modulo 13), so that every step has advantages and changes the weights."""
    return [float(sum(map(ord, text)) % 13) for text in completions]


class StepChecks(TrainerCallback):
    """After each optimizer step: the kept engine against eager ``generate``, a fresh engine and the trainer."""

    def __init__(self, trainer, prompt_ids: list[list[int]], logprobs: bool | str):
        """``logprobs``: check the kept engine's logprobs against a fresh engine's (True), and also against the
        trainer's ("trainer")."""
        self.trainer, self.prompt_ids, self.logprobs, self.steps = trainer, prompt_ids, logprobs, 0
        self.weights = self._trained()

    def _trained(self) -> torch.Tensor:
        return torch.cat([p.detach().float().flatten() for p in self.trainer.model.parameters() if p.requires_grad])

    def on_train_begin(self, args, state, control, **kwargs):
        """Before TRL's first generation and its cast to bfloat16 (``bf16=True``): the kept engine is made on the
        model as it was given, so that the cast changes the dtype under it. (No oracle here: with ``bf16=True``
        accelerate runs the float32 model's own forward under bfloat16 autocast.)"""
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        rollout = self.prompt_ids * args.num_generations  # (TRL's workload: the engine is kept for TRL's first call)
        model.generate_batch(rollout, generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=-1),
                             continuous_batching_config=self.trainer.continuous_batching_config)

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        weights = self._trained()
        assert not torch.equal(weights, self.weights), "the step changed no weight: the checks would prove nothing"
        self.weights, self.steps = weights, self.steps + 1
        batching = self.trainer.continuous_batching_config  # (TRL's, so the kept engine is the one TRL used)
        with self._eval(model) as base:
            self._greedy(model, base, state.global_step)
            sampled = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                       max_new_tokens=NEW_TOKENS, eos_token_id=-1)
            seeded = ContinuousBatchingConfig(max_memory_percent=batching.max_memory_percent, seed=state.global_step,
                                              return_logprobs=self.logprobs)
            kept = model.generate_batch(self.prompt_ids, generation_config=sampled, continuous_batching_config=seeded)
            alone = ContinuousBatchingConfig(seed=state.global_step, return_logprobs=self.logprobs)
            alone.logprobs_mode = "processed_logprobs"
            fresh = hf_paged.generate_batch(base, self.prompt_ids, sampled, alone)
            assert [o.generated_tokens for o in kept.values()] == [o.generated_tokens for o in fresh.values()]
            if self.logprobs:
                # (the logprobs see KV of stale weights where the sampled tokens happen to agree)
                torch.testing.assert_close([o.logprobs for o in kept.values()],
                                           [o.logprobs for o in fresh.values()], atol=1e-5, rtol=0)
            if self.logprobs == "trainer":
                self._check_logprobs(list(kept.values()))

    def _greedy(self, model, base, step: int):
        """The kept engine's greedy completions (through ``model.generate_batch``, with TRL's batching config)
        against eager ``generate`` on ``base``, the model in eval mode."""
        greedy = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=-1)
        kept = model.generate_batch(self.prompt_ids, generation_config=greedy,
                                    continuous_batching_config=self.trainer.continuous_batching_config)
        for ids, out in zip(self.prompt_ids, kept.values()):
            want = base.generate(torch.tensor([ids]), generation_config=greedy, pad_token_id=0)[0, len(ids):]
            assert out.generated_tokens == want.tolist(), f"step {step}: greedy {ids[:4]}..."

    @contextlib.contextmanager
    def _eval(self, model):
        """The transformers model of ``model`` in eval mode (dropout off, for the eager oracles), then its mode
        back."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        training = base.training
        base.eval()
        try:
            yield base
        finally:
            base.train(training)

    def _check_logprobs(self, outputs):
        """The kept engine's processed logprobs against the trainer's ``log_softmax(logits / T)`` of the tokens."""
        rows = [o.prompt_ids + o.generated_tokens for o in outputs]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            want, _, _ = self.trainer._get_per_token_logps_and_entropies(self.trainer.model, ids, mask, NEW_TOKENS)
        got = torch.tensor([o.logprobs for o in outputs])
        torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=0)


def _train(trainer_cls, config_cls, model, logprobs: bool | str, **extra):
    tokenizer = byte_tokenizer()
    from datasets import Dataset

    args = config_cls(output_dir="unused", per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=NEW_TOKENS, max_steps=STEPS, learning_rate=1e-2, temperature=TEMPERATURE,
                      report_to="none", use_cpu=True, save_strategy="no", seed=0, gradient_checkpointing=True,
                      **extra.pop("args", {}))
    trainer = trainer_cls(model=model, reward_funcs=_reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), **extra)
    assert trainer.args.optim == "adamw_torch_fused" and trainer.args.gradient_checkpointing
    use_hf_paged(trainer, logprobs_mode="processed_logprobs")
    checks = StepChecks(trainer, [tokenizer(p)["input_ids"] for p in PROMPTS], logprobs)
    trainer.add_callback(checks)
    trainer.train()
    assert checks.steps == STEPS
    return trainer


def test_grpo_with_trls_default_bfloat16_generates_on_the_current_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = _train(trl.GRPOTrainer, trl.GRPOConfig, _model(), logprobs=True)
    # (accelerate's mixed-precision wrapper off the forward: its outputs' cast to float32 fails on transformers' cache)
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    assert model.dtype == torch.bfloat16  # (TRL cast it before generating: the whole run was in bfloat16)
    # transformers' own generate_batch serves the model again once hf_paged lets it go, with its own generate's tokens
    disable_generate_batch(model)
    assert model.generate_batch.__func__ is type(model).generate_batch and not hasattr(model, "_hf_paged_engine")
    assert model.config._attn_implementation == "sdpa"
    prompts = [byte_tokenizer()(p)["input_ids"] for p in PROMPTS]
    greedy = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=-1)
    theirs = model.eval().generate_batch(prompts, generation_config=GenerationConfig(**greedy), progress_bar=False,
                                         continuous_batching_config=ContinuousBatchingConfig(num_blocks=16,
                                                                                             max_batch_tokens=64))
    assert [o.generated_tokens for o in theirs.values()] == [
        model.generate(torch.tensor([p]), generation_config=GenerationConfig(**greedy), pad_token_id=0)[0, len(p):]
        .tolist() for p in prompts]


def test_grpo_trains_a_model_loaded_with_the_paged_attention(tmp_path, monkeypatch):
    """A model loaded with ``attn_implementation="hf_paged"`` (which transformers' own ``generate_batch`` refuses)
    trains through its dense path, with gradients, checkpointing and dropout, and generates on hf_paged's engine."""
    monkeypatch.chdir(tmp_path)
    model = _model("hf_paged")
    _train(trl.GRPOTrainer, trl.GRPOConfig, model, logprobs=True, args=FLOAT32)
    assert model.config._attn_implementation == "hf_paged"


def test_grpo_processed_logprobs_equal_the_trainers(tmp_path, monkeypatch):
    """In float32 (in bfloat16 the trainer's and the engine's forwards differ by its rounding, ~3e-3 here)."""
    monkeypatch.chdir(tmp_path)
    _train(trl.GRPOTrainer, trl.GRPOConfig, _model(), logprobs="trainer", args=FLOAT32)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bfloat16 kernels")
def test_rloo_with_lora_in_bfloat16_generates_on_the_current_weights(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    _train(trl.RLOOTrainer, trl.RLOOConfig, _model(), logprobs=False, args={"bf16": True},
           peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules="all-linear"))
