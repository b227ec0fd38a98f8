"""The memory policy changes where activations live, never the math: loss and gradients with per-layer
checkpointing, offloaded/recomputed layer inputs and tiled MLPs equal those of plain autograd."""
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
from model import CausalLM, DecoderConfig
from offload.byte_model import Shape
from offload.engine import ALIGNMENT, CopyEngine
from offload.placement import backward_attention_forwards
from offload.policy import apply_memory_policy
from offload.store import AttentionPlacement, LayerInputStore, Placement, attention_key, input_key
from trainer.build import apply_lora

from conftest_kernels import needs_interpreter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the allocator's peak")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0)
LORA = SimpleNamespace(lora_r=4, lora_alpha=8.0, lora_dropout=0.0,
                       lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])


@pytest.fixture(autouse=True)
def reference_kernels():
    kernels.set_backend("reference")
    yield
    kernels.set_backend("auto")


def lora_model(device="cpu", dtype=torch.float32, dropout=0.0, shape=TINY):
    torch.manual_seed(0)
    model = CausalLM.from_config(DecoderConfig(**shape), dtype=dtype, device=device)
    model = apply_lora(model, SimpleNamespace(**{**vars(LORA), "lora_dropout": dropout}))
    with torch.no_grad():     # LoRA B starts at zero: make every adapter matter to the loss
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def loss_and_grads(model, input_ids, labels, seed=1, autocast=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with autocast or torch.autocast("cpu", enabled=False):
        hidden = model(input_ids)
        loss = model.get_base_model().loss(hidden, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def triton_attention_model():
    """The LoRA model with head dim 64 (a size Triton's attention takes) running Triton's attention, the one that
    records, interpreted on CPU; its other ops stay on the reference (the interpreter's norms and RoPE would take
    most of the test's time and are checked on their own in test_rope_swiglu.py and test_norm_kernels.py)."""
    from kernels.attention import choose_route
    from trainer.build import install_attention_route
    model = lora_model(shape={**TINY, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})
    install_attention_route(model, choose_route(torch.device("cpu"), 64, "triton"))
    return model


def batch(seqlen=48, device="cpu"):
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY["vocab_size"], (2, seqlen + 1), generator=generator).to(device)
    return ids[:, :-1], ids[:, 1:]


def assert_same(reference, measured, rtol=1e-5):
    ref_loss, ref_grads = reference
    loss, grads = measured
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == 7 * 2 * TINY["num_hidden_layers"]
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=rtol * 1e-2, msg=name)


# The reference attention records nothing: keeping its outputs ("host" attention) must change nothing.
@pytest.mark.parametrize("placements, tiles, attention", [
    (["host"] * 4, 1, ["host"] * 4),
    (["gpu", "host", "recompute", "host"], 3, None),
    (["gpu", "recompute", "host", "recompute"], 5, None),
    (["full", "gpu", "recompute", "full"], 3, None),
    (["full", "host", "full", "host"], 1, ["none", "host", "none", "gpu"]),
    (["full"] * 4, 2, None),
    (["embedding", "recompute", "host", "full"], 2, None),
    (["embedding", "host", "recompute", "full"], 1, None),
], ids=["offload-all", "mixed-tiled", "recompute-tiled", "full-mixed-tiled", "full-offload", "full-all",
        "embedding-rebuilds-layer-1", "embedding-524k-shape"])
def test_policy_matches_plain_autograd(placements, tiles, attention):
    model = lora_model()
    input_ids, labels = batch()
    reference = loss_and_grads(model, input_ids, labels)
    policy = apply_memory_policy(model, placements, tiles, torch.device("cpu"), attention)
    assert_same(reference, loss_and_grads(model, input_ids, labels))
    assert not policy.store.stored, "every kept input is released by the end of the backward"
    policy.remove()
    assert_same(reference, loss_and_grads(model, input_ids, labels))


@pytest.mark.parametrize("placements", [["host", "recompute", "gpu", "host"], ["full", "host", "recompute", "full"]],
                         ids=["checkpointed", "with-full-layers"])
