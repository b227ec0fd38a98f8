"""The memory planner: byte counts, policy choice for the H100 host, and failing before the model is built."""
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conf.capability import gpu_capability
from conf.errors import ConfigError
from conf.schema.memory import MemoryConfig, check_memory
from kernels.attention import candidates
from model import DecoderConfig
from offload.byte_model import (Capacity, full_layer_bytes, loss_bytes, parameter_counts, pinned_size,
                                top_layer_full_costs_nothing, transient_bytes)
from offload.engine import CopyEngine
from offload.placement import (FULLEST_MOMENT, MADE_LAST, PREFETCH_SLOT, GpuRoom, backward_attention_forwards,
                               recompute_flops)
from offload.plan import Ranks, layer_parameters, plan_memory
from offload.store import AttentionPlacement, LayerInputStore, Placement, rebuilds_attention
from offload.units import GIB

P, A = Placement, AttentionPlacement       # short names for the plans the tests spell out

LLAMA3_8B = DecoderConfig()
LORA = SimpleNamespace(mode="lora", lora_r=16, lora_dropout=0.0, lora_target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
H100_HOST = Capacity(gpu=int(79.2 * GIB), host=125 * GIB, pinnable=100 * GIB)
# The H100 machine as the planner sees it (3/4 of its host pinnable): 23 layer inputs and 1.75 GiB more.
H100_MACHINE = Capacity(gpu=int(79.2 * GIB), host=125 * GIB, pinnable=int(93.75 * GIB))
CUDA = torch.device("cuda")
# What the planner tries for kernels=auto on a Hopper GPU: cuDNN's backward, then ours.
HOPPER_ROUTES = candidates(CUDA, 128, "auto", planned_gpu=gpu_capability("h100_80gb"))
ROOT = Path(__file__).resolve().parents[1]


def plan(seq_len, memory=None, capacity=H100_HOST, train=LORA):
    return plan_memory(LLAMA3_8B, train, memory or MemoryConfig(), seq_len, 1, CUDA, capacity)


def test_parameter_counts_of_llama3_8b():
    total, lora = parameter_counts(LLAMA3_8B, LORA)
    assert total - lora == 8_030_261_248                      # Meta-Llama-3-8B
    assert lora == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * (4096 + 14336))


@pytest.mark.parametrize("group, published", [("qwen2_5_7b", 7_615_616_512), ("llama3_2_3b", 3_212_749_824),
                                               ("llama3_2_1b", 1_235_814_400), ("mistral_7b", 7_248_023_552)])
def test_parameter_counts_of_the_family_groups_are_their_checkpoints_and_our_models(group, published):
    """Qwen2.5's q/k/v biases and Llama 3.2's one tied embedding are counted: the published sizes, and the
    parameters of the model built (on the meta device)."""
    from omegaconf import OmegaConf

    from conf.schema.model import ModelConfig
    from model import CausalLM
    from trainer.architecture import architecture, group_values
    arch = architecture(OmegaConf.merge(OmegaConf.structured(ModelConfig), group_values(group)))
    with torch.device("meta"):
        built = sum(param.numel() for param in CausalLM(arch).parameters())
    assert parameter_counts(arch, SimpleNamespace(mode="full"))[0] == built == published


def test_pinned_buffers_round_to_powers_of_two():
    assert pinned_size(GIB) == GIB and pinned_size(GIB + 1) == 2 * GIB


def test_short_sequences_keep_every_input_on_the_gpu():
    """Every input but layer 0's, the token embedding's output, which its backward looks up again."""
    short = plan(32768, MemoryConfig(full_layers=0))
    assert short.fits and short.placements == [P.EMBEDDING] + [P.GPU] * 31 and short.pinned == 0
    assert "layer 0's input looked up again from the embedding" in short.describe()


def test_the_gpu_room_holds_the_fullest_moment_of_a_backward_that_makes_gradients():
    # Layers 0..3 keep 5, 1, 1, 1 bytes; each layer's backward makes 2 bytes of gradients, top layer first.
    room = GpuRoom(bytes=100, layer_gradient=2)
    # backward of layer 3: 8 kept + 2; of 2: 7 + 4; of 1: 6 + 6; of 0: 5 + 8; after it: the 8 of gradients
    assert room.fullest([5, 1, 1, 1]) == (13, 0)
    assert room.fullest([0, 0, 0, 0]) == (8, -1)
    assert room.fullest([1, 1, 1, 9]) == (14, 3)
    assert GpuRoom(bytes=100).fullest([5, 1, 1, 1]) == (8, None)     # no gradients made: all at once
    # A full top layer above these four makes its 2 bytes first: every moment holds them too.
    above = GpuRoom(bytes=100, layer_gradient=2, layers_above=1)
    assert above.fullest([5, 1, 1, 1]) == (15, 0) and above.fullest([1, 1, 1, 9]) == (16, 3)
    assert above.fullest([0, 0, 0, 0]) == (10, -1)
    # A slot held only while layer 2 back-propagates counts where the layers above have freed less than it.
    assert GpuRoom(bytes=100).fullest([5, 1, 1, 1], [0, 0, 2, 0]) == (9, 2)
    assert GpuRoom(bytes=100).fullest([5, 1, 1, 3], [0, 0, 2, 0]) == (10, None)
    # The input embedding's 3 bytes, made after layer 0's backward, count only at the end.
    embedding = GpuRoom(bytes=100, layer_gradient=2, made_last=3)
    assert embedding.fullest([5, 1, 1, 1]) == (13, 0) and embedding.fullest([0, 0, 0, 0]) == (11, -1)


