"""Where each decoder layer's input and attention output are kept: the placement search of the planner.

Layer inputs first: the first k stay on the GPU, the rest go to pinned host memory, and every other one
from the top is recomputed instead when the host cannot hold them all. Attention outputs (from the top
layer down) then take the room left, on the GPU, then on the host. GPU room still left then turns
checkpointed layers into "full" ones, which keep every activation and recompute nothing; the top layer
can be one at no cost (byte_model.top_layer_full_costs_nothing), and the others are then placed below it.

What must fit is the GPU room (`GpuRoom`): everything kept at once, or, where the backward makes gradients
on the GPU (full fine-tuning's "bf16" state layout), its fullest moment.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conf.errors import ConfigError
from offload.byte_model import Shape, layer_parameters, pinned_size
from offload.store import AttentionPlacement, Placement, copied_back_ahead, rebuilds_attention


def _recomputable(layers: int, on_gpu: int) -> range:
    """Layers whose input may be recomputed, from the top: every other one above the GPU-kept ones (each
    needs the layer below kept), never layer 0."""
    return range(layers - 1, on_gpu, -2)


def _placements(layers: int, on_gpu: int, recomputed: int, from_embedding: bool) -> list[Placement]:
    """First `on_gpu` layers on the GPU; `recomputed` layers from the top, every other one; the rest on
    the host. `from_embedding`: layer 0's input, wherever it would be kept, is looked up again from the
    token embedding instead ("embedding"), which costs a gather and no bytes."""
    placements = [Placement.GPU] * on_gpu + [Placement.HOST] * (layers - on_gpu)
    for index in _recomputable(layers, on_gpu)[:recomputed]:
        placements[index] = Placement.RECOMPUTE
    if from_embedding:
        placements[0] = Placement.EMBEDDING
    return placements


def max_recomputed(layers: int, on_gpu: int) -> int:
    return len(_recomputable(layers, on_gpu))


def _attention_placements(layers: int, on_gpu: int, on_host: int) -> list[AttentionPlacement]:
    """Kept attention outputs from the top layer down (the backward's first): `on_gpu` on the GPU, the
    next `on_host` on the host, none below."""
    kept = [AttentionPlacement.GPU] * on_gpu + [AttentionPlacement.HOST] * on_host
    return [AttentionPlacement.NONE] * (layers - len(kept)) + kept[::-1]


# The GPU items of a plan's fullest moment in the backward (GpuRoom): the layers' gradients made so far, the
# input embedding's (only where that moment is the backward's end), and the slot the layer back-propagating
# then copies the attention output of the layer below back into.
FULLEST_MOMENT = "layer gradients made so far"
MADE_LAST = "input embedding gradient"
PREFETCH_SLOT = "attention output prefetch"


@dataclass(frozen=True)
class GpuRoom:
    """The GPU bytes left for kept activations (and gradients made in the backward), and when they are held.

    With `layer_gradient` 0 whatever is kept is held at once, at the end of the forward. Full fine-tuning
    with its gradients on the GPU and one micro-batch per step (trainer.streamed_adamw: gradients are None
    until the backward makes them) makes `layer_gradient` bytes per layer, top layer first, while each
    layer's kept activations are freed by its own backward: while layer k back-propagates the GPU holds
    what layers 0..k keep and the gradients of layers k and above, and after the last one every gradient.
    The room must hold the fullest of those moments (at the top for inputs cheaper than a gradient, at
    the bottom for costlier ones). `layers_above`: layers above the ones placed (the top layer, full at no
    cost) whose backward comes first and makes their gradients before any of these. `made_last`: gradient
    bytes made after the last layer's backward (the input embedding's, untied from the head), held only
    at the end (where the room still leaves out a layer backward's transient, more than the embedding's
    backward needs)."""
    bytes: int
    layer_gradient: int = 0
    layers_above: int = 0
    made_last: int = 0

    def fullest(self, by_layer: list[int], during: list[int] | None = None) -> tuple[int, int | None]:
        """(bytes at the fullest moment, the layer whose backward it is in: None at the end of the forward,
        -1 after the backward when the gradients alone are most). `during[k]`: bytes held only while layer k
        back-propagates (the slot it copies the kept attention output of the layer below back into), which
        count where the layers above have freed less than that."""
        during = during or [0] * len(by_layer)
        layers = len(by_layer) + self.layers_above
        held = sum(by_layer)
        most, layer = (layers * self.layer_gradient + self.made_last, -1) if self.layer_gradient else (held, None)
        for k in range(len(by_layer) - 1, -1, -1):
            moment = held + during[k] + (layers - k) * self.layer_gradient
            if moment > most:
                most, layer = moment, k
            held -= by_layer[k]
        return most, layer


@dataclass
class KeptLayers:
    """Where each layer's input and attention output are kept, and what that costs."""
    placements: list[Placement]
    attention: list[AttentionPlacement]
    gpu: dict[str, int]
    host: dict[str, int]