def test_dropout_replays_the_same_masks(placements):
    """Recomputation replays the forward's dropout masks, and full layers between checkpointed ones draw
    theirs in the forward's order. (Tiling itself draws masks per tile, so tiled runs are compared with the
    same tiling without layer checkpointing.)"""
    model = lora_model(dropout=0.3)
    input_ids, labels = batch()
    reference = loss_and_grads(model, input_ids, labels)
    policy = apply_memory_policy(model, placements, 1, torch.device("cpu"))
    assert_same(reference, loss_and_grads(model, input_ids, labels))
    policy.remove()
    policy = apply_memory_policy(model, None, 4, torch.device("cpu"))
    tiled_reference = loss_and_grads(model, input_ids, labels)
    policy.remove()
    apply_memory_policy(model, placements, 4, torch.device("cpu"))
    assert_same(tiled_reference, loss_and_grads(model, input_ids, labels))


@pytest.mark.parametrize("placements, tied", [(["host", "host", "recompute", "gpu"], False),
                                               (["full", "host", "recompute", "full"], False),
                                               (["embedding", "recompute", "host", "full"], False),
                                               (["embedding", "host", "recompute", "full"], True)],
                         ids=["checkpointed", "with-full-layers", "embedding-trained", "embedding-tied-to-the-head"])
def test_full_training_gradients_match(placements, tied):
    torch.manual_seed(0)
    model = CausalLM.from_config(DecoderConfig(**{**TINY, "tie_word_embeddings": tied}))
    input_ids, labels = batch()

    def grads():
        model.zero_grad(set_to_none=True)
        model.loss(model(input_ids), labels).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads()
    apply_memory_policy(model, placements, 2, torch.device("cpu"))
    for name, grad in grads().items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-8, msg=name)


def test_no_grad_forward_bypasses_checkpointing():
    model = lora_model()
    input_ids, _ = batch()
    with torch.no_grad():
        reference = model(input_ids)
        policy = apply_memory_policy(model, ["host"] * 4, 3, torch.device("cpu"))
        torch.testing.assert_close(model(input_ids), reference)
    assert not policy.store.stored and policy.engine.pool.nbytes == 0


def test_pinned_pool_is_allocated_once():
    model = lora_model()
    input_ids, labels = batch()
    policy = apply_memory_policy(model, ["host"] * 4, 1, torch.device("cpu"))
    loss_and_grads(model, input_ids, labels)
    buffers = {key: b.data_ptr() for key, b in policy.engine.pool.buffers.items()}
    loss_and_grads(model, input_ids, labels)
    assert {key: b.data_ptr() for key, b in policy.engine.pool.buffers.items()} == buffers
    assert len(buffers) == 4 and policy.engine.pool.nbytes == 4 * input_ids.numel() * TINY["hidden_size"] * 4
    stats = policy.stats()
    assert stats["offload/d2h_gib"] == stats["offload/h2d_gib"] > 0


def test_carved_views_share_one_aligned_buffer():
    """Many small tensors in one allocation (the pinned allocator rounds each up to a power of two), each
    view typed and shaped like its tensor, starting on an ALIGNMENT boundary, and copied to and back."""
    engine = CopyEngine(torch.device("cpu"))
    likes = [torch.arange(3, dtype=torch.bfloat16), torch.randn(2, 5), torch.tensor(7.0, dtype=torch.float64)]
    views = engine.pool.carve("gradients", likes)
    buffer = engine.pool.buffers["gradients"]
    assert len(engine.pool.buffers) == 1 and engine.pool.nbytes == 3 * ALIGNMENT
    for view, like in zip(views, likes):
        assert view.dtype == like.dtype and view.shape == like.shape
        assert (view.data_ptr() - buffer.data_ptr()) % ALIGNMENT == 0
        assert torch.equal(engine.to_device(engine.copy_to_host(view, like)).wait(), like)


def test_second_forward_before_backward_is_refused():
    """The store keeps one input per layer: a second forward with grad replaces the first's, so backward
    through the first graph (or a second backward of one graph) must fail, not return wrong gradients."""
    model = lora_model()
    input_ids, labels = batch()
    lm = model.get_base_model()
    apply_memory_policy(model, ["gpu", "host", "recompute", "host"], 1, torch.device("cpu"))
    first = lm.loss(model(input_ids), labels)
    second = lm.loss(model(input_ids.flip(0)), labels.flip(0))
    with pytest.raises(RuntimeError, match="kept input is gone"):
        (first + second).backward()
    loss = lm.loss(model(input_ids), labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="kept input is gone"):
        loss.backward()


