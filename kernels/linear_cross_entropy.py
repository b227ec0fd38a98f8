"""Cross-entropy of hidden @ weight.T against targets, without ever building the full logits.

At 131k tokens and Llama-3's 128256-word vocabulary the logits alone are 63 GiB in fp32. Here the N
tokens go through in chunks: one matmul makes a chunk's logits, a Triton kernel turns each logits row
into its loss and overwrites the row IN PLACE with d(loss)/d(logits) = (softmax - one_hot) * scale,
then two matmuls take the chunk's share of grad_hidden and grad_weight. All gradients are made in the
forward; the backward only scales them by the incoming gradient.

Memory beyond inputs and outputs is one logits chunk (chunk x V in the hidden dtype) plus, when it fits
the budget, an fp32 grad_weight accumulator. At V=128256, H=4096 that accumulator is 2 GiB, the whole
default budget, so bf16/fp16 weights then accumulate grad_weight in their own dtype: each chunk's product
is summed in fp32 inside cuBLAS (addmm, beta=1) and rounded once per chunk, so the error grows with the
number of chunks, which is why the chunk is the largest the budget allows.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
import triton
import triton.language as tl

# Bytes of temporaries (logits chunk, fp32 grad_weight accumulator) beyond inputs and outputs. 1.75 GiB
# keeps the op under 2 GiB extra with cuBLAS's workspace and the per-token loss vector on top.
DEFAULT_MEMORY_BUDGET = 7 * 2**28
# Chunks are a multiple of this many tokens when they can be, so the matmuls get whole tiles.
_CHUNK_TOKENS_MULTIPLE = 256
# Vocabulary columns a program handles per step of its row loop, and its warps: every pair swept from (2048, 4)
# to (16384, 16) ran near the copy rate (docs/PERFORMANCE.md, "Kernels").
BLOCK_V = 8192
NUM_WARPS = 16
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _cross_entropy_rows_kernel(logits_ptr, logits_row_stride, targets_ptr, loss_ptr, scale_ptr, n_cols,
                               ignore_index, BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr):
    """One program per token: loss = logsumexp(row) - row[target]; with WRITE_GRAD the row is replaced by
    (softmax(row) - one_hot(target)) * scale, or zeros for an ignored token."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(targets_ptr + row)
    ignored = target == ignore_index
    tl.device_assert(ignored | ((target >= 0) & (target < n_cols)), "target outside [0, vocab)")

    # Pass 1: online logsumexp over the row, one block at a time.
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        logits = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target_logit = tl.load(row_ptr + tl.where(ignored, 0, target)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target_logit))

    # Pass 2: the gradient over the logits it came from; zero scale zeroes an ignored token's row.
    if WRITE_GRAD:
        row_scale = tl.where(ignored, 0.0, tl.load(scale_ptr))
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            in_row = cols < n_cols
            logits = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
            grad = tl.exp(logits - lse) * row_scale - tl.where(cols == target, row_scale, 0.0)
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor,
                       ignore_index: int, write_grad: bool, *, block_v: int = BLOCK_V,
                       num_warps: int = NUM_WARPS) -> None:
    """Per-row losses of a logits chunk into `losses`; with write_grad, logits become the loss's gradient
    (times `scale`, a device scalar) in place. block_v columns per step (capped at the vocabulary's next
    power of two) and num_warps per row tune the launch."""
    n_rows, vocab = logits.shape
    _cross_entropy_rows_kernel[(n_rows,)](logits, logits.stride(0), targets, losses, scale, vocab, ignore_index,
                                          BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
                                          WRITE_GRAD=write_grad, num_warps=num_warps)


