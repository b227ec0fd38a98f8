"""Several processes on the CPU (gloo, 2 ranks): a sequence-parallel or data-parallel step equals one
process's step on the same tokens, loss and every gradient within fp32 rounding, for LoRA and full
fine-tuning, with packed documents that cross the ranks' slices and fewer KV heads than ranks."""
import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from conf.errors import ConfigError
from data import Batch
from kernels.attention import choose_route
from kernels.attention.sequence_parallel import check_heads
from model import CausalLM, DecoderConfig
from model.decoder import Attention
from tests.gloo_support import gloo_rank, run_two_ranks
from trainer.build import apply_lora, install_attention_route
from trainer.distributed import World, close_world, world_of
from trainer.loop import finish_job
from trainer.step import train_step

# One KV head for two ranks: the sequence-parallel attention repeats it.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, rope_theta=10000.0)
# Qwen2.5-7B's grouping and bias (7 query heads a KV head): 2 ranks do not divide the 7 query heads, so each
# group is padded to 8 (its KV head repeated on both ranks, 4 query heads each).
QWEN2_5_SHAPED = dict(TINY, family="qwen2", num_attention_heads=7, head_dim=16)
LORA = SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=0.0,
                       lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])
SEQLEN = 24


def _model(train: str, config: dict = TINY) -> torch.nn.Module:
    torch.manual_seed(0)
    model = CausalLM.from_config(DecoderConfig(**config), dtype=torch.float32, device="cpu")
    if train == "lora":
        model = apply_lora(model, LORA)
        with torch.no_grad():     # LoRA B starts at zero: make every adapter matter
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
    with torch.no_grad():     # biases start at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias") or name.endswith("_proj.base_layer.bias"):
                param.uniform_(-1.0, 1.0)
    return model