def test_a_forward_without_backward_leaves_the_next_step_exact():
    model = lora_model()
    input_ids, labels = batch()
    reference = loss_and_grads(model, input_ids, labels)
    apply_memory_policy(model, ["gpu", "host", "recompute", "host"], 2, torch.device("cpu"))
    model.get_base_model().loss(model(input_ids.flip(0)), labels.flip(0))      # with grad, never backpropagated
    assert_same(reference, loss_and_grads(model, input_ids, labels))


def test_kept_inputs_are_freed_by_the_backward_not_with_the_graph():
    """Nothing but the store may hold a kept input: the autograd graph lives until the loss is freed."""
    import gc
    import weakref
    model = lora_model()
    input_ids, labels = batch()
    policy = apply_memory_policy(model, ["gpu", "host", "recompute", "host"], 1, torch.device("cpu"))
    fetched, to_device = [], policy.engine.to_device

    def recording(stored):
        pending = to_device(stored)
        fetched.append(weakref.ref(pending.tensor))
        return pending

    policy.engine.to_device = recording
    loss = model.get_base_model().loss(model(input_ids), labels)
    kept = [weakref.ref(policy.store.stored[0].payload)]
    loss.backward()
    gc.collect()
    assert len(fetched) == 2 and all(ref() is None for ref in kept + fetched), "the graph (alive) holds an input"
    del loss


def test_backward_fetches_its_own_input_before_prefetching_the_next():
    """The compute stream waits on the copy of the input it needs now, which must not queue behind the
    prefetch of the layer below (the first backward would wait for both)."""
    model = lora_model()
    input_ids, labels = batch()
    policy = apply_memory_policy(model, ["host"] * 4, 1, torch.device("cpu"))
    assert host_to_device_copy_layers(policy, model, input_ids, labels) == [3, 2, 1, 0]


def planned_backward_forwards(model, seqlen: int, policy) -> int:
    """The planner's count of the attention forwards a step's backward runs, for the policy's layout."""
    shape = Shape(model.get_base_model().config, 2 * seqlen, 4)
    return backward_attention_forwards(shape, policy.store.placements, policy.store.attention)


def host_to_device_copy_layers(policy, model, input_ids, labels) -> list[int]:
    """The layer of each host-to-device copy of one training step, in the order the copies were started."""
    copied, to_device = [], policy.engine.to_device

    def recording(stored):
        copied.append(stored.host.data_ptr())
        return to_device(stored)

    policy.engine.to_device = recording
    loss_and_grads(model, input_ids, labels)
    layer_of = {buffer.data_ptr(): key[1] for key, buffer in policy.engine.pool.buffers.items()}
    return [layer_of[pointer] for pointer in copied]


@pytest.mark.parametrize("placements", [["recompute", "host"], ["host", "recompute", "recompute"], ["disk"],
                                        ["gpu", "full", "recompute"], ["gpu", "embedding"]])
def test_invalid_placements_are_refused(placements):
    """A recomputed input is rebuilt from the layer below's kept input: a full layer keeps none in the store.
    Only layer 0's input is the token embedding's output."""
    with pytest.raises(ValueError):
        LayerInputStore(placements, CopyEngine(torch.device("cpu")))


def test_an_embedding_placed_input_must_be_the_embeddings_output():
    """Layer 0 placed "embedding" keeps only the token ids its backward looks up again: a tensor that is not
    the embedding's output of this forward, or that output changed in place, would be rebuilt wrongly, so
    it is refused."""
    model = lora_model()
    input_ids, labels = batch()
    policy = apply_memory_policy(model, ["embedding", "host", "host", "host"], 1, torch.device("cpu"))
    decoder = model.get_base_model().model
    layer_0 = decoder.layers[0]
    rope = decoder.rope(torch.arange(input_ids.shape[1]).expand_as(input_ids), torch.float32)
    policy.run_layer(layer_0, decoder.embed_tokens(input_ids), rope, None)       # the lookup just recorded: kept
    for changed in (lambda looked_up: looked_up + 0, lambda looked_up: looked_up.mul_(2)):
        hidden = changed(decoder.embed_tokens(input_ids))
        with pytest.raises(RuntimeError, match="not the output of the model's token embedding"):
            policy.run_layer(layer_0, hidden, rope, None)
    policy.remove()
    assert not decoder.embed_tokens._forward_hooks, "remove() takes the lookup hook off the embedding"


