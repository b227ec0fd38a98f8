"""Full fine-tuning with StreamedAdamW on CPU (host buffers plain, copies synchronous): AdamW semantics,
exact clipping and accumulation while gradients leave during the backward, checkpoints, update quality
of bf16 weights with stochastic rounding against torch AdamW on fp32 weights, and the planner's choice."""
import io
from types import SimpleNamespace

import pytest
import torch

import kernels
from conf.schema import DataConfig, MemoryConfig
from data import Batch, RecallTask
from model import CausalLM, DecoderConfig
from conf.schema.memory import MemoryConfig
from offload.byte_model import Capacity
from offload.plan import plan_memory
from offload.policy import apply_memory_policy
from offload.units import GIB
from trainer.streamed_adamw import StreamedAdamW, update_units
from trainer.optim import build_optimizer
from trainer.checkpoint.sharded_state import load_sharded_state, save_sharded_state
from trainer.step import train_step

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0)
OPTIM = SimpleNamespace(lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
RECALL = DataConfig(num_pairs=4, repeats=4, num_queries=4, num_keys=16, num_values=16)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def reference_kernels():
    kernels.set_backend("reference")
    yield
    kernels.set_backend("auto")


def tiny_model(dtype=torch.float32, tiles=3, placements=None, **arch):
    """Checkpointed layers and a tiled MLP, so a layer's gradients accumulate several times per backward."""
    torch.manual_seed(0)
    model = CausalLM.from_config(DecoderConfig(**{**TINY, **arch}), dtype=dtype)
    apply_memory_policy(model, placements or ["gpu"] * model.config.num_hidden_layers, tiles, CPU)
    return model


def streamed(model, grads_on_host=True, cfg=OPTIM):
    return build_optimizer(model, cfg, "bf16_host_grads" if grads_on_host else "bf16")


def batches(count, batch_size=2, seq_len=64, seed=0):
    task = RecallTask(RECALL, seq_len, batch_size, seed, TINY["vocab_size"])
    return [next(task) for _ in range(count)]


def concatenated(parts: list[Batch]) -> Batch:
    return Batch(*(torch.cat([getattr(b, f) for b in parts]) for f in ("input_ids", "labels", "position_ids")))


def run_steps(model, optimizer, steps, grad_clip=0.05, accumulate=2):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return [train_step(model, batches(accumulate, seed=step), optimizer, scheduler, grad_clip, CPU)
            for step in range(steps)]


def assert_same_parameters(model, reference, atol=1e-5):
    """Equal up to summation order: atol is 1/300 of one step (lr 3e-3), where Adam's
    normalisation turns rounding noise of near-zero gradients into visible differences."""
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("grads_on_host, placements", [(True, None), (False, None),
                                                        (True, ["full", "gpu", "full"])],
                         ids=["host-grads", "gpu-grads", "host-grads-full-layers"])
def test_matches_torch_adamw_with_accumulation_and_exact_clipping(grads_on_host, placements):
    """Full layers (plain autograd) back-propagate layer by layer too: units still complete in order."""
    reference, model = tiny_model(), tiny_model(placements=placements)
    expected = run_steps(reference, build_optimizer(reference, OPTIM, None), steps=3)
    optimizer = streamed(model, grads_on_host)
    assert isinstance(optimizer, StreamedAdamW)
    measured = run_steps(model, optimizer, steps=3)
    for ours, theirs in zip(measured, expected):
        assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-5)
        assert ours.grad_norm > 0.05            # clipping was active
    assert_same_parameters(model, reference)
    if grads_on_host:
        assert all(p.grad is None for p in model.parameters())    # no gradient stays behind


def test_accumulated_micro_batches_equal_one_large_batch():
    split, whole = tiny_model(), tiny_model()
    split_opt, whole_opt = streamed(split), streamed(whole)
    scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # noqa: E731
    for step in range(2):
        parts = batches(3, batch_size=1, seed=step)
        train_step(split, parts, split_opt, scheduler(split_opt), 1.0, CPU)
        train_step(whole, [concatenated(parts)], whole_opt, scheduler(whole_opt), 1.0, CPU)
    assert_same_parameters(split, whole)


@pytest.mark.parametrize("grads_on_host", [True, False])
def test_tied_embeddings_and_a_parameter_without_gradient_match_torch_adamw(grads_on_host):
    """The tied embedding/head gets one update from both uses; a parameter outside the graph gets none
    (no state, no weight decay, no step count), as torch AdamW skips a parameter whose grad is None."""
    reference, model = (tiny_model(tiles=2, num_hidden_layers=2, tie_word_embeddings=True) for _ in range(2))
    for m in (reference, model):
        m.unused = torch.nn.Parameter(torch.ones(4, 4))
    expected = run_steps(reference, build_optimizer(reference, OPTIM, None), steps=2)
    optimizer = streamed(model, grads_on_host)
    measured = run_steps(model, optimizer, steps=2)
    assert [r.grad_norm for r in measured] == pytest.approx([r.grad_norm for r in expected], rel=1e-5)
    assert_same_parameters(model, reference)
    assert torch.equal(model.unused, torch.ones(4, 4)) and model.unused not in optimizer.state
    assert int(optimizer.state[model.lm_head.weight]["step"]) == 2


