"""The outer state: the global parameters of each fragment, their outer optimizers, and each pending exchange.

The model's parameters are the group's *local* (inner) parameters; each
fragment also holds float32 *global* copies, which only outer steps change,
and an outer optimizer over them. A fragment's pseudo-gradient is its global
parameters minus its local ones; the exchange averages the groups'
pseudo-gradients weighted by the samples each trained since the fragment's
last exchange (its *window*) and sets it as the globals' gradient, and the
outer optimizer steps. Then the local parameters follow: at a round's end
they become the new globals; after an overlapped exchange (Streaming
DiLoCo: ``overlap`` inner steps ran since the launch) they keep what those
steps added, ``local += (new globals - old globals) + pseudo-gradient``,
which is ``new globals + (local - local at the launch)``, so the next
pseudo-gradient holds exactly the progress since this one.

Error feedback is per process and fragment slice: what the codec's rounding
took from a send is added to the next send of the same slice. The globals,
the outer optimizers and ``syncs`` (mid-round fragment exchanges applied,
over the job) are the member's state (healed and checked bit for bit); the
windows, errors and pending exchanges are this process's own and start from
zero after a heal.

FSDP2 groups (``sharded``): each process holds a shard of every parameter
(process r of every group the same one), so its globals are DTensors of the
parameters' layout, its outer optimizer's state is its shard's, and a
fragment's "flattened" values are this process's shards of it: process r
exchanges its whole shard with process r of the other groups, and nothing is
gathered inside the group. Heals and checkpoints move the globals and outer
state shard by shard, as they do the model's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.runtime.diloco.config import DiLoCo
from stalwart.runtime.diloco.exchange import Prepared, prepare
from stalwart.runtime.diloco.fragments import partition
from stalwart.runtime.sharding import local_tensor, shaped_like


@dataclass
class Pending:
    """A fragment exchange this process launched and has not applied yet."""

    prepared: Prepared
    delta: torch.Tensor
    """The fragment's whole pseudo-gradient (unweighted) at the launch, for the local update after it."""
    merge: bool
    """Keep the local progress made since the launch (an overlapped exchange), else local := new globals."""
    error: torch.Tensor | None
    """The error feedback before the launch (restored if the exchange is withdrawn)."""