def test_an_embedding_with_a_lora_adapter_is_kept_not_looked_up_again():
    """A LoRA adapter on the embedding adds its product to the lookup: the planner keeps layer 0's input
    there, and the policy refuses to look it up again."""
    from conf.schema import MemoryConfig
    from offload.plan import plan_memory
    adapted = SimpleNamespace(**{**vars(LORA), "lora_target_modules": ["q_proj", "embed_tokens"]})
    torch.manual_seed(0)
    model = apply_lora(CausalLM.from_config(DecoderConfig(**TINY)), adapted)
    with pytest.raises(ValueError, match="needs a plain nn.Embedding"):
        apply_memory_policy(model, ["embedding", "host", "host", "host"], 1, torch.device("cpu"))
    for train in (adapted, LORA):
        planned = plan_memory(DecoderConfig(**TINY), SimpleNamespace(mode="lora", **vars(train)),
                              MemoryConfig(gpu_memory_gib=80, full_layers=0), 64, 1, torch.device("cuda"))
        assert (planned.placements[0] == Placement.EMBEDDING) == (train is LORA), planned.placements


@pytest.mark.parametrize("placements, attention", [(["host", "host"], ["host"]), (["host", "host"], ["host", "disk"]),
                                                   (["full", "host"], ["gpu", "none"])],
                         ids=["too-few", "unknown", "full-layer-keeps-attention"])
def test_invalid_attention_placements_are_refused(placements, attention):
    with pytest.raises(ValueError, match="attention placement"):
        LayerInputStore(placements, CopyEngine(torch.device("cpu")), attention)


def test_placements_given_as_strings_are_taken_as_members():
    """The store takes placement strings as Placement and AttentionPlacement members, which equal, hash, print and
    serialize as those strings (plans and messages read as before the enums)."""
    store = LayerInputStore(["gpu", "host", "recompute", "full"], CopyEngine(torch.device("cpu")),
                            ["host", "none", "none", "none"])
    assert store.placements == [Placement.GPU, Placement.HOST, Placement.RECOMPUTE, Placement.FULL]
    assert {type(p) for p in store.placements} == {Placement}
    assert {type(a) for a in store.attention} == {AttentionPlacement}
    assert f"{store.placements} {Placement.GPU} {Placement.HOST:>5}" == "['gpu', 'host', 'recompute', 'full'] gpu  host"
    assert str(AttentionPlacement.NONE) == "none" and json.dumps(store.attention) == '["host", "none", "none", "none"]'
    assert {"gpu", "full"} == {Placement.GPU, Placement.FULL}


def test_full_layers_under_recomputed_ones_are_valid_where_a_kept_input_separates_them():
    LayerInputStore(["full", "gpu", "recompute", "full", "host", "recompute"], CopyEngine(torch.device("cpu")))


@needs_interpreter
@pytest.mark.parametrize("placements, attention, launches, host_kept", [
    # 4 forwards + layer 2's recomputation (attention not kept) + layer 1 rebuilding layer 2's input
    (["gpu", "host", "recompute", "host"], ["host", "gpu", "none", "host"], 6, 3),
    # full layers run their attention once; layers 1 and 3 replay theirs
    (["full", "host", "full", "host"], ["none", "host", "none", "gpu"], 4, 1),
    # the 524k plan's shape: the top layer full, layer 2 recomputed keeping its own output, layer 1 keeping
    # its rebuilding run's: only that run and layer 0's recomputation run an attention forward
    (["gpu", "host", "recompute", "full"], ["none", "none", "host", "none"], 6, 2),
    # the same with layer 0's input looked up again from the embedding and layer 1 recomputed keeping its
    # output on the device: layer 0 rebuilds layer 1's input (no buffer to keep that run's output in) and
    # runs its attention again in its own backward: layer 2's recomputation, the rebuild, layer 0's
    (["embedding", "recompute", "host", "full"], ["none", "gpu", "none", "none"], 7, None),
], ids=["checkpointed", "with-full-layers", "full-top-above-a-recomputed-input", "embedding-below-a-recomputed-input"])
def test_kept_attention_outputs_replace_the_recomputed_attention_forward(monkeypatch, placements, attention,
                                                                         launches, host_kept):
    """With attention outputs kept (on the device or the host) the backward's recomputation runs no attention
    forward kernel for those layers, and loss and gradients still equal plain autograd's. Triton's
    attention (interpreted on CPU) is the one that records; head dim 64 is a size it supports."""
    from kernels.attention import function
    model = triton_attention_model()
    input_ids, labels = batch(seqlen=24)
    reference = loss_and_grads(model, input_ids, labels)
    forward_kernel, launched = function._forward, []
    monkeypatch.setattr(function, "_forward", lambda *a: launched.append(1) or forward_kernel(*a))
    policy = apply_memory_policy(model, placements, 2, torch.device("cpu"), attention=attention)
    assert_same(reference, loss_and_grads(model, input_ids, labels))
    assert len(launched) == launches == 4 + planned_backward_forwards(model, 24, policy)
    assert not policy.store.stored
    if host_kept is not None:
        assert ("attention", host_kept, 0, 1) in policy.engine.pool.buffers, "host-kept lse goes through the pool"


