"""Full fine-tuning's bf16 states sharded by FSDP2 over 2 CPU processes (gloo): bf16 weights and moments with
stochastic rounding, gradients on the device or streamed to host memory, and the exact global-norm clip take
the steps one process takes on the world's batches, and their checkpoint (DCP) resumes exactly.

The comparison is meaningful with stochastic rounding because the rounding does not depend on the sharding:
an element draws its noise by its index in the whole parameter (kernels.reference.round_stochastically's
`first`), so a rank updating its shard rounds each element exactly as one process updating the whole tensor.
The ranks are data parallel, one batch each, against one process taking both batches as two micro-batches:
every per-token computation is the same, and each gradient is the sum of the same two bf16 terms (FSDP2's
reduce-scatter, or one process's accumulation), so the two runs may differ only by the order of the float
sums behind the loss and the norm."""
from pathlib import Path

import pytest
import torch

import kernels
from data import RecallTask
from conf.schema import DataConfig
from model import CausalLM, DecoderConfig
from offload.policy import apply_memory_policy
from tests.gloo_support import gloo_rank, run_two_ranks
from trainer.checkpoint.sharded_state import load_sharded_state, save_sharded_state
from trainer.distributed import World, world_of
from trainer.optim import build_optimizer
from trainer.sharding import shard_model
from trainer.step import train_step
from trainer.streamed_adamw import StreamedAdamW
from types import SimpleNamespace

# 95 tokens: the embedding and the head split unevenly over 2 ranks (48 and 47 rows).
TINY = dict(vocab_size=95, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0)
OPTIM = SimpleNamespace(lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
RECALL = DataConfig(num_pairs=4, repeats=4, num_queries=4, num_keys=16, num_values=16)
CPU = torch.device("cpu")
STEPS = 3
# Below the gradients' norm: the clip is active at every step, so its coefficient is in every update.
GRAD_CLIP = 0.05


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """Checkpointed layers, the MLP untiled: one process adds each micro-batch's gradient to the sum whole, as
    the reduce-scatter adds the ranks' (tiles would add it in parts, rounded differently in bf16)."""
    torch.manual_seed(0)
    model = CausalLM.from_config(DecoderConfig(**TINY), dtype=dtype)
    apply_memory_policy(model, ["gpu"] * TINY["num_hidden_layers"], 1, CPU)
    return model


def _batches(step: int, count: int):
    task = RecallTask(RECALL, 64, 1, step, TINY["vocab_size"])
    return [next(task) for _ in range(count)]


def _train(model, full_state: str, world: World, batches_of):
    optimizer = build_optimizer(model, OPTIM, full_state)
    assert isinstance(optimizer, StreamedAdamW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    results = [train_step(model, batches_of(step), optimizer, scheduler, GRAD_CLIP, CPU, world)
               for step in range(STEPS)]
    return results, optimizer


def _worker(rank: int, init_file: str, failures, full_state: str, dtype: torch.dtype, per_rank: int, atol: float):
    with gloo_rank(rank, init_file, failures):
        kernels.set_backend("reference")
        torch.set_num_threads(1)
        one = _model(dtype)
        expected, _ = _train(one, full_state, World.single(), lambda step: _batches(step, 2 * per_rank))
        world = world_of(rank, 2, 1)
        model = _model(dtype)
        shard_model(model, world, CPU)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        measured, optimizer = _train(model, full_state, world, lambda step: _batches(step, 2 * per_rank)[mine])
        for ours, theirs in zip(measured, expected):
            assert ours.applied and ours.supervised == theirs.supervised, (ours, theirs)
            assert abs(ours.loss - theirs.loss) <= 1e-5 * theirs.loss, (ours.loss, theirs.loss)
            assert abs(ours.grad_norm - theirs.grad_norm) <= 1e-5 * theirs.grad_norm, (ours, theirs)
            assert ours.grad_norm > GRAD_CLIP, ours.grad_norm
        for (name, param), whole in zip(model.named_parameters(), one.parameters()):
            assert param.to_local().numel() < whole.numel(), name          # each rank updated its shard alone
            state = optimizer.state[param]
            assert state["exp_avg"].to_local().dtype == dtype and int(state["step"]) == STEPS, name
            torch.testing.assert_close(param.full_tensor(), whole.detach(), rtol=1e-5, atol=atol, msg=name)
        if full_state == "bf16_host_grads":
            assert all(p.grad is None for p in model.parameters())      # every gradient went to the host
        _resumes_exactly(model, optimizer, dtype, full_state, world, Path(init_file).parent / "state",
                         _batches(STEPS, 2 * per_rank)[mine])


def _resumes_exactly(model, optimizer, dtype, full_state: str, world: World, directory: Path, batches) -> None:
    """The sharded state saved through DCP and loaded into a new sharded model and optimizer takes the next
    step bit for bit as the uninterrupted one: moments restored, rounding draws a function of the step."""
    save_sharded_state(directory, model, optimizer)
    resumed = _model(dtype)
    shard_model(resumed, world, CPU)
    resumed_optimizer = build_optimizer(resumed, OPTIM, full_state)
    load_sharded_state(directory, resumed, resumed_optimizer)
    for each, each_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        scheduler = torch.optim.lr_scheduler.LambdaLR(each_optimizer, lambda step: 1.0)
        train_step(each, batches, each_optimizer, scheduler, GRAD_CLIP, CPU, world)
    for (name, param), continued in zip(resumed.named_parameters(), model.parameters()):
        assert torch.equal(param.to_local(), continued.to_local()), name


@pytest.mark.parametrize("full_state", ["bf16", "bf16_host_grads"])
def test_two_sharded_processes_take_the_single_process_steps(full_state):
    run_two_ranks(_worker, full_state, torch.bfloat16, 1, 0.0)


def test_sharded_host_gradients_accumulate_over_micro_batches():
    """Two micro-batches a rank: the first's shard of the reduced gradient waits on the host and is added to
    the second's. fp32 weights, as bf16 sums in another order round apart; atol as in test_full_finetune (Adam
    normalises the rounding noise of near-zero gradients)."""
    run_two_ranks(_worker, "bf16_host_grads", torch.float32, 2, 1e-5)