@pytest.mark.parametrize("grads_on_host", [True, False])
def test_a_skipped_step_leaves_no_gradient_behind(grads_on_host):
    """A NaN step is not applied, and the next step sees only its own gradients: the same weights and
    norm as a run that never had the bad step."""
    poisoned, clean = tiny_model(tiles=1, num_hidden_layers=2), tiny_model(tiles=1, num_hidden_layers=2)
    poisoned_opt, clean_opt = streamed(poisoned, grads_on_host), streamed(clean, grads_on_host)
    run_steps(poisoned, poisoned_opt, steps=1)
    run_steps(clean, clean_opt, steps=1)
    hook = poisoned.model.layers[0].register_forward_hook(lambda module, args, output: output * float("nan"))
    bad = run_steps(poisoned, poisoned_opt, steps=1)[0]
    hook.remove()
    assert not bad.applied
    assert_same_parameters(poisoned, clean, atol=0)
    after_poisoned, after_clean = run_steps(poisoned, poisoned_opt, steps=2)[1], run_steps(clean, clean_opt, steps=2)[1]
    assert after_poisoned.applied and after_poisoned.grad_norm == after_clean.grad_norm
    assert_same_parameters(poisoned, clean, atol=0)


def test_units_are_decoder_layers_in_forward_order():
    model = tiny_model()
    units = update_units(model)
    assert [len(u) for u in units] == [1, 9, 9, 9, 1, 1]       # embedding, 3 layers, final norm, head
    assert units[1] == list(model.model.layers[0].parameters())


def test_state_dict_round_trip_continues_identically():
    model = tiny_model(torch.bfloat16)
    optimizer = streamed(model)
    run_steps(model, optimizer, steps=2)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    restored_model = tiny_model(torch.bfloat16)
    restored_model.load_state_dict(model.state_dict())
    restored = streamed(restored_model)
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    state = restored.state[next(restored_model.parameters())]
    assert state["exp_avg"].dtype == torch.bfloat16 and int(state["step"]) == 2
    run_steps(model, optimizer, steps=1)
    run_steps(restored_model, restored, steps=1)
    for param, expected in zip(restored_model.parameters(), model.parameters()):
        assert torch.equal(param, expected)         # same state, same stochastic-rounding draws



@pytest.mark.parametrize("grads_on_host", [True, False], ids=["host-grads", "gpu-grads"])
def test_a_distributed_checkpoint_of_fp32_adamw_resumes_into_streamed_states(tmp_path, grads_on_host):
    """A job over several processes saves fp32 AdamW state through DCP; resumed on one GPU that plans bf16
    states, every moment arrives (a fresh StreamedAdamW has none for DCP to load into until init_state)."""
    model = tiny_model()
    adamw = build_optimizer(model, OPTIM, "fp32")
    run_steps(model, adamw, steps=2)
    save_sharded_state(tmp_path / "state", model, adamw)
    resumed_model = tiny_model(torch.bfloat16)
    resumed = streamed(resumed_model, grads_on_host)
    load_sharded_state(tmp_path / "state", resumed_model, resumed)
    for (name, param), saved in zip(resumed_model.named_parameters(), model.parameters()):
        state, expected = resumed.state[param], adamw.state[saved]
        assert int(state["step"]) == 2, name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert state[moment].dtype == torch.bfloat16
            torch.testing.assert_close(state[moment].float(), expected[moment], rtol=1e-2, atol=1e-12, msg=name)
        torch.testing.assert_close(param.float(), saved, rtol=1e-2, atol=1e-3, msg=name)

def demo_losses(model, optimizer, steps=300, batch_size=4, seq_len=64):
    task = RecallTask(RECALL, seq_len, batch_size, 0, TINY["vocab_size"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * (1 - 0.9 * step / steps))
    return [train_step(model, [next(task)], optimizer, scheduler, 1.0, CPU).loss for _ in range(steps)]


@pytest.fixture(autouse=True)
def one_thread():
    """These matrices are too small for intra-op threads, which only contend (10x slower on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bf16_stochastic_rounding_tracks_fp32_adamw_on_the_demo():
    """300 steps of the recall demo: bf16 weights and moments (no fp32 master) end within 1% of the loss
    of torch AdamW on fp32 weights, and the task is learned (far below chance, ln 16 = 2.77)."""
    cfg = SimpleNamespace(**{**vars(OPTIM), "weight_decay": 0.0})
    reference = tiny_model(tiles=1, num_hidden_layers=2)
    expected = demo_losses(reference, build_optimizer(reference, cfg, None))
    model = tiny_model(torch.bfloat16, tiles=1, num_hidden_layers=2)
    measured = demo_losses(model, streamed(model, cfg=cfg))
    final_expected, final_measured = sum(expected[-30:]) / 30, sum(measured[-30:]) / 30
    assert final_expected < 0.6
    assert final_measured == pytest.approx(final_expected, rel=0.01)


H100_HOST = Capacity(gpu=int(79.2 * GIB), host=125 * GIB, pinnable=100 * GIB)


@pytest.mark.parametrize("seq_len, layout", [(4096, "bf16"), (131072, "bf16_host_grads"),
                                             (262144, "bf16_host_grads")])
def test_planner_picks_the_largest_layout_that_fits_8b(seq_len, layout):
    train = SimpleNamespace(mode="full", full_state="auto")
    plan = plan_memory(DecoderConfig(), train, MemoryConfig(), seq_len, 1, torch.device("cuda"), H100_HOST)
    assert plan.fits and plan.full_state == layout


def test_planner_fails_with_numbers_when_no_layout_fits():
    train = SimpleNamespace(mode="full", full_state="auto")
    plan = plan_memory(DecoderConfig(), train, MemoryConfig(), 32768, 1, torch.device("cuda"),
                       Capacity(gpu=40 * GIB, host=125 * GIB, pinnable=100 * GIB))
    assert not plan.fits and plan.full_state == "bf16_host_grads"
    assert "bf16 adam moments" in plan.failure() and "GiB" in plan.failure()