def traced_step(monkeypatch, attention=None):
    """One step of the 4-layer model placed g h r h (layer 1 rebuilds layer 2's input), checked against plain
    autograd: the policy, the step's events in order (each attention forward kernel, each layer's forward as
    "layer i", the host buffer of each copy back to the device) and the planner's count of the backward's
    attention forwards for that layout."""
    from kernels.attention import function
    model = triton_attention_model()
    input_ids, labels = batch(seqlen=24)
    reference = loss_and_grads(model, input_ids, labels)
    events, forward_kernel = [], function._forward
    monkeypatch.setattr(function, "_forward", lambda *a: events.append("attention") or forward_kernel(*a))
    policy = apply_memory_policy(model, ["gpu", "host", "recompute", "host"], 2, torch.device("cpu"),
                                 attention=attention)
    for index, layer in enumerate(model.get_base_model().model.layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: events.append(f"layer {index}"))
    to_device = policy.engine.to_device

    def copied_back(stored):      # the copy's start as its host buffer, the wait for it as ("wait", buffer)
        events.append(stored.host.data_ptr())
        pending = to_device(stored)
        wait = pending.wait
        pending.wait = lambda: events.append(("wait", stored.host.data_ptr())) or wait()
        return pending
    policy.engine.to_device = copied_back
    assert_same(reference, loss_and_grads(model, input_ids, labels))
    assert not policy.store.stored
    return policy, events, planned_backward_forwards(model, 24, policy)


@needs_interpreter
def test_a_layer_rebuilding_the_input_above_keeps_its_attention_for_its_own_backward(monkeypatch):
    """Layer 1 runs again in the backward to rebuild layer 2's input; that run's attention output goes into
    layer 1's own input buffer on the host (idle by then), and layer 1's recomputation replays it: one
    attention forward less, no new buffer of that size, and its copy back starts in layer 1's backward, not
    during layer 2's (whose peak has no room for it). Loss and gradients equal plain autograd's."""
    policy, events, planned = traced_step(monkeypatch)
    # 4 forwards, layer 3's recomputation, layer 1 rebuilding layer 2's input, layer 2's and 0's recomputation
    assert events.count("attention") == 8 == 4 + planned
    assert set(policy.engine.pool.buffers) == {input_key(1), input_key(3)}     # the lse stays on the device
    layer_1_buffer = policy.engine.pool.buffers[input_key(1)].data_ptr()
    backward = events[events.index("layer 3", 7):]      # from layer 3's recomputation on (8 forward events)
    assert backward[backward.index("layer 2"):backward.index("layer 0")] == [
        "layer 2", "attention", layer_1_buffer, "layer 1", ("wait", layer_1_buffer)]
    # waited for when layer 1's attention replays it, inside its recomputation: the copy holds up the
    # attention, not the layer's work before it


@needs_interpreter
def test_a_recomputed_input_keeps_its_attention_output_copied_back_in_its_own_backward(monkeypatch):
    """Layer 2's input is recomputed and its attention output kept on the host (the planner's pairs past the
    host's room): its recomputation replays it, as layer 1's replays its rebuilding run's, so the backward
    runs attention forwards for layers 3, 1 (rebuilding) and 0 only. Its copy back starts in its own
    backward, where the rebuilding forward hides it, not in layer 3's, whose peak has no room for it."""
    policy, events, planned = traced_step(monkeypatch, attention=["none", "none", "host", "none"])
    assert events.count("attention") == 7 == 4 + planned
    output_2 = policy.engine.pool.buffers[attention_key(2, 0, 0)].data_ptr()
    backward = events[events.index("layer 3", 7):]
    assert output_2 in backward
    assert backward.index(output_2) > backward.index("attention")           # after layer 3's recomputation
    assert backward.index(output_2) < backward.index("layer 1")             # before the rebuilding forward
    assert backward[backward.index("layer 1"):backward.index("layer 2")] == ["layer 1", "attention"]