def test_the_top_layer_is_full_where_a_layer_backward_outweighs_the_loss_by_its_activations():
    """The top layer's activations live beside the loss and in its own backward (the first): they cost nothing
    where they fit in what a checkpointed layer's backward needs beyond the loss, and not a byte more."""
    for seq_len in (32768, 131072, 524288):
        chosen = plan(seq_len)
        shape, tiles, kernel = chosen.shape, chosen.mlp_tiles, chosen.attention_kernel
        backward = sum(transient_bytes(shape, LORA, tiles, True, attention_kernel=kernel).values())
        room = backward - loss_bytes(shape)
        assert chosen.placements[-1] == P.FULL and full_layer_bytes(shape, LORA, tiles > 1) <= room
        assert top_layer_full_costs_nothing(shape, room, tiles, kernel)
        assert not top_layer_full_costs_nothing(shape, room + 1, tiles, kernel)
        # counted for the GPU's attention, in one process
        assert not top_layer_full_costs_nothing(shape, room, tiles, kernel, device_type="cpu")
        assert not top_layer_full_costs_nothing(shape, room, tiles, kernel, one_process=False)
    short = plan(8192, MemoryConfig(full_layers=0))     # at 8k the loss is the larger transient
    assert not top_layer_full_costs_nothing(short.shape, 0, short.mlp_tiles, short.attention_kernel)
    assert P.FULL not in short.placements and P.FULL not in plan(524288, MemoryConfig(full_layers=0)).placements


def test_an_explicit_full_layer_count_takes_the_top_layer_first_and_says_how_many_fit():
    only_top = plan(131072, MemoryConfig(full_layers=1))
    assert only_top.placements[-1] == P.FULL and only_top.count(P.FULL) == 1 and only_top.top_layer_free
    assert "the top layer's activations, full, fit in the transient" in only_top.describe()
    with pytest.raises(ConfigError, match=r"memory.full_layers=20: 2 layers can be full here"):
        plan(524288, MemoryConfig(full_layers=20), capacity=H100_MACHINE)   # the top one and one below


def test_the_top_layer_is_full_at_no_cost_only_in_one_process():
    """Sequence parallelism and FSDP2 keep buffers of their own around a layer that no measurement covered with
    a full top layer: their plans count it like any other."""
    ranks = Ranks(sequence=2, per_host=2, world=2)
    parallel = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 262144, 1, CUDA, H100_HOST, ranks=ranks)
    assert not parallel.top_layer_free and parallel.placements[-1] != P.FULL
    assert plan(262144).top_layer_free


def test_full_fine_tuning_counts_the_gradients_as_the_backward_makes_them():
    """bf16 state layout, one micro-batch: a layer's gradients exist only from its backward on, when the
    activations kept for the layers above are freed, and the input embedding's only after the last layer's,
    so at 32k the H100 (flash attention's plan) keeps every input and most attention outputs on the GPU
    (layer 0's input looked up again from the embedding), four full layers and the top one, full at no cost
    (counting all gradients beside all kept activations left room for 23 inputs and no kept attention on the
    GPU). The plan's GPU items are those of its fullest moment."""
    full = SimpleNamespace(mode="full", full_state="auto")
    chosen = plan(32768, train=full)
    assert chosen.fits and chosen.full_state == "bf16"
    assert chosen.placements == [P.EMBEDDING] + [P.FULL] * 4 + [P.GPU] * 26 + [P.FULL]
    assert chosen.attention == [A.GPU] + [A.NONE] * 4 + [A.GPU] * 26 + [A.NONE]
    # The fullest moment, recounted here from the layout: the backward of layer k holds what layers 0..k keep
    # and the gradients of layers k..31 (the top layer's activations are its own backward's, counted there);
    # after layer 0's, every layer's gradients and the input embedding's.
    a, b = chosen.shape.activation, chosen.shape.attention_bytes
    kept = [b] + [full_layer_bytes(chosen.shape, full, mlp_tiled=True)] * 4 + [a + b] * 26 + [0]
    gradient, embedding_gradient = 2 * layer_parameters(LLAMA3_8B), 2 * LLAMA3_8B.vocab_size * LLAMA3_8B.hidden_size
    moments = [sum(kept[:k + 1]) + (32 - k) * gradient for k in range(32)] + [32 * gradient + embedding_gradient]
    others = {name: size for name, size in chosen.gpu.items() if name not in (
        "layer inputs on GPU", "attention outputs on GPU", "full layers' activations", FULLEST_MOMENT)}
    assert chosen.gpu_peak == sum(others.values()) + max(moments)
    assert others["bf16 non-layer gradients"] == 2 * (parameter_counts(LLAMA3_8B, full)[0] - 32 * layer_parameters(
        LLAMA3_8B)) - embedding_gradient
    assert "its fullest moment" in chosen.describe()
    # A short row keeps little: its fullest moment is the end, every gradient made, the embedding's last.
    short = plan(2048, train=full)
    assert short.gpu[FULLEST_MOMENT] == 32 * gradient and short.gpu[MADE_LAST] == embedding_gradient
    assert "the backward's end" in short.describe()
    # Without checkpointing (plain autograd) every gradient counts whole, the embedding's among them.
    plain = plan(2048, MemoryConfig(checkpoint=False), train=full)
    assert plain.gpu["bf16 gradients"] == 2 * parameter_counts(LLAMA3_8B, full)[0] and MADE_LAST not in plain.gpu

    # Several micro-batches keep the first one's gradients through the next: all of them count at once.
    accumulated = plan_memory(LLAMA3_8B, full, MemoryConfig(), 32768, 1, CUDA, H100_HOST, micro_batches=2)
    assert accumulated.gpu["bf16 gradients"] == 2 * parameter_counts(LLAMA3_8B, full)[0]
    assert FULLEST_MOMENT not in accumulated.gpu and accumulated.count(P.GPU) < 30
    assert accumulated.gpu_peak == sum(accumulated.gpu.values()) <= accumulated.capacity.gpu_limit


