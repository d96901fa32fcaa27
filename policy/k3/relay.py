"""Point-to-point messages between neighbouring context ranks, with their gradients (context.py).

A message is a list of tensors of at most 4 dimensions (float, or uint8 for masks). The sender
first sends a header (the count, whether the tensors need a gradient, then per tensor its dtype
code, rank and shape), then the tensors, without waiting (`isend`): the sender computes on while
the message travels, and waits for every send at the end of its forward (`Relay.finish`; a
no-grad forward also waits for the messages before the previous one at each send).
The receiver gets tensors that stand for the sender's in autograd: in the backward their
gradient goes back to the sender (`_Recv.backward` sends it without waiting, the sends awaited
when the backward ends; `_Send.backward` receives it and hands it to the sent tensors), and a 0
(the anchor) tied to the sends rides on the sender's loss so that autograd reaches them.

Both sides must make the same messages in the same order (the transfers carry no tags): every
message a rank sends, its next rank receives, one for one. In the backward, autograd runs the
sends' and receives' gradient transfers in reverse order of creation on both sides.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8)


class Relay:
    """This rank's links to rank - 1 (receive) and rank + 1 (send) of a context `group`."""

    def __init__(self, group, device: torch.device) -> None:
        self.group, self.device = group, device
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.prev = dist.get_global_rank(group, rank - 1) if rank > 0 else None
        self.next = dist.get_global_rank(group, rank + 1) if rank + 1 < world else None
        self._messages: list[list] = []  # per message in flight: its isends' (work, tensor)
        self._anchor: Tensor | None = None

    def receive(self) -> tuple[Tensor, ...]:
        """The next message from rank - 1 (() on the first rank), its gradient sent back."""
        if self.prev is None:
            return ()
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, self.prev, group=self.group)
        header = torch.empty(int(size), dtype=torch.long)
        dist.recv(header, self.prev, group=self.group)
        grad, specs = bool(header[0]), header[1:].view(-1, 6).tolist()
        if not specs:
            return ()
        anchor = torch.zeros((), requires_grad=grad)  # no gradient: the sender waits for none
        src, specs = self.prev, tuple(_spec(row) for row in specs)
        return tuple(_Recv.apply(anchor, src, self.group, self.device, specs))

    def send(self, tensors: tuple[Tensor, ...]) -> None:
        """Send `tensors` to rank + 1 (nothing on the last rank); when any needs a gradient
        (and gradients are on), the gradient rank + 1 sends back reaches them. Without one,
        the messages before the previous one are awaited first, so that a no-grad forward holds
        two messages' tensors at most (with one, autograd holds them anyway)."""
        if self.next is None:
            return
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
        if not grad:
            self._settle(keep=1)
        header, message = _header(tensors, grad), []
        self._messages.append(message)
        for x in (torch.tensor([len(header)]), header):
            _isend(x, self.next, self.group, message)
        if grad:
            zero = _Send.apply(self.next, self.group, message, *tensors)
            self._anchor = zero if self._anchor is None else self._anchor + zero
        else:
            for x in tensors:
                _isend(x.detach().contiguous(), self.next, self.group, message)

    def finish(self, hidden_BSD: Tensor) -> Tensor:
        """Wait for every send; -> the anchor: a 0 to add to the loss, tied to the sends (their
        gradients come back) and to this rank's last hidden state (so to every received
        tensor: the backward reaches the receives, whose gradient rank - 1 waits for, even
        when the loss reaches no position of this rank)."""
        self._settle(keep=0)
        if not hidden_BSD.requires_grad:
            return hidden_BSD.new_zeros(())
        anchor = _Zero.apply(hidden_BSD[:, -1:, :1])
        if self._anchor is not None:  # handed over: the relay keeps no graph alive
            anchor, self._anchor = anchor + self._anchor.to(anchor.dtype), None
        return anchor

    def _settle(self, keep: int) -> None:
        """Wait for the messages in flight but the last `keep` (rank + 1 receives in order)."""
        while len(self._messages) > keep:
            for work, _ in self._messages.pop(0):
                work.wait()


def _isend(x: Tensor, dst: int, group, pending: list) -> None:
    """Send x without waiting; (work, x) goes on `pending`, which keeps x alive until then."""
    pending.append((dist.isend(x, dst, group=group), x))


def _wait_after_backward(pending: list) -> None:
    """Wait for `pending` sends once the running backward has finished (autograd's callback),
    so that a backward never waits for the receiver in the middle of its work."""

    def wait() -> None:
        for work, _ in pending:
            work.wait()
        pending.clear()

    torch.autograd.Variable._execution_engine.queue_callback(wait)


def _header(tensors: tuple[Tensor, ...], grad: bool) -> Tensor:
    """[whether the tensors need a gradient, then per tensor: dtype code, rank, 4 dims], int64."""
    if any(x.dim() > 4 for x in tensors):
        raise ValueError("relayed tensors have at most 4 dimensions")
    rows = [[_DTYPES.index(x.dtype), x.dim(), *x.shape, *[0] * (4 - x.dim())] for x in tensors]
    return torch.tensor([int(grad)] + [v for row in rows for v in row], dtype=torch.long)


def _spec(row: list[int]) -> tuple[tuple[int, ...], torch.dtype]:
    code, ndim, *dims = row
    return tuple(dims[:ndim]), _DTYPES[code]


class _Zero(torch.autograd.Function):
    """0, with a zero gradient for x (never NaN, whatever x holds)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.spec = (x.shape, x.dtype, x.device)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        shape, dtype, device = ctx.spec
        return torch.zeros(shape, dtype=dtype, device=device)


class _Send(torch.autograd.Function):
    """Forward: send the tensors to rank + 1 without waiting (onto `pending`), return 0.
    Backward: receive their gradient from it (floating tensors only). The node keeps no
    reference to the Relay: the Relay's anchor leads to this node, and a cycle through autograd
    nodes would keep the step's graph alive after its backward."""

    @staticmethod
    def forward(ctx, dst: int, group, pending: list, *tensors: Tensor) -> Tensor:
        for x in tensors:
            _isend(x.detach().contiguous(), dst, group, pending)
        ctx.dst, ctx.group = dst, group
        ctx.specs = [(x.shape, x.dtype, x.device) for x in tensors]
        return tensors[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _grad):
        grads = []
        for shape, dtype, device in ctx.specs:
            if not dtype.is_floating_point:
                grads.append(None)
                continue
            grad = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(grad, ctx.dst, group=ctx.group)
            grads.append(grad)
        return None, None, None, *grads


class _Recv(torch.autograd.Function):
    """Forward: receive the tensors from rank - 1. Backward: send their gradient there (zeros
    where this rank's loss does not reach a tensor)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, src: int, group, device, specs) -> tuple[Tensor, ...]:
        del anchor  # only there so that autograd calls backward
        out = []
        for shape, dtype in specs:
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, src, group=group)
            out.append(x)
        ctx.src, ctx.group, ctx.device, ctx.specs = src, group, device, specs
        ctx.mark_non_differentiable(*[x for x in out if not x.dtype.is_floating_point])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        pending = []
        for (shape, dtype), grad in zip(ctx.specs, grads, strict=True):
            if dtype.is_floating_point:
                if grad is None:
                    grad = torch.zeros(shape, dtype=dtype, device=ctx.device)
                _isend(grad.contiguous(), ctx.src, ctx.group, pending)
        _wait_after_backward(pending)
        return None, None, None, None, None