def test_full_layers_run_their_forward_once():
    """A full layer keeps its activations: the backward re-runs no full layer, while a checkpointed one runs
    again (and a recomputed input's layer below runs once more to rebuild it)."""
    model = lora_model()
    input_ids, labels = batch()
    apply_memory_policy(model, ["full", "gpu", "recompute", "full"], 1, torch.device("cpu"))
    calls = []
    for index, layer in enumerate(model.get_base_model().model.layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
    loss_and_grads(model, input_ids, labels)
    assert calls == [0, 1, 2, 3, 1, 2, 1]     # forward; layer 2's input rebuilt, layer 2, layer 1


def test_recomputations_compute_no_output_that_nothing_reads():
    """A checkpointed layer's recomputation only rebuilds the graph for its backward, which recomputes the
    MLP tiles itself: its MLP runs tiles in the forward and in the backward, not also in the recomputation
    (a full layer the same); and a tile recomputed in the backward runs no down projection product, whose
    output only that tile's backward follows. Gradients are those of plain autograd."""
    model = lora_model()
    input_ids, labels = batch()
    reference = loss_and_grads(model, input_ids, labels)
    apply_memory_policy(model, ["gpu", "host", "full", "gpu"], 3, torch.device("cpu"))
    tiles_run, down_products = [0] * 4, [0] * 4
    for index, layer in enumerate(model.get_base_model().model.layers):
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda module, args, index=index: tiles_run.__setitem__(index, tiles_run[index] + 1))
        base_forward = layer.mlp.down_proj.base_layer.forward.forward      # under LinearUnlessUnread
        layer.mlp.down_proj.base_layer.forward.forward = (
            lambda x, index=index, base_forward=base_forward:
            down_products.__setitem__(index, down_products[index] + 1) or base_forward(x))
    assert_same(reference, loss_and_grads(model, input_ids, labels))
    assert tiles_run == [6] * 4          # 3 tiles forward, 3 in the backward
    assert down_products == [3] * 4      # the backward's tiles compute no down projection output