@pytest.mark.parametrize("seq_len, bottom", [(32768, 31), (65536, 7)])
def test_gpu_room_turns_the_bottom_layers_into_full_ones(seq_len, bottom):
    """At 32k-64k the GPU has room: the top layer keeps every activation at no cost (beside the loss, and in
    its own backward, which comes first), then as many layers as fit, GPU-kept inputs first, from layer 0 up
    (no recompute, no kept attention output); one more would not fit. At 32k that is every layer; at 64k layer
    0, whose input is looked up again from the embedding, stays checkpointed (it has no GPU input to free)."""
    chosen = plan(seq_len)
    assert chosen.fits and chosen.count(P.FULL) == bottom + 1 and chosen.pinned == 0
    if bottom == 31:
        assert chosen.placements == [P.FULL] * 32 and chosen.attention == [A.NONE] * 32
    else:
        assert chosen.placements == [P.EMBEDDING] + [P.FULL] * bottom + [P.GPU] * (30 - bottom) + [P.FULL]
        assert chosen.attention == [A.GPU] + [A.NONE] * bottom + [A.GPU] * (30 - bottom) + [A.NONE]
    assert chosen.gpu["full layers' activations"] == bottom * full_layer_bytes(chosen.shape, LORA, mlp_tiled=True)
    assert f"full layers={bottom + 1}" in chosen.describe()
    if bottom < 31:
        assert not plan(seq_len, MemoryConfig(full_layers=bottom + 2)).fits
    LayerInputStore(chosen.placements, CopyEngine(torch.device("cpu")), chosen.attention)    # a valid layout


@pytest.mark.parametrize("seq_len, train", [(131072, LORA), (262144, LORA), (524288, LORA),
                                            (65536, SimpleNamespace(mode="full", full_state="auto")),
                                            (131072, SimpleNamespace(mode="full", full_state="auto"))])
def test_only_the_top_layer_is_full_where_the_gpu_has_no_room(seq_len, train):
    """The top layer's activations cost nothing: it is full where no other layer fits, and the plan holds
    no more than one without full layers, recomputing less."""
    chosen, top = plan(seq_len, train=train), plan(seq_len, MemoryConfig(full_layers=1), train=train)
    without = plan(seq_len, MemoryConfig(full_layers=0), train=train)
    assert chosen.count(P.FULL) == 1 and chosen.placements[-1] == P.FULL and P.FULL not in without.placements
    assert (chosen.placements, chosen.attention, chosen.gpu, chosen.host) == \
        (top.placements, top.attention, top.gpu, top.host)
    assert chosen.fits and chosen.pinned <= without.pinned
    assert chosen.gpu_peak - without.gpu_peak <= without.shape.attention_bytes     # room a kept output freed
    assert backward_attention_forwards(chosen.shape, chosen.placements, chosen.attention) <= \
        backward_attention_forwards(without.shape, without.placements, without.attention)


@pytest.mark.parametrize("seq_len, held", [(8192, 32), (32768, 31)])
def test_without_checkpointing_every_layer_is_a_full_one(seq_len, held):
    """Plain autograd keeps every layer's activations, plus the step's transient; where a checkpointed layer's
    backward is the larger transient (32k, not 8k), the top layer's are held only beside the loss and in its
    own backward (the first), which has room for them. At 8k and 32k it is the planner's own plan, every layer
    full; at 64k it does not fit."""
    plain, checkpointed = plan(seq_len, MemoryConfig(checkpoint=False)), plan(seq_len)
    assert plain.placements is None and plain.fits and plain.gpu_peak == checkpointed.gpu_peak
    assert checkpointed.placements == [P.FULL] * 32
    full = full_layer_bytes(plain.shape, LORA, mlp_tiled=plain.mlp_tiles > 1)
    assert plain.gpu.pop("all layers' activations") == held * full
    assert not plan(65536, MemoryConfig(checkpoint=False)).fits
    # the rest as checkpointed: weights, trainable state, rope tables and the same transient
    assert plain.gpu == {name: checkpointed.gpu[name] for name in plain.gpu}


def test_an_explicit_full_layer_count_is_obeyed_gpu_inputs_first_then_host_ones():
    three = plan(65536, MemoryConfig(full_layers=3))      # the top one first: it costs nothing
    assert three.fits and three.placements == [P.EMBEDDING] + [P.FULL] * 2 + [P.GPU] * 28 + [P.FULL]
    mixed = plan(32768, MemoryConfig(gpu_layers=2, full_layers=5))
    assert mixed.placements[:4] == [P.FULL] * 4 and mixed.placements[-1] == P.FULL
    assert mixed.count(P.GPU) == 0 and mixed.count(P.HOST) == 27
    forced = plan(65536, MemoryConfig(full_layers=32))
    assert not forced.fits and "memory.full_layers=null" in forced.failure()


