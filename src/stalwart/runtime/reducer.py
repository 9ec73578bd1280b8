"""Bucketed gradient reduction, launched from autograd hooks while the step's last backward runs.

Like DDP's reducer, parameters are grouped into buckets in reverse order of
``model.parameters()`` (roughly the order backward produces their gradients),
the first bucket small (1 MiB) so that reduction starts early, the others up
to ``bucket_cap_mb``. During the step's last backward a
``post_accumulate_grad`` hook counts each gradient in; once a bucket's are all
in, they are copied into its reduce buffer in one batched copy and the bucket
is all-reduced, in bucket order (every process issues the same collectives
in the same order, which Gloo and NCCL require). What backward did not reach
(unused parameters, a process with no samples) is launched when backward is
over. The hooks are Python and run once per parameter and step, so each only
counts: a model of hundreds of parameters pays one batched copy per bucket,
not a copy call per parameter (right after a backward, with the caches cold,
a call costs several times the counting).

Why a copy (what DDP does with ``gradient_as_bucket_view=False``): the
reduction must not destroy what this process accumulated. When a bucket's
collective fails, ``param.grad`` still holds this process's sums; the
Manager computes the reassigned samples on top and reduces again in the new
quorum. The reduce buffers are the only extra memory, one per bucket, in the
reduce dtype (the parameters' own dtype unless ``reduce_dtype`` asks for a
lower precision). After a success the reduced sums, divided by the step's
summed weights (its sample count, or the user's counts), are copied back into
``param.grad``.

The step's tail (sample count, loss sum, checks: see the Manager) rides at the
end of the last bucket when that bucket reduces in float32; otherwise (bf16
or fp16 reduction) it is a separate float32 all-reduce issued right after the
last bucket, since its counts must be exact.

FSDP2 (a replica group that ``fully_shard``-s its model): parameters and
gradients are DTensors and the reducer works on their local shards, over the
communicator of the processes that hold the same shard in every group. FSDP2
assigns a module's sharded gradients once its reduce-scatter in the group is
done, in the middle of backward, and then runs the sharded parameters'
``post_accumulate_grad`` hooks: so the cross-group reduction of the last
modules' buckets overlaps the backward of the first, as in the replicated
case (read in the torch 2.13 that ``requirements-dev.txt`` pins; a bucket no
hook launched is launched after backward, like an unused parameter's). On
CUDA FSDP2 runs the hooks with its post-reduce stream current, so a bucket's
copy (in its last gradient's hook) and its all-reduce are ordered after the
reduce-scatters that made its shards (one stream runs them in order); FSDP2
makes the current stream wait for that stream before backward returns, so a
bucket copied and launched after backward sees them too.
The tail, which counts every process of every group, goes over the whole
quorum's communicator instead (``tail_comm``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stalwart.runtime.comm import CollectiveError, Communicator
from stalwart.runtime.config import DEFAULT_BUCKET_CAP_MB, REDUCE_DTYPES
from stalwart.runtime.sharding import is_dtensor, local_tensor

FIRST_BUCKET_BYTES = 1 << 20
"""The first bucket's cap (DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``, or ``bucket_cap_mb`` when smaller)."""