@needs_interpreter
def test_backward_fetches_its_own_attention_outputs_before_prefetching_the_layer_below():
    """The first backward starts the copy of its attention outputs itself: queued behind the prefetch of
    the next input, the compute stream would wait for that one too (1 GiB at 131k tokens)."""
    model = triton_attention_model()
    input_ids, labels = batch(seqlen=16)
    policy = apply_memory_policy(model, ["host"] * 4, 1, torch.device("cpu"), attention=["host"] * 4)
    # Per layer its input, attention output and lse, each layer's copies before any of the layer below's.
    assert host_to_device_copy_layers(policy, model, input_ids, labels) == [3, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: async copies on a side stream")
@pytest.mark.parametrize("placements, attention", [
    (["gpu", "host", "recompute", "host"], ["host", "gpu", "none", "host"]),
    (["full", "host", "recompute", "full"], ["none", "host", "none", "none"]),
    (["gpu", "host", "recompute", "host"], ["none"] * 4),     # layer 1 keeps the attention of its rebuilding run
    (["embedding", "host", "recompute", "full"], ["none", "none", "host", "none"]),      # the 524k plan's shape
], ids=["checkpointed", "with-full-layers", "rebuilt-attention", "full-top-embedding"])
@pytest.mark.parametrize("attention_kernel", ["flash", "cudnn"])
def test_policy_matches_plain_autograd_on_cuda(placements, attention, attention_kernel):
    from kernels.attention import choose_route
    from trainer.build import install_attention_route
    route = choose_route(torch.device("cuda"), 64, "auto", cudnn_fits=attention_kernel == "cudnn")
    if route.plan_kernel != attention_kernel:
        pytest.skip("cuDNN attention is offered on Hopper GPUs only")
    kernels.set_backend("auto")
    # head_dim 64: a size the Triton attention supports
    model = lora_model(device="cuda", dtype=torch.bfloat16, shape={**TINY, "hidden_size": 256})
    install_attention_route(model, route)
    input_ids, labels = batch(seqlen=512, device="cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    reference = loss_and_grads(model, input_ids, labels, autocast=autocast)
    policy = apply_memory_policy(model, placements, 3, torch.device("cuda"), attention=attention)
    for _ in range(2):      # the second step reuses the pinned buffers
        loss, grads = loss_and_grads(model, input_ids, labels, autocast=autocast)
        torch.testing.assert_close(loss, reference[0], rtol=1e-2, atol=0)
        for name, grad in grads.items():    # bf16: MLP tiles round differently, compare by norm
            ref = reference[1][name]
            assert float((grad - ref).norm() / ref.norm()) < 2e-2, name
    stats = policy.stats()
    assert stats["offload/pinned_gib"] > 0
    if attention == ["none"] * 4:      # per step: inputs 1 and 3, and the output layer 1's rebuilding run kept
        assert round(stats["offload/d2h_gib"] * 2 ** 30) == 2 * 3 * input_ids.numel() * 256 * 2


def peak_bytes_above_start(step, device: torch.device) -> int:
    """The most bytes allocated at once while `step()` runs, above what was allocated when it began: the CUDA
    allocator's peak, or on the CPU the running total of the profiler's memory events."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    with tempfile.TemporaryDirectory() as folder:
        profiler.export_chrome_trace(f"{folder}/trace.json")
        events = json.loads(Path(f"{folder}/trace.json").read_text())["traceEvents"]
    # each allocation or free, in order, with the running total after it
    totals = [(e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]"]
    return max(total for total, _ in totals) - (totals[0][0] - totals[0][1])


@pytest.mark.parametrize("device, seqlen, hidden", [pytest.param("cpu", 32, 128, marks=needs_interpreter),
                                                     pytest.param("cuda", 8192, 256, marks=needs_cuda)])
def test_a_full_top_layer_raises_the_peak_by_at_most_one_activation(device, seqlen, hidden):
    """offload.byte_model.top_layer_full_costs_nothing: a full top layer's backward holds what a checkpointed
    top layer's recomputation rebuilds, with the same gradients (its MLP output, which the recomputation skips,
    is the one activation of difference allowed), so the step's peak stays where the planner puts a
    checkpointed layer's backward. The vocabulary is tiny, so the loss is no peak here. On the CPU the
    Triton kernels run interpreted and the profiler's memory events give the peak."""
    kernels.set_backend("triton" if device == "cpu" else "auto")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shape = {**TINY, "hidden_size": hidden, "num_attention_heads": hidden // 64, "num_key_value_heads": 1}
    model = lora_model(device=device, dtype=dtype, shape=shape)
    input_ids, labels = batch(seqlen=seqlen, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None
    peaks = {}
    for top in ("host", "full"):
        policy = apply_memory_policy(model, ["embedding", "host", "host", top], 2, torch.device(device))
        if device == "cuda":        # a first step tunes the kernels (and pins the host buffers)
            loss_and_grads(model, input_ids, labels, autocast=autocast)
        else:                       # the interpreter tunes nothing; the host buffers are the step's own memory
            policy.pin_buffers(Shape(DecoderConfig(**shape), input_ids.numel(), 4))
        peaks[top] = peak_bytes_above_start(lambda: loss_and_grads(model, input_ids, labels, autocast=autocast),
                                            torch.device(device))
        policy.remove()
    activation = input_ids.numel() * hidden * (4 if device == "cpu" else 2)
    assert peaks["host"] > 4 * activation            # a layer's backward, well above its kept input
    assert peaks["full"] <= peaks["host"] + activation, peaks


def test_lora_wraps_every_projection_and_freezes_the_base():
    from conf.schema import MemoryConfig
    from offload.plan import plan_memory
    model = lora_model()
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(LORA.lora_target_modules)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert all(p.dtype == torch.float32 for name, p in model.named_parameters() if name in trainable)
    cuda = torch.device("cuda")
    plan = plan_memory(DecoderConfig(**TINY), SimpleNamespace(mode="lora", **vars(LORA)),
                       MemoryConfig(gpu_memory_gib=80), 64, 1, cuda)
    assert plan.weights_dtype == torch.bfloat16
    on_cpu = plan_memory(DecoderConfig(**TINY), SimpleNamespace(mode="lora", **vars(LORA)), MemoryConfig(), 64, 1,
                         torch.device("cpu"))
    assert on_cpu.weights_dtype == torch.float32