def _batch(seed: int) -> Batch:
    """Two rows of packed documents; one document spans both ranks' slices, labels partly ignored."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (2, SEQLEN), generator=generator)
    labels = torch.randint(0, TINY["vocab_size"], (2, SEQLEN), generator=generator)
    labels[0, :5] = -100
    cu_seqlens = torch.tensor([0, 7, 20, 31, 48], dtype=torch.int32)
    flat = torch.arange(2 * SEQLEN)
    starts = cu_seqlens[torch.searchsorted(cu_seqlens[1:], flat, right=True)]
    return Batch(ids, labels, (flat - starts).view(2, SEQLEN), cu_seqlens)


def _step(model, batches, world):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    result = train_step(model, batches, optimizer, scheduler, 0.0, torch.device("cpu"), world)
    return result, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _worker(rank: int, init_file: str, failures, train: str, sequence: int, config: dict = TINY):
    with gloo_rank(rank, init_file, failures):
        kernels.set_backend("reference")
        world = world_of(rank, 2, sequence)
        model = _model(train, config)
        mine = [_batch(seed=1)] if sequence == 2 else [_batch(seed=1 + rank)]
        # One process on all the world's tokens: the sequence group's batch, or both data-parallel batches
        # as micro-batches (accumulation equals one larger batch).
        whole = mine if sequence == 2 else [_batch(seed=1), _batch(seed=2)]
        expected, expected_grads = _step(model, whole, World.single())
        group = world.sequence_group if sequence > 1 else None
        install_attention_route(model, choose_route(torch.device("cpu"), 16, "reference", sequence_group=group))
        result, grads = _step(model, mine, world)
        assert result.supervised == expected.supervised and result.tokens == expected.tokens
        assert abs(result.loss - expected.loss) <= 1e-6 * abs(expected.loss), (result.loss, expected.loss)
        assert grads.keys() == expected_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("train", ["lora", "full"])
@pytest.mark.parametrize("sequence", [2, 1], ids=["sequence-parallel", "data-parallel"])
def test_two_processes_take_the_single_process_step(train, sequence):
    run_two_ranks(_worker, train, sequence)


def test_query_heads_the_degree_does_not_divide_are_padded_and_take_the_single_process_step():
    """A Qwen2.5-shaped model (q/k/v bias, 7 query heads over 1 KV head) over 2 ranks: full fine-tuning, loss
    and every gradient (the biases' included) equal one process's."""
    run_two_ranks(_worker, "full", 2, QWEN2_5_SHAPED)


class _Group:
    """Stands for a ProcessGroup: what matters is who still holds it."""


def test_the_end_of_a_job_lets_go_of_the_sequence_group_before_the_world_closes():
    """A process group held past destroy_process_group is freed at interpreter exit, where gloo's destructor
    can abort a rank after a finished run: the job's model (kept alive by its reference cycles) and its World
    let go of it."""
    group = _Group()
    held = weakref.ref(group)
    model = _model("full")
    install_attention_route(model, choose_route(torch.device("cpu"), 16, "reference", sequence_group=group))
    world = World(rank=0, size=1, sequence=1, sequence_group=group)
    job = SimpleNamespace(model=model, world=world, bar=SimpleNamespace(close=lambda: None), wandb_run=None)
    del group
    gc.disable()        # nothing freed by the collector: only what no longer refers to the group
    try:
        finish_job(job, completed=False)
        close_world(world)
        assert held() is None
    finally:
        gc.enable()
    routes = [module.route for module in model.modules() if isinstance(module, Attention)]
    assert routes and all(route.forward == route.backward == "reference" for route in routes)     # the rest kept


def test_heads_must_split_over_the_sequence_group():
    check_heads(32, 8, 16)           # 8 KV heads repeated over 16 ranks
    check_heads(32, 8, 4)
    check_heads(28, 4, 8)            # Qwen2.5-7B: query heads padded
    with pytest.raises(ValueError, match="KV heads \\(8\\) dividing or divisible by 3"):
        check_heads(32, 8, 3)


@pytest.mark.parametrize("heads, kv_heads, degree, padded", [
    (32, 8, 16, 32), (32, 8, 4, 32), (28, 4, 4, 28), (28, 4, 2, 28),    # the degree divides the query heads
    (28, 4, 8, 32), (28, 4, 16, 32), (40, 8, 16, 48), (7, 1, 2, 8)])   # Qwen2.5-7B, -14B; the test's shape
def test_query_heads_are_padded_per_kv_group_to_a_multiple_of_the_ranks_sharing_its_kv_head(
        heads, kv_heads, degree, padded):
    from conf.schema.parallel import padded_query_heads
    from kernels.attention.sequence_parallel import drop_padded_heads, pad_query_heads
    assert padded_query_heads(heads, kv_heads, degree) == padded
    q = torch.randn(1, 3, heads, 2)
    padded_q = pad_query_heads(q, kv_heads, padded)
    # every rank's query heads belong to the one KV head it holds (KV head i // (degree / kv_heads) on rank i)
    per_rank, ranks_per_kv = padded // degree, max(1, degree // kv_heads)
    group, padded_group = heads // kv_heads, padded // kv_heads
    if kv_heads < degree:
        for rank in range(degree):
            rank_heads = range(rank * per_rank, (rank + 1) * per_rank)
            assert {head // padded_group for head in rank_heads} == {rank // ranks_per_kv}
    real = [head for head in range(padded) if head % padded_group < group]
    padding = [head for head in range(padded) if head not in real]
    assert torch.equal(padded_q[:, :, real], q) and not padded_q[:, :, padding].any()
    assert torch.equal(drop_padded_heads(padded_q, kv_heads, heads), q)


def test_a_batch_shard_is_its_slice_with_the_whole_sequences_documents():
    batch = _batch(seed=1)
    second = batch.shard(1, 2)
    assert torch.equal(second.input_ids, batch.input_ids[:, 12:]) and second.cu_seqlens is batch.cu_seqlens
    assert torch.equal(second.position_ids, batch.position_ids[:, 12:])
    with pytest.raises(ValueError, match="24 tokens does not split into 5"):
        batch.shard(0, 5)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.sequence=2"], "must divide the 1 processes"),
    (["parallel.sequence=0"], "must be at least 1"),
])
def test_parallel_settings_are_checked(overrides, message):
    from hydra import compose, initialize_config_dir
    from conf.schema import register_configs
    from conf.validate import validate
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_a_degree_the_kv_heads_neither_split_nor_repeat_over_is_refused_before_anything_is_built(monkeypatch):
    """Qwen2.5-7B's 4 KV heads over 6 ranks: one line from validation; over 8 (28 query heads padded) none."""
    from hydra import compose, initialize_config_dir
    from conf.schema import register_configs
    from conf.validate import validate
    register_configs()
    conf_dir = str(Path(__file__).resolve().parents[1] / "conf")
    for degree in (6, 8):
        monkeypatch.setenv("WORLD_SIZE", str(degree))
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose("config", overrides=["model=qwen2_5_7b", "seq_len=24576", f"parallel.sequence={degree}"])
        if degree == 8:
            validate(cfg)
            continue
        with pytest.raises(ConfigError) as refused:
            validate(cfg)
        assert str(refused.value) == ("parallel.sequence=6 shards attention heads: it must divide or be a multiple "
                                      "of the model's 4 KV heads (its 28 query heads are padded to a multiple)")


@pytest.mark.parametrize("full_state", ["bf16", "bf16_host_grads"])
def test_streamed_full_fine_tuning_states_run_over_several_processes_only_sharded(monkeypatch, full_state):
    """StreamedAdamW takes each gradient in the backward: over several processes it needs FSDP2's reduced
    shards (parallel.shard=true), not gradients World.sum_gradients sums after the backward."""
    from hydra import compose, initialize_config_dir
    from conf.schema import register_configs
    from conf.validate import validate
    register_configs()
    monkeypatch.setenv("WORLD_SIZE", "2")
    overrides = ["train=full", f"train.full_state={full_state}", "parallel.sequence=2"]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        sharded = compose("config", overrides=[*overrides, "parallel.shard=true"])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert str(refused.value) == (
        f"train.full_state={full_state} runs over several processes only sharded (FSDP2 sums each gradient over the "
        f"ranks before the optimizer takes it): set parallel.shard=true, or train.full_state=fp32 (16 bytes per "
        f"parameter on each GPU)")
    validate(sharded)