def test_no_full_layer_below_a_recomputed_input():
    """A recomputed input is rebuilt from the layer below's kept input, which a full layer does not keep."""
    with pytest.raises(ConfigError, match=r"memory.full_layers=32: \d+ layers can be full here") as error:
        plan(524288, MemoryConfig(full_layers=32))          # more than can be: an error, not silently fewer
    most = int(re.search(r"(\d+) layers can be full", str(error.value)).group(1))
    assert 0 < most < 32
    chosen = plan(524288, MemoryConfig(full_layers=most))
    placements = chosen.placements
    assert chosen.count(P.FULL) > 0 and not chosen.fits
    assert all(placements[i - 1] in (P.GPU, P.HOST) for i, p in enumerate(placements) if p == P.RECOMPUTE)


@pytest.mark.parametrize("seq_len", [262144, 524288])
def test_long_sequences_offload_and_fit_the_h100(seq_len):
    long = plan(seq_len)
    assert long.fits and long.count(P.HOST) > 0
    assert long.placements[:long.count(P.GPU) + 1] == [P.EMBEDDING] + [P.GPU] * long.count(P.GPU)
    assert long.mlp_tiles == seq_len // 16384


def test_524k_recomputes_what_the_host_cannot_hold():
    long = plan(524288, capacity=H100_MACHINE)
    placements = long.placements
    assert placements.count(P.RECOMPUTE) > 0
    assert all(placements[i - 1] != P.RECOMPUTE for i, p in enumerate(placements) if p == P.RECOMPUTE)
    assert placements[0] != P.RECOMPUTE
    # The layers below rebuild the recomputed inputs and keep that forward's attention (its output in their
    # own input's host buffer, its lse on the GPU): no more host room, one lse on the GPU.
    assert all(rebuilds_attention(placements, long.attention, i - 1) for i, p in enumerate(placements)
               if p == P.RECOMPUTE)
    assert set(long.host) == {"process baseline", "pinned layer inputs", "pinned attention outputs"}
    assert long.gpu["rebuilt attention lse"] == 524288 * 32 * 4
    assert "rebuilt attention lse" not in plan(131072, capacity=H100_MACHINE).gpu


def test_131k_keeps_every_attention_output_top_layers_on_the_gpu():
    long = plan(131072)
    assert long.fits and long.placements == [P.EMBEDDING] + [P.GPU] * 30 + [P.FULL]
    gpu_kept, host_kept = long.kept_attention(A.GPU), long.kept_attention(A.HOST)
    assert gpu_kept > 0 and host_kept > 0 and gpu_kept + host_kept == 31
    assert long.attention == [A.HOST] * host_kept + [A.GPU] * gpu_kept + [A.NONE]    # the backward's first on the GPU
    output, lse = 131072 * 4096 * 2, 131072 * 32 * 4
    assert long.gpu["attention outputs on GPU"] == gpu_kept * (output + lse)
    assert long.host["pinned attention outputs"] == host_kept * (output + lse)
    # The first copy back starts in the backward of the lowest layer keeping its output on the GPU, when the
    # layers above have freed more than it takes: the fullest moment is the forward's end, without it.
    assert PREFETCH_SLOT not in long.gpu


def test_a_copy_back_slot_counts_where_the_layers_above_have_freed_less():
    """At 262k the kept attention outputs are all on the host: the top one's is copied back in its own
    backward (the full top layer above it copies nothing ahead), the next one's during that backward, when
    nothing has been freed yet, so the slot counts there."""
    long = plan(262144, capacity=H100_MACHINE)
    assert long.attention[-3:] == [A.HOST, A.HOST, A.NONE] and long.kept_attention(A.GPU) == 0
    assert long.gpu[PREFETCH_SLOT] == long.shape.attention_bytes
    assert "the slot the next kept attention output is copied back into" in long.describe()


def test_a_gpu_slot_is_freed_for_prefetching_attention_outputs_when_inputs_fill_the_gpu():
    """Full fine-tuning at 131k: the inputs alone would fill the GPU room; one more goes to the host so
    that every attention output can be kept there."""
    full = SimpleNamespace(mode="full", full_state="auto")
    without = plan(131072, MemoryConfig(kept_attention_layers=0), train=full)
    kept = plan(131072, train=full)
    assert kept.fits and kept.kept_attention(A.HOST) == 31       # every checkpointed layer's (the top is full)
    assert kept.count(P.GPU) < without.count(P.GPU) and kept.count(P.RECOMPUTE) == without.count(P.RECOMPUTE) == 0


def test_524k_recomputes_more_inputs_to_keep_their_attention_outputs_where_they_would_go():
    """Past the host's room, more inputs are recomputed, each keeping its attention output in the host room its
    input would take, and in the GPU room the inputs it moved to the host left: with the layers below
    keeping their rebuilding run's, fewer attention forwards run in the backward, within the GPU room and no
    more pinned memory than the pinnable share."""
    without = plan(524288, MemoryConfig(kept_attention_layers=0), capacity=H100_MACHINE)
    long = plan(524288, capacity=H100_MACHINE)
    assert long.fits and PREFETCH_SLOT not in long.gpu
    assert long.count(P.RECOMPUTE) > without.count(P.RECOMPUTE) > 0
    kept = [i for i, output in enumerate(long.attention) if output != A.NONE]
    assert kept and all(long.placements[i] == P.RECOMPUTE for i in kept)
    # the GPU room of the inputs it moved to the host keeps outputs instead
    assert long.count(P.GPU) == 0 < without.count(P.GPU) and long.kept_attention(A.GPU) > 0
    assert long.kept_attention(A.HOST) > 0
    forwards = lambda p: backward_attention_forwards(p.shape, p.placements, p.attention)
    assert forwards(long) == forwards(without) - len(kept) and forwards(without) == 31     # one per checkpointed layer
    assert recompute_flops(long.shape, long.placements, long.attention) < recompute_flops(
        without.shape, without.placements, without.attention)