@dataclass
class Fragment:
    """A run of the model's parameters, with global copies and an outer optimizer."""

    index: int
    local: list[torch.nn.Parameter]
    globals: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    numel: int
    """Values of the fragment this process holds (all of them; with FSDP2 groups, its shards')."""
    window: int = 0
    """Samples this process's group trained since the fragment's last exchange (the weight of the next one)."""
    error: torch.Tensor | None = None
    pending: Pending | None = None

    def slice_bounds(self, rank: int, processes: int) -> tuple[int, int]:
        """This process's slice of the flattened fragment (equal lengths, the last one shorter)."""
        length = -(-self.numel // processes)
        return min(rank * length, self.numel), min((rank + 1) * length, self.numel)

    def slice_length(self, processes: int) -> int:
        return -(-self.numel // processes)

    def flat_globals(self) -> torch.Tensor:
        return torch.cat([local_tensor(param.detach()).reshape(-1) for param in self.globals])

    def flat_local(self) -> torch.Tensor:
        return torch.cat([local_tensor(param.detach()).reshape(-1).float() for param in self.local])

    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(local, global)`` tensors this process holds, pairwise (its shards with FSDP2 groups), for updates."""
        return [
            (local_tensor(local.detach()), local_tensor(global_.detach()))
            for local, global_ in zip(self.local, self.globals, strict=True)
        ]

    def reset_local_state(self) -> None:
        """Forget this process's own part (after a heal): window, error feedback, pending exchange."""
        self.window = 0
        self.error = None
        self.pending = None


class OuterState:
    """Every fragment's globals and outer optimizer (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], config: DiLoCo, *, sharded: bool = False) -> None:
        self.config = config
        self.sharded = sharded
        """FSDP2 groups: each process exchanges its whole shards with the same process of the other groups."""
        self.fragments: list[Fragment] = []
        for index, run in enumerate(partition([param.numel() for param in params], config.fragments)):
            local = [params[position] for position in run]
            globals_ = [torch.nn.Parameter(param.detach().float().clone()) for param in local]
            optimizer = config.outer_optimizer(globals_)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"DiLoCo.outer_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
                )
            numel = sum(local_tensor(param).numel() for param in local)
            self.fragments.append(Fragment(index, local, globals_, optimizer, numel))
        self.syncs = 0
        """Mid-round fragment exchanges applied over the job (the same on every member)."""

    def reset_locals_to_globals(self) -> None:
        """The model's parameters := the global ones (a healed process, the job's end); own windows forgotten."""
        with torch.no_grad():
            for fragment in self.fragments:
                for local, global_ in fragment.pieces():
                    local.copy_(global_)
                fragment.reset_local_state()

    def add_samples(self, samples: int) -> None:
        """The group trained ``samples`` more: every fragment's window grows."""
        for fragment in self.fragments:
            fragment.window += samples

    def slicing(self, rank: int, processes: int) -> tuple[int, int]:
        """``(slice, slices)`` of a fragment this process exchanges: its rank's of its group, or its whole shards."""
        return (0, 1) if self.sharded else (rank, processes)

    def launch(self, fragment: Fragment, rank: int, processes: int, members: int, *, merge: bool) -> Pending:
        """Encode this process's slice of ``fragment``'s weighted pseudo-gradient; the window restarts."""
        delta = fragment.flat_globals() - fragment.flat_local()
        weight = float(fragment.window)
        fragment.window = 0
        return self._encode(fragment, delta, weight, fragment.error, rank, processes, members, merge)

    def reencode(self, fragment: Fragment, rank: int, processes: int, members: int) -> Pending:
        """The pending exchange encoded again for another quorum (an int8 exchange cuts a chunk per group)."""
        pending = fragment.pending
        assert pending is not None
        delta, weight = pending.delta, pending.prepared.weight
        return self._encode(fragment, delta, weight, pending.error, rank, processes, members, pending.merge)

    def _encode(
        self,
        fragment: Fragment,
        delta: torch.Tensor,
        weight: float,
        error: torch.Tensor | None,
        rank: int,
        processes: int,
        members: int,
        merge: bool,
    ) -> Pending:
        rank, processes = self.slicing(rank, processes)
        start, stop = fragment.slice_bounds(rank, processes)
        piece = torch.zeros(fragment.slice_length(processes), dtype=torch.float32, device=delta.device)
        piece[: stop - start] = delta[start:stop]
        carried = error if error is not None else torch.zeros_like(piece)
        wanted = (piece + carried) * weight
        prepared = prepare(wanted, weight, self.config.codec, members, self.config.int8_block)
        fragment.pending = Pending(prepared, delta, merge, error)
        if weight > 0:
            fragment.error = (wanted - prepared.decoded) / weight
        return fragment.pending

    def withdraw(self, fragment: Fragment) -> None:
        """Undo a launch whose exchange never completed: its window and error feedback come back."""
        pending = fragment.pending
        assert pending is not None
        fragment.window += int(pending.prepared.weight)
        fragment.error = pending.error
        fragment.pending = None

    def apply(self, fragment: Fragment, reduced: torch.Tensor, weight: float) -> None:
        """The outer step of ``fragment`` with the groups' summed weighted pseudo-gradient, then the local update.

        ``reduced``: the whole fragment's sum (every slice gathered). With no
        samples trained anywhere in the window (``weight`` 0) there is no step.
        """
        pending = fragment.pending
        assert pending is not None
        fragment.pending = None
        with torch.no_grad():
            before = fragment.flat_globals().clone() if pending.merge else None
            if weight > 0:
                average = reduced[: fragment.numel] / weight
                offset = 0
                for global_ in fragment.globals:
                    numel = local_tensor(global_).numel()
                    global_.grad = shaped_like(average[offset : offset + numel].clone(), global_)
                    offset += numel
                fragment.optimizer.step()
                fragment.optimizer.zero_grad(set_to_none=True)
            offset = 0
            for piece, whole in fragment.pieces():
                if before is None:
                    piece.copy_(whole)
                else:
                    old = before[offset : offset + whole.numel()].view_as(whole)
                    step = pending.delta[offset : offset + whole.numel()].view_as(whole)
                    piece.add_((whole - old + step).to(piece.dtype))
                offset += whole.numel()

    def digest(self) -> str:
        """SHA-256 (hex) of the globals, the outer optimizers' state and ``syncs``: equal on every member.

        With FSDP2 groups, of this process's shards: equal on process r of every member.
        """
        hasher = hashlib.sha256()
        hasher.update(str(self.syncs).encode())
        for fragment in self.fragments:
            for global_ in fragment.globals:
                hasher.update(local_tensor(global_.detach()).cpu().contiguous().numpy().tobytes())
            for _, state in sorted(fragment.optimizer.state_dict()["state"].items()):
                for key in sorted(state):
                    value = state[key]
                    data = (
                        local_tensor(value.detach()).cpu().contiguous().numpy().tobytes()
                        if torch.is_tensor(value)
                        else value
                    )
                    hasher.update(f"{key}={data!r}".encode() if not isinstance(data, bytes) else data)
        return hasher.hexdigest()


class GlobalsState:
    """The globals and ``syncs`` as a state the heal copies (``sync/globals``); tensors load in place."""

    def __init__(self, outer: OuterState) -> None:
        self.outer = outer

    def state_dict(self) -> dict[str, Any]:
        return {
            "syncs": self.outer.syncs,
            "fragments": [[param.detach() for param in fragment.globals] for fragment in self.outer.fragments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for fragment, tensors in zip(self.outer.fragments, state["fragments"], strict=True):
                for param, tensor in zip(fragment.globals, tensors, strict=True):
                    local_tensor(param.detach()).copy_(local_tensor(tensor))
        self.outer.syncs = int(state["syncs"])