def _accumulate_grad_weight(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight += grad_logits.T @ hidden, where grad_weight may be an fp32 accumulator for 16-bit operands."""
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
    elif grad_weight.is_cuda:
        torch.addmm(grad_weight, grad_logits.t(), hidden, out_dtype=grad_weight.dtype, out=grad_weight)
    else:  # CPU matmuls have no 16-bit-in, fp32-out form: upcast the (chunk-sized) operands.
        grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), hidden.to(grad_weight.dtype))


def plan_chunks(n_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, grad_weight: bool,
                memory_budget: int) -> tuple[int, bool]:
    """(tokens per chunk, whether grad_weight accumulates in fp32) for a budget of temporary bytes.

    The fp32 accumulator is used for 16-bit weights when it takes at most half the budget; the logits chunk
    gets the rest, rounded down to a multiple of 256 tokens, at least 1 token (which may exceed a budget
    smaller than one logits row).
    """
    accumulator_bytes = vocab * hidden_size * 4
    accumulate_fp32 = grad_weight and dtype != torch.float32 and accumulator_bytes <= memory_budget // 2
    logits_budget = memory_budget - (accumulator_bytes if accumulate_fp32 else 0)
    chunk = logits_budget // (vocab * dtype.itemsize)
    if chunk >= _CHUNK_TOKENS_MULTIPLE:
        chunk -= chunk % _CHUNK_TOKENS_MULTIPLE
    return max(1, min(chunk, n_tokens)), accumulate_fp32


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy needs hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],) or targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an int64/int32 vector of {hidden.shape[0]} token ids, got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if hidden.dtype not in SUPPORTED_DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one float dtype of {SUPPORTED_DTYPES}, got "
                        f"{hidden.dtype} and {weight.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"hidden, weight, targets on different devices: {hidden.device}, {weight.device}, "
                         f"{targets.device}")


def _fused_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                   reduction: str, memory_budget: int, rows_launch: dict, need_grad_hidden: bool,
                   need_grad_weight: bool):
    """(loss, grad_hidden or None, grad_weight or None), the gradients of the loss itself (d loss = 1);
    rows_launch: cross_entropy_rows's block_v and num_warps."""
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    chunk, accumulate_fp32 = plan_chunks(n_tokens, hidden_size, vocab, hidden.dtype, need_grad_weight,
                                         memory_budget)
    if reduction == "mean":  # a device tensor, so no host sync: the kernel reads it
        scale = 1.0 / (targets != ignore_index).sum().clamp(min=1).to(torch.float32)
    else:
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    losses = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    grad_weight = (torch.zeros(weight.shape, dtype=torch.float32 if accumulate_fp32 else weight.dtype,
                               device=weight.device) if need_grad_weight else None)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        hidden_chunk = hidden[start:end]
        logits = hidden_chunk @ weight.t()
        cross_entropy_rows(logits, targets[start:end], losses[start:end], scale, ignore_index,
                           write_grad=need_grad_hidden or need_grad_weight, **rows_launch)
        if need_grad_hidden:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_grad_weight:
            _accumulate_grad_weight(grad_weight, logits, hidden_chunk)
        del logits  # free the chunk before the next one is allocated
    if accumulate_fp32:
        grad_weight = grad_weight.to(weight.dtype)
    return losses.sum() * scale, grad_hidden, grad_weight


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                reduction: str, memory_budget: int, rows_launch: dict) -> torch.Tensor:
        loss, grad_hidden, grad_weight = _fused_forward(hidden, weight, targets, ignore_index, reduction,
                                                        memory_budget, rows_launch, *ctx.needs_input_grad[:2])
        ctx.gradients = (grad_hidden, grad_weight)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.gradients is None:
            raise RuntimeError("linear_cross_entropy's backward can run only once (its gradients are scaled "
                               "in place); do not use retain_graph=True through it")
        grad_hidden, grad_weight = ctx.gradients
        ctx.gradients = None
        # Comparing with 1 syncs with the device, negligible next to the forward's matmuls; it saves a pass
        # over grad_weight and grad_hidden in the usual case of a plain loss.backward().
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
            for grad in (grad_hidden, grad_weight):
                if grad is not None:
                    grad.mul_(grad_loss.to(grad.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean",
                         memory_budget: int | None = None, *, block_v: int = BLOCK_V,
                         num_warps: int = NUM_WARPS) -> torch.Tensor:
    """Same contract as `reference.linear_cross_entropy` (fp32 loss); targets must lie in [0, V) or equal
    ignore_index. memory_budget: bytes of temporaries allowed (default DEFAULT_MEMORY_BUDGET); it sets the
    chunk size, which changes the result only by rounding. block_v, num_warps: `cross_entropy_rows`'s launch."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # As nn.Linear under autocast: the matmuls run in the autocast dtype (differentiable casts, no-ops
        # when the dtypes match already); inside, autocast is off so the gradient buffers keep that dtype.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    _check_inputs(hidden, weight, targets, reduction)
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    rows_launch = {"block_v": block_v, "num_warps": num_warps}
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return LinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, reduction, budget,
                                                    rows_launch)
        loss, _, _ = _fused_forward(hidden, weight, targets, ignore_index, reduction, budget, rows_launch,
                                    False, False)
        return loss