def test_an_explicit_gpu_layer_count_holds_past_the_hosts_room():
    """memory.gpu_layers=3 keeps layers 1 and 2's inputs on the GPU (layer 0's is looked up again) even where
    moving them to the host would keep more attention outputs."""
    chosen = plan(524288, MemoryConfig(gpu_layers=3), capacity=H100_MACHINE)
    assert chosen.fits and chosen.placements[:3] == [P.EMBEDDING, P.GPU, P.GPU] and chosen.count(P.GPU) == 2
    assert plan(524288, capacity=H100_MACHINE).count(P.GPU) == 0           # what the planner chooses alone


def test_short_rows_recompute_no_input_for_an_attention_output():
    """Below about 50k tokens an attention forward costs less than the rest of a layer that a rebuild runs:
    a small host makes inputs recomputed, never more of them to keep attention outputs."""
    small = Capacity(gpu=24 * GIB, host=8 * GIB, pinnable=2 * GIB)
    short = plan(16384, MemoryConfig(full_layers=0), capacity=small)
    fewest = plan(16384, MemoryConfig(full_layers=0, kept_attention_layers=0), capacity=small)
    assert short.fits and short.count(P.RECOMPUTE) == fewest.count(P.RECOMPUTE) > 0
    assert short.attention == [A.NONE] * 32


def test_kept_attention_layers_is_obeyed():
    assert plan(65536, MemoryConfig(kept_attention_layers=0)).attention == [A.NONE] * 32
    five = plan(65536, MemoryConfig(kept_attention_layers=5, full_layers=0))
    assert five.attention == [A.NONE] * 27 + [A.GPU] * 5
    forced = plan(524288, MemoryConfig(kept_attention_layers=32))
    assert not forced.fits and "memory.kept_attention_layers=null" in forced.failure()


@pytest.mark.parametrize("count", [20, 32])
def test_an_explicit_kept_attention_count_gets_the_gpu_prefetch_slot_too(count):
    """Full fine-tuning at 131k keeps the attention outputs of all 31 checkpointed layers on the host when the
    planner chooses (the top layer is full); asking for them (or fewer) must move the input that frees the
    prefetch slot just the same, not fail."""
    kept = plan(131072, MemoryConfig(kept_attention_layers=count), train=SimpleNamespace(mode="full",
                                                                                          full_state="auto"))
    assert kept.fits and kept.kept_attention(A.HOST) == min(count, 31)


@pytest.mark.parametrize("device, capacity, seq_len", [
    (CUDA, H100_HOST, 131072),
    (torch.device("cpu"), Capacity(gpu=96 * GIB, host=96 * GIB, pinnable=72 * GIB, device_type="cpu"), 65536),
], ids=["no-offload", "cpu"])
def test_explicit_kept_attention_beyond_the_device_room_fails_without_offload(device, capacity, seq_len):
    """With nowhere to offload to, an explicit count the device cannot hold fails with advice, as
    gpu_layers does; it is never silently lowered."""
    chosen = plan_memory(LLAMA3_8B, LORA, MemoryConfig(offload=False), seq_len, 1, device, capacity)
    assert chosen.fits and 0 < chosen.kept_attention(A.GPU) < 32
    forced = plan_memory(LLAMA3_8B, LORA, MemoryConfig(kept_attention_layers=32, offload=False), seq_len, 1,
                         device, capacity)
    assert not forced.fits and "memory.kept_attention_layers=null" in forced.failure()


def test_forced_settings_that_do_not_fit_come_with_numbers_and_advice():
    failing = plan(524288, MemoryConfig(offload=False))
    assert not failing.fits
    message = failing.failure()
    assert "GPU peak" in message and "of 72" in message and "memory.offload=true" in message
    assert "seq_len=" in message


def test_a_plan_prints_its_placements_as_their_strings():
    """Placements are members of offload.store's Placement and AttentionPlacement, which print as their strings:
    the 524k plan's description and placement lists read as when they were plain strings."""
    long = plan(524288, capacity=H100_MACHINE)
    assert long.describe().splitlines()[0] == (
        "memory plan: checkpointing on, layer inputs gpu=0 host=15 recomputed=15, full layers=1, attention outputs "
        "kept gpu=2 host=8, mlp_tiles=32, attention kernel flash, layer 0's input looked up again from the embedding")
    assert repr(long.placements) == repr(["embedding"] + ["host", "recompute"] * 15 + ["full"])
    assert str(long.attention) == str(["none"] * 12 + ["gpu", "none"] * 2 + ["host", "none"] * 8)


def test_small_host_is_reported():
    tiny_host = Capacity(gpu=int(79.2 * GIB), host=32 * GIB, pinnable=24 * GIB)
    failing = plan(524288, capacity=tiny_host)
    assert not failing.fits and "a host with at least" in failing.failure()