def keep_layers(shape: Shape, memory_cfg, device: torch.device, room: GpuRoom, host_room: int,
                layers: int, from_embedding: bool) -> KeptLayers:
    """Where the bottom `layers` checkpointed layers keep their inputs and attention outputs: layer inputs
    first (the first k on the GPU, the rest on the host, recomputed when the host is full; with
    `from_embedding` layer 0's looked up again instead), then attention outputs in what room is left. When
    the inputs do not all fit the GPU, keeping attention outputs on the host needs a GPU slot for prefetching
    them: reserving it may move one input to the host, which is taken if it keeps more attention outputs
    without recomputing more inputs."""
    offload = memory_cfg.offload and device.type == "cuda"
    candidates = [_keep_inputs_then_attention(shape, memory_cfg, offload, room, host_room, reserve, layers,
                                              from_embedding)
                  for reserve in ((0, shape.attention_bytes) if offload else (0,))]
    if (offload and memory_cfg.recomputed_inputs is None and memory_cfg.kept_attention_layers is None
            and shape.output_fits_input_slot):
        candidates += _recomputing_for_outputs(shape, room, host_room, candidates[0],
                                               vary_gpu_inputs=memory_cfg.gpu_layers is None)
    return min(candidates, key=lambda kept: _rank(shape, room, host_room, kept))


def _rank(shape: Shape, room: GpuRoom, host_room: int, kept: KeptLayers) -> tuple:
    """One that fits first (an explicit kept_attention_layers count fits only with the reserve), then the least
    recomputation, fewest recomputed inputs, most kept attention outputs; min() keeps the first on ties."""
    overflows = sum(kept.gpu.values()) > room.bytes or sum(kept.host.values()) > host_room
    return (overflows, recompute_flops(shape, kept.placements, kept.attention),
            kept.placements.count(Placement.RECOMPUTE), kept.attention.count(AttentionPlacement.NONE))


def rebuilding_keeps(shape: Shape, placements: list[Placement], attention: list[AttentionPlacement],
                     index: int) -> bool:
    """offload.store.rebuilds_attention where the attention output fits the input buffer it goes to (a
    Llama's does; the store keeps nothing otherwise)."""
    return shape.output_fits_input_slot and rebuilds_attention(placements, attention, index)


def backward_attention_forwards(shape: Shape, placements: list[Placement],
                                attention: list[AttentionPlacement]) -> int:
    """The attention forwards a step's backward runs: one in each checkpointed layer's recomputation that
    replays no kept output (its own, or its rebuilding run's: `rebuilding_keeps`), and one in each run that
    rebuilds a recomputed input."""
    replays = [a != AttentionPlacement.NONE or rebuilding_keeps(shape, placements, attention, i)
               for i, a in enumerate(attention)]
    return (sum(p != Placement.FULL and not replayed for p, replayed in zip(placements, replays))
            + placements.count(Placement.RECOMPUTE))


