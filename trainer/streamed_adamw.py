"""StreamedAdamW: full fine-tuning where fp32 master weights do not fit. bf16 weights and AdamW moments on
the GPU, updated with stochastic rounding by a fused kernel (kernels.adamw_update), and bf16 gradients
either kept on the GPU (state layout "bf16") or streamed to pinned host memory during the backward
("bf16_host_grads"; the layouts and their bytes: offload.state_layouts).

How a step runs with `StreamedAdamW`:
  backward: a parameter's post-accumulate-grad hook marks its unit (a decoder layer; any other parameter
    is a unit of its own) as the open one. Units finish one after another (per-layer checkpointing
    back-propagates each layer whole) but one hook call does not mean a gradient is final: a tiled MLP
    accumulates its weights' gradients once per tile. So a unit is flushed when a hook of *another* unit
    fires: each gradient (plus, with host gradients, the partial sum of earlier micro-batches, copied
    back and added on the GPU) has its squared L2 norm recorded, and with host gradients is copied to the
    pinned buffer on the side stream of a CopyEngine (offload.engine) and freed on the GPU.
  clip_grad_norm_: flushes the last unit; the global norm is sqrt(sum of the recorded squares), which is
    the norm of the fully accumulated gradient (a re-flushed unit overwrites its entries), so clipping is
    exact, as torch.nn.utils.clip_grad_norm_ (coefficient min(1, max_norm / (norm + 1e-6))).
  step: unit by unit, the gradients come back from the host (the next unit's copy overlapping this
    unit's update kernels) and each parameter gets one fused AdamW update on grad * coefficient.

Sharded by FSDP2 (trainer.sharding), each rank holds a shard of every parameter (a DTensor) and works on that
alone: FSDP2 calls the hook after the gradient's reduce-scatter, with the shard of the sum over the ranks, so
what is recorded and streamed to the host is already reduced; the squared norms of the shards are summed over
the ranks once, in clip_grad_norm_; the moments are sharded as the parameters are; and a shard's element draws
its stochastic rounding by its index in the whole parameter, so the update is the one process's, whatever the
number of ranks (and a resume repeats it: the draws depend on the seed, the step and the parameter alone).

The optimizer is a torch.optim.Optimizer with AdamW's state keys (step, exp_avg, exp_avg_sq), so
state_dict()/load_state_dict() work as for torch.optim.AdamW (moments are cast to the parameter dtype on
load, so a torch AdamW checkpoint loads too).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import kernels
from model import unwrap_model
from offload.engine import CopyEngine, HostCopy, PendingTensor


def update_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """Trainable parameters grouped by decoder layer (a layer's gradients are complete together in the
    backward), in forward order; every other parameter is a unit of its own. Tied tensors appear once."""
    lm = unwrap_model(model)
    layer_of = {id(p): i for i, layer in enumerate(lm.model.layers) for p in layer.parameters()}
    units, layer_units, seen = [], {}, set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        layer = layer_of.get(id(param))
        if layer is None:
            units.append([param])
        elif layer in layer_units:
            layer_units[layer].append(param)
        else:
            layer_units[layer] = [param]
            units.append(layer_units[layer])
    return units


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor, sharing its memory; any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_element(param: torch.Tensor) -> int:
    """The flat index, in the whole parameter, of this rank's first element (0 unless sharded). FSDP2 shards
    dim 0, so a shard is one range of the whole row-major tensor."""
    if not isinstance(param, DTensor):
        return 0
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"StreamedAdamW updates parameters sharded on dim 0, not {param.placements}")
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0] * math.prod(param.shape[1:])


# Elements of a gradient squared in fp64 at a time: a bounded transient (128 MiB) for the largest gradient.
NORM_CHUNK = 1 << 24


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of `grad`, summed in fp64: near exact whatever the order of the sums, so that the
    global norm of shards summed over ranks gives the one process's clipping coefficient to the last fp32 bit
    (stochastic rounding turns a coefficient one bit apart into elements one bf16 step apart)."""
    chunks = grad.reshape(-1).split(NORM_CHUNK)
    return sum(torch.linalg.vector_norm(chunk, dtype=torch.float64) ** 2 for chunk in chunks)