def test_plan_script_exits_nonzero_before_building_anything():
    command = [sys.executable, str(ROOT / "scripts/plan.py"), "model=llama3_8b", "train=lora", "seq_len=524288",
               "memory.offload=false", "memory.gpu_memory_gib=79.2", "memory.host_memory_gib=125",
               "hydra.run.dir=/tmp/plan-test", "hydra.output_subdir=null", "device=cuda"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "does not fit" in result.stdout and "memory.offload=true" in result.stdout


def run_plan_script(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/plan.py"), *overrides], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_plan_script_without_a_gpu_plans_for_a_default_preset_as_the_readme_says():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: its capacity is read")
    result = run_plan_script("model=llama3_8b", "seq_len=524288")
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU is visible: planning for memory.gpu=h100_80gb (79.2 GiB)" in result.stdout
    assert "host of 125 GiB" in result.stdout and "GPU peak" in result.stdout
    assert "layer inputs:      e" + " h r" * 15 + " f (g=gpu h=host r=recomputed f=full" in result.stdout


@pytest.mark.parametrize("overrides, usable", [
    (["memory.gpu=h200"], "GPU peak  126.41 GiB of 129.41 GiB usable"),      # 8 full layers, cuDNN attention
    (["memory.gpu=a100_80gb", "memory.host_memory_gib=250"], "host peak   20.80 GiB of 250.00 GiB usable"),
])
def test_plan_script_plans_for_a_named_gpu(overrides, usable):
    result = run_plan_script("model=llama3_8b", "seq_len=131072", "device=cuda", *overrides)
    assert result.returncode == 0 and usable in result.stdout, result.stdout + result.stderr
    assert f"attention kernel {'cudnn' if 'memory.gpu=h200' in overrides else 'flash'}" in result.stdout


def test_cudnn_attention_is_planned_with_its_backward_workspace():
    """cuDNN's attention comes first where offered; its backward workspace (two fp32 copies of dQ) is in
    the transient, so the plan keeps less on the GPU than the flash plan of the same job."""
    from kernels.attention import cudnn_attention
    cudnn = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 131072, 1, CUDA, H100_HOST, attention_routes=HOPPER_ROUTES)
    flash = plan(131072)
    assert cudnn.fits and cudnn.attention_kernel == "cudnn" and flash.attention_kernel == "flash"
    workspace = cudnn_attention.backward_workspace_bytes(131072, 32, 8, 128)
    assert workspace == 4 * GIB
    assert cudnn.gpu["attention stats+workspace"] == flash.gpu["attention statistics"] + workspace
    assert cudnn.kept_attention(A.GPU) < flash.kept_attention(A.GPU)
    assert "attention kernel cudnn" in cudnn.describe()


def test_cudnn_runs_524k_over_head_groups_and_the_planner_falls_back_to_flash_where_it_does_not_fit():
    """At 524k tokens one cuDNN backward call would take a 16 GiB workspace; over 4 groups of 2 KV heads
    it takes 4 GiB plus a group's gradients, and the H100 plan keeps cuDNN. On a GPU 8 GiB smaller only the
    flash plan fits, and the planner takes it."""
    from kernels.attention import cudnn_attention
    assert cudnn_attention.backward_head_groups(524288, 32, 8, 128) == 4
    chosen = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 524288, 1, CUDA, H100_HOST, attention_routes=HOPPER_ROUTES)
    group_grads = 524288 * (32 + 2 * 8) // 4 * 128 * 2
    assert chosen.fits and chosen.attention_kernel == "cudnn"
    assert chosen.gpu["attention stats+workspace"] == 2 * 524288 * 32 * 4 + 4 * GIB + group_grads
    smaller = Capacity(gpu=H100_HOST.gpu - 8 * GIB, host=H100_HOST.host, pinnable=H100_HOST.pinnable)
    chosen = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 524288, 1, CUDA, smaller, attention_routes=HOPPER_ROUTES)
    assert chosen.fits and chosen.attention_kernel == "flash" and chosen.attention_route == HOPPER_ROUTES[1]
    assert not plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 524288, 1, CUDA, smaller,
                           attention_routes=HOPPER_ROUTES[:1]).fits