def recompute_flops(shape: Shape, placements: list[Placement], attention: list[AttentionPlacement]) -> float:
    """What a plan's backward recomputes beyond one forward of each checkpointed layer without its attention:
    its attention forwards (causal, over the whole row) and the rest of each rebuilding run. Trading an input
    for an attention output pays from about 50k tokens on (the attention forward of a Llama-3-8B layer then
    costs what the rest of the layer does)."""
    arch, tokens = shape.arch, shape.tokens
    attention_forward = 2.0 * tokens * tokens * arch.head_dim * arch.num_attention_heads
    rest_of_layer = 2.0 * tokens * layer_parameters(arch)
    return (backward_attention_forwards(shape, placements, attention) * attention_forward
            + placements.count(Placement.RECOMPUTE) * rest_of_layer)


def _recomputing_for_outputs(shape: Shape, room: GpuRoom, host_room: int, base: KeptLayers,
                             vary_gpu_inputs: bool) -> list[KeptLayers]:
    """Where the host cannot hold every input (`base` recomputes some), layouts that recompute more, each
    recomputed input keeping its own attention output where its input would have been: the layer below
    rebuilds its input and keeps its own output from that run (`rebuilds_attention`), so a pair of such
    layers runs one attention forward in the backward instead of two, for the rebuild's other work (at 524k
    tokens about 0.5 s against 3.5 s). Outputs go to the host room left, then to the GPU room left, for every
    count of recomputed inputs and, with `vary_gpu_inputs` (memory.gpu_layers unset), of GPU-kept inputs up
    to `base`'s (an input moved to the host leaves a GPU slot an output can take); none when `base`
    recomputes nothing."""
    if Placement.RECOMPUTE not in base.placements:
        return []
    from_embedding = base.placements[0] == Placement.EMBEDDING
    layers, most_on_gpu = len(base.placements), base.placements.count(Placement.GPU) + from_embedding
    layouts = []
    fewest_on_gpu = int(from_embedding) if vary_gpu_inputs else most_on_gpu    # 0 and 1: one layout with "embedding"
    for on_gpu in range(most_on_gpu, fewest_on_gpu - 1, -1):
        for recomputed in range(1, max_recomputed(layers, on_gpu) + 1):
            kept = _keeping_own_outputs(shape, room, host_room, _placements(layers, on_gpu, recomputed, from_embedding),
                                        _recomputable(layers, on_gpu)[:recomputed])
            if kept is not None:
                layouts.append(kept)
    return layouts