@dataclass(frozen=True)
class Bucket:
    """Parameters reduced together: their indices (into the reducer's list), offsets in the buffer, and dtype."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype


def plan_buckets(
    params: Sequence[tuple[int, torch.dtype]],
    *,
    cap_bytes: int,
    first_cap_bytes: int = FIRST_BUCKET_BYTES,
    reduce_dtype: torch.dtype | None = None,
) -> list[Bucket]:
    """Buckets for parameters given as ``(numel, dtype)`` in ``model.parameters()`` order.

    Parameters are taken last to first; a bucket closes when the next
    parameter would take it past its cap (``first_cap_bytes`` for the first,
    ``cap_bytes`` after) or has another reduce dtype. A parameter larger than
    a cap gets a bucket of its own.
    """
    buckets: list[Bucket] = []
    members: list[int] = []
    offsets: list[int] = []
    numel = 0
    dtype: torch.dtype | None = None

    def close() -> None:
        nonlocal members, offsets, numel
        if members:
            assert dtype is not None
            buckets.append(Bucket(tuple(members), tuple(offsets), numel, dtype))
        members, offsets, numel = [], [], 0

    for index in reversed(range(len(params))):
        count, param_dtype = params[index]
        wanted = reduce_dtype or param_dtype
        cap = first_cap_bytes if not buckets else cap_bytes
        if members and (wanted != dtype or (numel + count) * _itemsize(wanted) > cap):
            close()
        dtype = wanted
        members.append(index)
        offsets.append(numel)
        numel += count
    close()
    return buckets


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class GradientReducer:
    """Reduces the gradients of ``params`` in buckets; survives a failed collective with the gradients intact.

    One round per reduction attempt: :meth:`arm` before the step's last
    backward (hooks then launch buckets as they fill), :meth:`launch_rest`
    after it, :meth:`wait` for the sums, and :meth:`apply` to put the mean
    gradients into ``param.grad``. A failed round leaves ``param.grad``
    untouched; the next round (in a new quorum) reduces it again.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        device: torch.device,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {list(REDUCE_DTYPES)} or None, got {reduce_dtype!r}")
        self.params = list(params)
        self.device = device
        cap_bytes = max(1, int(bucket_cap_mb * (1 << 20)))
        self.buckets = plan_buckets(
            [(local_tensor(param).numel(), param.dtype) for param in self.params],
            cap_bytes=cap_bytes,
            first_cap_bytes=min(FIRST_BUCKET_BYTES, cap_bytes),
            reduce_dtype=reduce_dtype,
        )
        self._bucket_of = [0] * len(self.params)
        for number, bucket in enumerate(self.buckets):
            for index in bucket.params:
                self._bucket_of[index] = number
        self._sharded = any(is_dtensor(param) for param in self.params)
        self._buffers: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        """Each parameter's slice of its bucket's buffer, shaped like its (local) gradient."""
        self._same_dtype = [
            all(self.params[index].dtype == bucket.dtype for index in bucket.params) for bucket in self.buckets
        ]
        """Per bucket: whether every gradient in it has the bucket's dtype (a reduce dtype of their own does not)."""
        self._tail_buffer: torch.Tensor | None = None
        self._tail_size = -1
        self._comm: Communicator | None = None
        self._tail: Callable[[], torch.Tensor] | None = None
        self._filled: list[int] = []
        """Per bucket: how many of its gradients are in (their hooks ran) this round."""
        self._ready: list[bool] = []
        """Per parameter: its gradient is in this round (a second hook in the round is an error)."""
        self._bucket_copied: list[bool] = []
        self._next = 0
        self._waits: list[Callable[[], None]] = []
        self._tail_launched = False
        self._held = False
        """Buckets are copied as they fill but launched only by :meth:`launch_rest` (see :meth:`arm`)."""
        self._error: BaseException | None = None
        self._tail_comm: Communicator | None = None
        self._handles = [
            param.register_post_accumulate_grad_hook(self._hook_for(index)) for index, param in enumerate(self.params)
        ]

    @property
    def step_bytes(self) -> int:
        """The bytes one round all-reduces (every bucket, in its reduce dtype; the small tail aside)."""
        return sum(bucket.numel * _itemsize(bucket.dtype) for bucket in self.buckets)

    @property
    def tail_rides_last_bucket(self) -> bool:
        """Whether this round's tail is reduced in the last bucket's collective (float32, same communicator)."""
        return self._tail_comm is None and bool(self.buckets) and self.buckets[-1].dtype == torch.float32

    @property
    def armed(self) -> bool:
        """True between :meth:`arm` and :meth:`wait`: gradients produced now are the round's."""
        return self._comm is not None

    @property
    def launched_buckets(self) -> int:
        """How many buckets of the current round are launched (all of them once backward reached every one)."""
        return self._next

    def arm(
        self,
        comm: Communicator,
        tail: Callable[[], torch.Tensor],
        tail_size: int,
        *,
        tail_comm: Communicator | None = None,
        hold: bool = False,
    ) -> None:
        """Start a round on ``comm``: the next backward's hooks launch buckets; ``tail()`` gives the tail at launch.

        With ``tail_comm`` the tail is reduced there, in its own collective.
        With ``hold`` the hooks only copy, and :meth:`launch_rest` launches
        every bucket: the first collective may wait (for a leader's
        ``on_leader`` work), and must not wait inside backward.
        """
        self._held = hold
        self._tail_comm = tail_comm
        self._allocate(tail_size)
        self._comm = comm
        self._tail = tail
        self._filled = [0] * len(self.buckets)
        self._ready = [False] * len(self.params)
        self._bucket_copied = [False] * len(self.buckets)
        self._next = 0
        self._waits = []
        self._tail_launched = False
        self._error = None

    def launch_rest(self) -> None:
        """Launch every bucket not launched yet, in order (gradients backward did not produce count as zero)."""
        if self._comm is None:
            raise RuntimeError("launch_rest() needs an armed round: call arm() first")
        self._held = False
        for number in range(len(self.buckets)):
            if not self._bucket_copied[number]:
                self._copy_bucket(number)
        self._launch_ready()

    def wait(self) -> torch.Tensor:
        """Wait for every bucket; the reduced tail (on the device). Raises :class:`CollectiveError` on failure.

        The round ends either way; after a failure the buffers are dropped
        (an aborted collective may still hold them) and new ones are made for
        the next round.
        """
        try:
            if self._error is not None:
                raise self._error
            if not self._tail_launched:
                raise RuntimeError("wait() before every bucket was launched: call launch_rest() first")
            for wait in self._waits:
                wait()
        except CollectiveError:
            self._buffers, self._tail_buffer, self._tail_size = [], None, -1
            raise
        finally:
            self._comm = None
            self._tail_comm = None
            self._tail = None
        return self._tail_view()

    def apply(self, divisor: float) -> None:
        """Replace each ``param.grad`` with the reduced sum divided by ``divisor`` (in the parameter's dtype).

        A bucket whose gradients share its dtype is divided in place, in one
        operation, and copied into the gradients in one batched copy
        (``torch._foreach_copy_``, what torch's own optimizers batch with): no
        Python work per parameter beyond collecting its gradient. A bucket in
        a reduce dtype of its own divides into each gradient (the quotient
        computed in the reduce dtype either way).
        """
        gradients, sources = [], []
        for number, (bucket, buffer) in enumerate(zip(self.buckets, self._buffers, strict=True)):
            batched = self._same_dtype[number]
            if batched:
                buffer[: bucket.numel].div_(divisor)
            for index in bucket.params:
                param = self.params[index]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                gradient = local_tensor(param.grad) if self._sharded else param.grad
                if batched:
                    gradients.append(gradient)
                    sources.append(self._views[index])
                else:
                    torch.div(self._views[index], divisor, out=gradient)
        if gradients:
            torch._foreach_copy_(gradients, sources)

    def close(self) -> None:
        """Remove the autograd hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _allocate(self, tail_size: int) -> None:
        rides = self.tail_rides_last_bucket
        if self._buffers and tail_size == self._tail_size and rides == (self._tail_buffer is None):
            return
        self._buffers = [
            torch.empty(
                bucket.numel + (tail_size if rides and number == len(self.buckets) - 1 else 0),
                dtype=bucket.dtype,
                device=self.device,
            )
            for number, bucket in enumerate(self.buckets)
        ]
        self._tail_buffer = None if rides else torch.empty(tail_size, dtype=torch.float32, device=self.device)
        self._tail_size = tail_size
        self._views = [torch.empty(0)] * len(self.params)
        for bucket, buffer in zip(self.buckets, self._buffers, strict=True):
            for index, offset in zip(bucket.params, bucket.offsets, strict=True):
                local = local_tensor(self.params[index])
                self._views[index] = buffer[offset : offset + local.numel()].view(local.shape)

    def _tail_view(self) -> torch.Tensor:
        if self._tail_buffer is not None:
            return self._tail_buffer
        return self._buffers[-1][self.buckets[-1].numel :]

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        number = self._bucket_of[index]
        size = len(self.buckets[number].params)

        def hook(_: torch.Tensor) -> None:
            if self._comm is None or self._error is not None:
                return
            if self._ready[index]:
                self._error = RuntimeError(
                    f"the gradient of parameter {index} changed after it was handed to the reduction: "
                    "call step.backward(loss) once per micro-batch"
                )
                return
            self._ready[index] = True
            self._filled[number] += 1
            if self._filled[number] == size:
                self._copy_bucket(number)
                self._launch_ready()

        return hook

    def _copy_bucket(self, number: int) -> None:
        """Put bucket ``number``'s gradients into its buffer in one batched copy (zeros for a parameter without)."""
        views, gradients = [], []
        for index in self.buckets[number].params:
            gradient = self.params[index].grad
            if gradient is None:
                self._views[index].zero_()
            else:
                views.append(self._views[index])
                gradients.append(local_tensor(gradient) if self._sharded else gradient)
        if views:
            torch._foreach_copy_(views, gradients)
        self._bucket_copied[number] = True

    def _launch_ready(self) -> None:
        assert self._comm is not None and self._tail is not None
        if self._held:
            return
        comm, tail = self._comm, self._tail
        try:
            while self._next < len(self.buckets) and self._bucket_copied[self._next]:
                last = self._next == len(self.buckets) - 1
                if last and self.tail_rides_last_bucket:
                    self._tail_view().copy_(tail())
                    self._tail_launched = True
                self._waits.append(comm.start_all_reduce_sum(self._buffers[self._next]))
                self._next += 1
            if self._next == len(self.buckets) and not self._tail_launched:
                assert self._tail_buffer is not None
                self._tail_buffer.copy_(tail())
                self._waits.append((self._tail_comm or comm).start_all_reduce_sum(self._tail_buffer))
                self._tail_launched = True
        except CollectiveError as error:  # raised from wait(): inside backward it would end the user's loop
            self._error = error