@pytest.mark.parametrize("overrides, message", [
    (["memory.gpu=h100"], "memory.gpu='h100' is not one of"),
    (["memory.gpu=h200", "memory.gpu_memory_gib=100"], "memory.gpu=h200 and memory.gpu_memory_gib=100.0: give one"),
    (["+memory.host_gib=80"], "unknown setting memory.host_gib: the nearest is memory.host_memory_gib"),
])
def test_plan_script_names_a_bad_setting(overrides, message):
    result = run_plan_script("model=llama3_8b", *overrides)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_without_a_gpu_the_trainer_says_so_once_and_suggests_only_what_helps(caplog):
    """On a CPU-only machine the 8B plan is for the host acting as the device: say that no GPU is visible,
    print the plan once (in the error, not also in the log), point to scripts/plan.py with a GPU preset,
    and do not suggest memory.check=false, which would only run out of memory."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs
    from conf.validate import ConfigError, validate
    from trainer.build import checked_plan

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=llama3_8b", "seq_len=65536", "memory.host_memory_gib=16"])
    validate(cfg)
    with caplog.at_level("INFO"), pytest.raises(ConfigError) as error:
        checked_plan(cfg, torch.device("cpu"))
    message = str(error.value)
    assert message.startswith("no CUDA GPU is visible")
    assert "python scripts/plan.py model=llama3_8b train=lora seq_len=65536 memory.gpu=h100_80gb" in message
    assert "it does not fit: the weights alone (29.92 GiB) exceed what this host can give" in message
    assert "memory.check=false" not in message and "settings that would help" not in message
    assert (message + caplog.text).count("memory plan:") == 1


def test_trainer_fails_before_building_the_model_or_writing_the_run_dir(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs
    from conf.validate import ConfigError
    from model import CausalLM
    from trainer.loop import train

    def must_not_build(*args, **kwargs):
        raise AssertionError("the model was built before the memory check")

    monkeypatch.setattr(CausalLM, "from_config", must_not_build)
    register_configs()
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["seq_len=4096", "memory.gpu_memory_gib=0.01", f"output_dir={run_dir}"])
    with pytest.raises(ConfigError, match="does not fit"):
        train(cfg)
    assert not run_dir.exists()


def test_with_every_input_offloaded_every_other_layer_can_be_recomputed():
    """Every other checkpointed layer from the top can be rebuilt from the host copy of the one below: 15 of
    the 31 below the full top layer, as with inputs on the GPU."""
    placements = plan(524288, MemoryConfig(gpu_layers=0, recomputed_inputs=32)).placements
    assert placements.count(P.RECOMPUTE) == 15 and placements.count(P.GPU) == 0 and placements[-1] == P.FULL
    LayerInputStore(placements, CopyEngine(torch.device("cpu")))       # a valid layout


@pytest.mark.parametrize("setting, value", [("gpu_layers", -1), ("recomputed_inputs", -1), ("mlp_tile_tokens", 0),
                                            ("mlp_tiles", 0), ("pinnable_fraction", 1.5),
                                            ("host_memory_gib", 0), ("full_layers", -1)])
def test_unplannable_memory_settings_name_the_setting(setting, value):
    with pytest.raises(ValueError, match=f"memory.{setting}={value}"):
        check_memory(MemoryConfig(**{setting: value}))


def test_tile_advice_unsets_an_explicit_tile_count():
    failing = plan(524288, MemoryConfig(offload=False, mlp_tiles=2))
    assert "memory.mlp_tiles=null memory.mlp_tile_tokens=4096" in failing.failure()


@pytest.mark.parametrize("setting", ["memory.gpu_layers=-1", "memory.kept_attention_layers=-2",
                                     "memory.full_layers=-1"])
def test_trainer_names_an_unplannable_memory_setting(setting):
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs
    from conf.validate import ConfigError, validate

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["seq_len=4096", setting])
    with pytest.raises(ConfigError, match=f"{setting} must be at least 0"):
        validate(cfg)


def test_no_attention_output_or_full_layer_where_the_reference_attention_runs():
    """Only the Triton attention records its outputs: on CPU (or kernels=reference) the planner keeps none,
    so nothing is reserved or pinned for them, and asking for some is a clear error."""
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs
    from conf.validate import ConfigError
    from trainer.build import plan_for

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        on_cpu = compose("config", overrides=["model=llama3_8b", "seq_len=4096"])
        reference = compose("config", overrides=["model=llama3_8b", "seq_len=131072", "kernels=reference",
                                                 "memory.gpu_memory_gib=79.2", "memory.host_memory_gib=125"])
        forced = compose("config", overrides=["seq_len=256", "memory.kept_attention_layers=2"])
        forced_full = compose("config", overrides=["seq_len=256", "memory.full_layers=2"])
    assert plan_for(on_cpu, torch.device("cpu")).attention == [A.NONE] * 32
    assert plan_for(reference, CUDA).attention == [A.NONE] * 32
    # nor full layers: the byte model counts the Triton attention's saved tensors
    assert plan_for(on_cpu, torch.device("cpu")).count(P.FULL) == plan_for(reference, CUDA).count(P.FULL) == 0
    with pytest.raises(ConfigError, match="memory.kept_attention_layers=2 needs the Triton attention"):
        plan_for(forced, torch.device("cpu"))
    with pytest.raises(ConfigError, match="memory.full_layers=2 needs the Triton attention"):
        plan_for(forced_full, torch.device("cpu"))


def test_a_sequence_parallel_rank_plans_its_slice_its_exchange_and_its_share_of_the_host():
    from offload.byte_model import sequence_exchange_bytes
    from offload.plan import Ranks
    whole = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 131072, 1, CUDA, H100_HOST)
    rank = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 262144, 1, CUDA,
                       H100_HOST.shared_by(2), ranks=Ranks(sequence=2, per_host=2, world=2))
    assert rank.shape.tokens == whole.shape.tokens == 131072
    assert rank.capacity.host == H100_HOST.host // 2 and rank.capacity.gpu == H100_HOST.gpu
    assert rank.gpu["sequence-parallel exchange"] == sequence_exchange_bytes(rank.shape, 2) > 0
    # A full layer keeps the attention output twice: in the exchanged layout and as o_proj's input.
    assert (full_layer_bytes(rank.shape, LORA, True, sequence_parallel=2)
            - full_layer_bytes(rank.shape, LORA, True)) == 131072 * 4096 * 2


def test_padded_query_heads_are_planned_in_the_exchange_and_the_saved_attention():
    """Qwen2.5-7B over 8 ranks: the 28 query heads run as 32 (conf.schema.parallel.padded_query_heads); the
    exchange holds q and the output 32 heads wide, k and v repeated to 8; a full layer's attention keeps q and
    its output 32 heads wide with fp32 statistics for each."""
    from offload.byte_model import Shape, sequence_exchange_bytes
    qwen2_5 = DecoderConfig(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
    shape = Shape(qwen2_5, 4096, 2)
    assert sequence_exchange_bytes(shape, 8) == 4096 * (32 + 2 * 8 + 32) * 128 * 2
    assert sequence_exchange_bytes(shape, 4) == 4096 * (28 + 2 * 4 + 28) * 128 * 2      # 4 divides 28
    grown = full_layer_bytes(shape, LORA, True, sequence_parallel=8) - full_layer_bytes(shape, LORA, True)
    repeated_kv, padded_q, o_proj_input = 2 * (8 - 4) * 128 * 2, 2 * (32 - 28) * 128 * 2 + 4 * 4, 28 * 128 * 2
    assert grown == 4096 * (repeated_kv + padded_q + o_proj_input)


def test_full_fine_tuning_over_several_processes_plans_fp32_state_only():
    from offload.plan import Ranks
    full = SimpleNamespace(mode="full", full_state="auto")
    one = plan_memory(LLAMA3_8B, full, MemoryConfig(), 32768, 1, CUDA, H100_HOST)
    two = plan_memory(LLAMA3_8B, full, MemoryConfig(), 65536, 1, CUDA, H100_HOST, ranks=Ranks(2, 1, 2))
    assert one.fits and one.full_state != "fp32"
    assert two.full_state == "fp32" and not two.fits


def test_sharded_full_fine_tuning_holds_its_share_of_the_state_and_the_gathered_layers():
    from offload.plan import Ranks, gathered_bytes
    full = SimpleNamespace(mode="full", full_state="fp32")
    replicated = plan_memory(LLAMA3_8B, full, MemoryConfig(), 65536, 1, CUDA, H100_HOST, ranks=Ranks(2, 1, 2))
    sharded = plan_memory(LLAMA3_8B, full, MemoryConfig(), 65536, 1, CUDA, H100_HOST,
                          ranks=Ranks(2, 1, 2, shard=True))
    state = "fp32 weights+grads+adam"
    assert sharded.gpu[state] == 16 * -(-parameter_counts(LLAMA3_8B, full)[1] // 2) == replicated.gpu[state] // 2
    assert sharded.gpu["FSDP gathered weights+grads"] == gathered_bytes(LLAMA3_8B, 4)
    assert "FSDP gathered weights+grads" not in replicated.gpu


@pytest.mark.parametrize("layout", ["bf16", "bf16_host_grads"])
def test_sharded_bf16_states_are_planned_per_rank(layout):
    """parallel.shard=true: the bf16 layouts run over several processes, each rank holding its share (1/N, the
    ceiling) of the bf16 weights, moments and gradients, on the GPU or pinned on the host, where one process
    holds them whole; the gathered layers are bf16, weights and gradients."""
    from offload.plan import gathered_bytes
    from offload.state_layouts import layout_memory
    full = SimpleNamespace(mode="full", full_state=layout)
    trainable = parameter_counts(LLAMA3_8B, full)[1]
    one = plan_memory(LLAMA3_8B, full, MemoryConfig(), 32768, 1, CUDA, H100_HOST)
    two = plan_memory(LLAMA3_8B, full, MemoryConfig(), 65536, 1, CUDA, H100_HOST, ranks=Ranks(2, 1, 2, shard=True))
    assert one.full_state == two.full_state == layout and one.shape.tokens == two.shape.tokens
    gpu, host = layout_memory(layout, -(-trainable // 2))
    assert {name: two.gpu[name] for name in gpu} == gpu
    assert two.gpu["bf16 weights"] * 2 == one.gpu["bf16 weights"] and two.gpu["bf16 adam moments"] * 2 == (
        one.gpu["bf16 adam moments"])
    assert {name: two.host[name] for name in host} == {name: pinned_size(size) for name, size in host.items()}
    if layout == "bf16_host_grads":
        assert pinned_size(one.host["pinned gradients"] // 2) == two.host["pinned gradients"]
    assert two.gpu["FSDP gathered weights+grads"] == gathered_bytes(LLAMA3_8B, 2)


def test_sharded_full_fine_tuning_plans_bf16_states_where_fp32_does_not_fit():
    """train.full_state=auto over 2 ranks: unsharded, fp32 only (and 8B does not fit); sharded, the bf16 state
    layouts too, the first that fits."""
    full = SimpleNamespace(mode="full", full_state="auto")
    replicated = plan_memory(LLAMA3_8B, full, MemoryConfig(), 65536, 1, CUDA, H100_HOST, ranks=Ranks(2, 1, 2))
    sharded = plan_memory(LLAMA3_8B, full, MemoryConfig(), 65536, 1, CUDA, H100_HOST,
                          ranks=Ranks(2, 1, 2, shard=True))
    assert replicated.full_state == "fp32" and not replicated.fits
    assert sharded.fits and sharded.full_state in ("bf16", "bf16_host_grads")


def test_sharded_lora_holds_its_share_of_the_frozen_base_and_gathers_weights_only():
    from offload.plan import Ranks, gathered_bytes
    replicated = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 1048576, 1, CUDA, H100_HOST, ranks=Ranks(8, 1, 8))
    sharded = plan_memory(LLAMA3_8B, LORA, MemoryConfig(), 1048576, 1, CUDA, H100_HOST,
                          ranks=Ranks(8, 1, 8, shard=True))
    frozen = parameter_counts(LLAMA3_8B, LORA)[0] - parameter_counts(LLAMA3_8B, LORA)[1]
    assert replicated.gpu["weights"] == 2 * frozen and sharded.gpu["weights"] == 2 * -(-frozen // 8)
    assert sharded.gpu["FSDP gathered weights"] == gathered_bytes(LLAMA3_8B, 2, gradients=False)
    assert gathered_bytes(LLAMA3_8B, 2, gradients=False) * 2 == gathered_bytes(LLAMA3_8B, 2)
    # 13 GiB of base less, 1.5 GiB gathered more: room the planner fills with activations.
    assert sharded.gpu["weights"] + sharded.gpu["FSDP gathered weights"] < replicated.gpu["weights"] - 10 * GIB