def _keeping_own_outputs(shape: Shape, room: GpuRoom, host_room: int, placements: list[Placement],
                         recomputed: range) -> KeptLayers | None:
    """`placements` with the `recomputed` layers (from the top) keeping their attention outputs, on the host
    while its room lasts, then on the GPU while its room lasts; None where the inputs alone do not fit."""
    attention = [AttentionPlacement.NONE] * len(placements)
    gpu, host = _layer_bytes(shape, placements, attention, 0, room)
    host_left = host_room - sum(host.values())
    if sum(gpu.values()) > room.bytes or host_left < 0:
        return None
    on_host = min(len(recomputed), host_left // shape.attention_pinned_bytes)
    for index in recomputed[:on_host]:
        attention[index] = AttentionPlacement.HOST
    for index in recomputed[on_host:]:
        attention[index] = AttentionPlacement.GPU
        if sum(_layer_bytes(shape, placements, attention, 0, room)[0].values()) > room.bytes:
            attention[index] = AttentionPlacement.NONE
            break
    return KeptLayers(placements, attention, *_layer_bytes(shape, placements, attention, 0, room))


def _keep_inputs_then_attention(shape: Shape, memory_cfg, offload: bool, room: GpuRoom, host_room: int,
                                reserve: int, layers: int, from_embedding: bool) -> KeptLayers:
    no_attention = [AttentionPlacement.NONE] * layers

    def gpu_bytes(placements: list[Placement], attention: list[AttentionPlacement]) -> int:
        return sum(_layer_bytes(shape, placements, attention, 0, room)[0].values())

    def inputs(on_gpu: int, recomputed: int) -> list[Placement]:
        return _placements(layers, on_gpu, recomputed, from_embedding)

    # Without CUDA there is nowhere to offload to: the "GPU" is the host.
    on_gpu = layers if not offload else min(layers, memory_cfg.gpu_layers) if memory_cfg.gpu_layers is not None \
        else _most(lambda n: gpu_bytes(inputs(n, 0), no_attention) + reserve <= room.bytes, layers)
    on_host = inputs(on_gpu, 0).count(Placement.HOST)
    needed = max(0, on_host - host_room // pinned_size(shape.activation))
    recomputed = (memory_cfg.recomputed_inputs if memory_cfg.recomputed_inputs is not None
                  else min(needed, max_recomputed(layers, on_gpu)))
    placements = inputs(on_gpu, min(recomputed, max_recomputed(layers, on_gpu)))
    inputs_host = _layer_bytes(shape, placements, no_attention, 0, room)[1]

    def attention_fits(outputs_on_gpu: int, outputs_on_host: int) -> bool:
        return gpu_bytes(placements, _attention_placements(layers, outputs_on_gpu, outputs_on_host)) <= room.bytes

    attention_gpu, attention_host = _kept_attention(shape, memory_cfg, attention_fits,
                                                    host_room - sum(inputs_host.values()), offload, layers)
    attention = _attention_placements(layers, attention_gpu, attention_host)
    return KeptLayers(placements, attention, *_layer_bytes(shape, placements, attention, 0, room))


def _most(fits, limit: int) -> int:
    """The largest n <= limit with fits(n), for a condition that holds up to some n and not beyond (0 when
    not even fits(1))."""
    n = 0
    while n < limit and fits(n + 1):
        n += 1
    return n


def _layer_bytes(shape: Shape, placements: list[Placement], attention: list[AttentionPlacement], full_bytes: int,
                 room: GpuRoom) -> tuple[dict[str, int], dict[str, int]]:
    """(GPU, host) bytes of kept inputs, attention outputs (with the GPU slot their host copies are
    prefetched into) and full layers' activations (`full_bytes` each): on the GPU at its fullest moment
    (`GpuRoom`; with gradients made in the backward, what layers up to the one back-propagating then keep,
    and those gradients), on the host all of them."""
    a, b = shape.activation, shape.attention_bytes
    by_layer = [(a if kept == Placement.GPU else full_bytes if kept == Placement.FULL else 0)
                + (b if output == AttentionPlacement.GPU else 0) for kept, output in zip(placements, attention)]
    # A checkpointed layer's backward starts copying back the host-kept attention output of the layer below
    # (offload.policy; a full layer's backward is autograd's own and copies nothing).
    slots = [b if k > 0 and placements[k] != Placement.FULL and copied_back_ahead(placements, attention, k - 1)
             else 0 for k in range(len(placements))]
    _, layer = room.fullest(by_layer, slots)
    held = len(placements) if layer is None else layer + 1       # the layers whose kept bytes are held then
    gpu = {"layer inputs on GPU": placements[:held].count(Placement.GPU) * a,
           "attention outputs on GPU": attention[:held].count(AttentionPlacement.GPU) * b}
    host = ({"pinned layer inputs": placements.count(Placement.HOST) * pinned_size(a)}
            if Placement.HOST in placements else {})
    if layer is not None and layer >= 0 and slots[layer]:
        gpu[PREFETCH_SLOT] = slots[layer]
    if any(rebuilding_keeps(shape, placements, attention, index) for index in range(len(placements))):
        gpu["rebuilt attention lse"] = shape.attention_output[1]     # one at a time, through the layer above's backward
    if AttentionPlacement.HOST in attention:
        host["pinned attention outputs"] = attention.count(AttentionPlacement.HOST) * shape.attention_pinned_bytes
    if Placement.FULL in placements:
        gpu["full layers' activations"] = placements[:held].count(Placement.FULL) * full_bytes
    if layer is not None and room.layer_gradient:
        gpu[FULLEST_MOMENT] = (len(placements) + room.layers_above - max(layer, 0)) * room.layer_gradient
    if layer == -1 and room.made_last:
        gpu[MADE_LAST] = room.made_last
    return gpu, host


def with_full_layers(kept: KeptLayers, shape: Shape, full_bytes: int, room: GpuRoom, host_room: int,
                     wanted: int | None, top_costs_nothing: bool = False) -> KeptLayers:
    """Turn checkpointed layers into full ones (every activation kept, `full_bytes` each, no recompute and
    no kept attention output): `wanted` of them, or with None each that still fits the GPU `room`. Each
    saves one layer recompute of equal cost, so the order only decides the bytes. With `top_costs_nothing`
    (byte_model.top_layer_full_costs_nothing: `kept` then places the layers below the top) the top layer comes
    first, a full layer the plan counts no bytes for; then layers whose input is on the GPU (paid for
    already), then host-kept ones and layer 0's looked up from the embedding, from layer 0 up; never one
    below a recomputed input, which is rebuilt from the input the layer below keeps."""
    placements, attention = list(kept.placements), list(kept.attention)
    candidates = [i for i, p in enumerate(placements) if p == Placement.GPU] + [
        i for i, p in enumerate(placements)
        if p in (Placement.HOST, Placement.EMBEDDING) and placements[i + 1:i + 2] != [Placement.RECOMPUTE]]
    chosen, costs = int(top_costs_nothing), (kept.gpu, kept.host)
    for index in candidates:
        if wanted is not None and chosen == wanted:
            break
        trial_placements, trial_attention = list(placements), list(attention)
        trial_placements[index], trial_attention[index] = Placement.FULL, AttentionPlacement.NONE
        trial = _layer_bytes(shape, trial_placements, trial_attention, full_bytes, room)
        if wanted is None and (sum(trial[0].values()) > room.bytes or sum(trial[1].values()) > host_room):
            continue
        placements, attention, costs, chosen = trial_placements, trial_attention, trial, chosen + 1
    if wanted is not None and chosen < wanted:
        raise ConfigError(f"memory.full_layers={wanted}: {chosen} layers can be full here (a layer needs its "
                          f"input kept, on the GPU or the host, and no recomputed input above it): set it to at "
                          f"most {chosen}, or null to let the planner choose")
    if top_costs_nothing:
        placements, attention = placements + [Placement.FULL], attention + [AttentionPlacement.NONE]
    return KeptLayers(placements, attention, *costs)


def _kept_attention(shape: Shape, memory_cfg, gpu_fits, host_room: int, offload: bool,
                    layers: int) -> tuple[int, int]:
    """(on GPU, on host) counts of the checkpointed `layers` whose attention output is kept: all wanted layers
    that fit the GPU (`gpu_fits(count on the GPU, count on the host)`, the host-kept ones' copy back counted
    in the backward that starts it), the rest in the host room."""
    wanted = layers if memory_cfg.kept_attention_layers is None else min(layers, memory_cfg.kept_attention_layers)
    fit_on_gpu = _most(lambda count: gpu_fits(count, 0), wanted)
    if fit_on_gpu == wanted:
        return fit_on_gpu, 0
    if not offload:      # nowhere else to keep them: an explicit count stays whole, so the plan fails with advice
        return (fit_on_gpu if memory_cfg.kept_attention_layers is None else wanted), 0

    def on_host(on_gpu: int) -> int:
        return wanted - on_gpu if memory_cfg.kept_attention_layers is not None else \
            min(wanted - on_gpu, max(0, host_room) // shape.attention_pinned_bytes)

    if not gpu_fits(0, on_host(0)) and memory_cfg.kept_attention_layers is None:
        return fit_on_gpu, 0               # no GPU room to copy host-kept outputs back into
    # The most that fit, counted up from none: one more on the GPU adds its bytes to the moments that hold
    # it, and moves the host's first copy back, whose slot the layers above then free more room for.
    on_gpu = _most(lambda count: gpu_fits(count, on_host(count)), wanted)
    host = on_host(on_gpu)
    return (on_gpu, host) if host else (fit_on_gpu, 0)