class HostGradients:
    """Every parameter's gradient in one pinned buffer (the planner counts one of 2 B/param), carved into a
    view per parameter; copies run on the side stream of the engine (plain and synchronous on CPU, so the
    same logic runs in CPU tests)."""

    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.engine = CopyEngine(device, timed=False)
        self.views = dict(zip(params, self.engine.pool.carve("gradients", [local(p) for p in params])))
        self.held: dict[nn.Parameter, HostCopy] = {}     # parameters whose host view holds this step's sum

    def store(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Copy `grad` into the host view (asynchronously on CUDA); the caller may drop `grad` at once."""
        self.held[param] = self.engine.copy_to_host(self.views[param], grad)

    def load(self, params: list[nn.Parameter]) -> dict[nn.Parameter, PendingTensor]:
        """Start copying the held gradients of `params` to the device; `wait()` on each gives it."""
        return {p: self.engine.to_device(self.held[p]) for p in params if p in self.held}


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW over bf16 (or any dtype) parameters updated in place by `kernels.adamw_update`, with exact
    global-norm clipping from gradients gathered during the backward (module docstring).

    Per step: zero_grad(); backward of every micro-batch; clip_grad_norm_(max_norm); step()."""

    def __init__(self, param_groups: list[dict], units: list[list[nn.Parameter]], *, lr: float,
                 betas: tuple[float, float], eps: float, grads_on_host: bool, device: torch.device, seed: int = 0):
        super().__init__(param_groups, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0})
        params = [p for group in self.param_groups for p in group["params"]]
        self.units = units
        self.unit_of = {p: index for index, unit in enumerate(units) for p in unit}
        if set(self.unit_of) != set(params):
            raise ValueError("update units must cover exactly the optimizer's parameters")
        self.norm_index = {p: index for index, p in enumerate(params)}
        # Sharded (FSDP2): the ranks whose shards' squared norms add up to the global one.
        self.shard_group = params[0].device_mesh.get_group() if isinstance(params[0], DTensor) else None
        self.first = {p: first_element(p) for p in params}
        self.squared_norms = torch.zeros(len(params), dtype=torch.float64, device=device)
        self.host = HostGradients(params, device) if grads_on_host else None
        self.open_unit: int | None = None
        self.grad_scale = 1.0
        self.seed = seed
        self.hooks = [p.register_post_accumulate_grad_hook(self._gradient_accumulated) for p in params]

    # ------------------------------------------------------------------------------- during the backward

    def _gradient_accumulated(self, param: nn.Parameter) -> None:
        unit = self.unit_of[param]
        if self.open_unit is not None and self.open_unit != unit:
            self._flush(self.open_unit)
        self.open_unit = unit

    def _flush(self, unit: int) -> None:
        """Record the squared norms of the unit's accumulated gradients; with host gradients, move them
        there (adding the partial sum of earlier micro-batches first)."""
        for param in self.units[unit]:
            if param.grad is None:
                continue
            grad = local(param.grad)
            if self.host is not None and param in self.host.held:
                grad.add_(self.host.load([param])[param].wait())
            self.squared_norms[self.norm_index[param]] = squared_norm(grad)
            if self.host is not None:
                self.host.store(param, grad)
                param.grad = None

    # -------------------------------------------------------------------------------- after the backward

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the step's accumulated gradients; step() will scale them by
        min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ would (inf: no clipping)."""
        if self.open_unit is not None:
            self._flush(self.open_unit)
            self.open_unit = None
        squares = self.squared_norms.sum()
        if self.shard_group is not None:
            dist.all_reduce(squares, group=self.shard_group)
        norm = squares.sqrt()
        self.grad_scale = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.squared_norms.zero_()
        self.open_unit = None
        if self.host is not None:
            self.host.held.clear()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("StreamedAdamW.step takes no closure")
        if self.open_unit is not None:
            raise RuntimeError("call clip_grad_norm_ (with inf for no clipping) between backward and step")
        # Looked up per step: load_state_dict replaces the group dicts.
        group_of = {p: group for group in self.param_groups for p in group["params"]}
        incoming = self._gradients_of(0)
        for index, unit in enumerate(self.units):
            grads = incoming
            if index + 1 < len(self.units):
                incoming = self._gradients_of(index + 1)      # overlaps this unit's updates
            for param in unit:
                if param in grads:
                    grad = grads[param]
                    self._update(param, grad.wait() if isinstance(grad, PendingTensor) else grad, group_of[param])

    def _gradients_of(self, unit: int) -> dict[nn.Parameter, torch.Tensor | PendingTensor]:
        """The unit's gradients: on the device, or with host gradients their copies back, started."""
        params = self.units[unit]
        if self.host is not None:
            return self.host.load(params)
        return {p: local(p.grad) for p in params if p.grad is not None}

    def init_state(self) -> None:
        """Zero moments at step 0 for every parameter that has none: what a loader (DCP) fills in place.
        (torch's own stand-in, a step on zero gradients, creates none here: with host gradients the step
        reads only the gradients the backward stored.)"""
        for group in self.param_groups:
            for param in group["params"]:
                self._state_of(param)

    def _state_of(self, param: nn.Parameter) -> dict:
        state = self.state[param]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                         exp_avg_sq=torch.zeros_like(param))
        return state

    def _update(self, param: nn.Parameter, grad: torch.Tensor, group: dict) -> None:
        state = self._state_of(param)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        kernels.adamw_update(local(param), grad, local(state["exp_avg"]), local(state["exp_avg_sq"]), lr=group["lr"],
                             beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                             step=step, grad_scale=self.grad_scale,
                             seed=hash((self.seed, step, self.norm_index[param])) % 2**31, first=self.first[param])

    def load_state_dict(self, state_dict: dict) -> None:
        # Free the current moments first: on the GPU two copies of them (2 x 30 GiB at 8B) do not fit.
        self.state.clear()
        super().load_state_dict(state_dict)
