"""The step and the schedule: accumulation equals a larger batch; warmup then cosine to the floor."""
import math
import weakref
from types import SimpleNamespace

import pytest
import torch

from conf.schema import DataConfig
from data import Batch, RecallTask
from model import CausalLM
from trainer.optim import build_optimizer, build_scheduler, lr_multiplier
from trainer.step import train_step

OPTIM = SimpleNamespace(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.1)
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def test_warmup_is_linear_and_cosine_ends_at_the_floor():
    assert [lr_multiplier(s, 4, 20, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(12, 4, 20, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(500, 4, 20, 0.1) == pytest.approx(0.1)


def split(batch: Batch, parts: int) -> list[Batch]:
    rows = batch.input_ids.shape[0] // parts
    return [Batch(*(t[i * rows:(i + 1) * rows] for t in (batch.input_ids, batch.labels, batch.position_ids)))
            for i in range(parts)]


def trained_weights(micro_batches: list[Batch]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = CausalLM.from_config(TINY)
    optimizer = build_optimizer(model, OPTIM, None)
    result = train_step(model, micro_batches, optimizer, build_scheduler(optimizer, OPTIM, 10), grad_clip=0.5,
                        device=torch.device("cpu"))
    assert result.applied and result.supervised == sum(b.num_supervised for b in micro_batches)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_accumulated_micro_batches_update_like_one_batch():
    """The loss is averaged over the step's supervised tokens, so k micro-batches with different numbers of
    answers give the same clipped update as one batch holding them all."""
    batch = next(RecallTask(DataConfig(num_pairs=6, repeats=3, num_queries=4), 64, 4, seed=0, vocab_size=128))
    batch.labels[0, :40] = -100          # uneven supervision across the micro-batches
    whole, accumulated = trained_weights([batch]), trained_weights(split(batch, 2))
    torch.manual_seed(0)
    initial = dict(CausalLM.from_config(TINY).named_parameters())
    for name, weight in whole.items():
        assert not torch.equal(weight, initial[name]), f"{name} was not updated"
        assert torch.allclose(accumulated[name], weight, rtol=0, atol=1e-6), name


def test_accuracy_covers_every_micro_batch():
    """The step's accuracy is over all its supervised tokens, like its loss, not the last micro-batch's."""
    batch = next(RecallTask(DataConfig(num_pairs=6, repeats=3, num_queries=4), 64, 4, seed=0, vocab_size=128))
    torch.manual_seed(0)
    model = CausalLM.from_config(TINY)
    with torch.no_grad():
        predicted = model.lm_head(model(batch.input_ids, position_ids=batch.position_ids)).argmax(-1)
    supervised = batch.labels != -100
    batch.labels[:2] = torch.where(supervised[:2], predicted[:2], batch.labels[:2])   # first half: all right
    expected = float((batch.labels == predicted)[supervised].float().mean())
    assert 0.4 < expected < 0.9
    accuracies = []
    for micro_batches in ([batch], split(batch, 2)):
        torch.manual_seed(0)
        model = CausalLM.from_config(TINY)
        optimizer = build_optimizer(model, OPTIM, None)
        accuracies.append(train_step(model, micro_batches, optimizer, build_scheduler(optimizer, OPTIM, 10),
                                     grad_clip=0.5, device=torch.device("cpu")).accuracy)
    assert accuracies == [pytest.approx(expected), pytest.approx(expected)]


def test_a_micro_batch_output_is_freed_before_the_next_forward():
    """The last hidden state (B x S x hidden, GiBs at long context) must not stay alive through the
    next micro-batch's forward and backward, nor through the optimizer step."""
    batch = next(RecallTask(DataConfig(num_pairs=6, repeats=3, num_queries=4), 64, 4, seed=0, vocab_size=128))
    torch.manual_seed(0)
    model = CausalLM.from_config(TINY)
    optimizer = build_optimizer(model, OPTIM, None)
    outputs, alive_at_forward = [], []
    model.register_forward_pre_hook(lambda module, args: alive_at_forward.append(
        [ref() is not None for ref in outputs]))
    model.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
    optimizer.register_step_pre_hook(lambda *args: alive_at_forward.append([ref() is not None for ref in outputs]))
    train_step(model, split(batch, 2), optimizer, build_scheduler(optimizer, OPTIM, 10), grad_clip=0.5,
               device=torch.device("cpu"))
    assert alive_at_forward == [[], [False], [False, False]]
