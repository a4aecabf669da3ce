"""torch in a dry run: a process group without peers, and what this rank of a strategy holds.

In a simulated rank (``MS_SIMULATION_LEVEL``) msrun's rank hook calls :func:`install` once
``torch.distributed`` is imported: ``init_process_group()`` - any backend, ``env://`` or none -
makes torch's ``fake`` process group with this rank and the job's world size (collectives return
at once, without peers), and a device mesh of a device type this machine lacks (``"cuda"`` on a
CPU build, ``"npu"``) is built for ``"cpu"``: placements, DTensor and FSDP2 shards are computed as
on the real cluster. Tensors are not moved: code that calls a missing device's API itself fails as
on any machine without one (build on ``meta``, as large plans do).

:func:`account` and :func:`collectives` say what this rank holds and what one step sends; each
call adds to the rank's record (``$MSRUN_SIM_RECORD``, JSON), which msrun's summary and the
test's report put side by side. Over the budget (``--sim_budget``, the marker's ``sim_budget``:
``$MSRUN_SIM_BUDGET`` bytes) :func:`account` raises :class:`OverBudget`, naming what is held.
"""

from __future__ import annotations

import json
import os
import sys

from pytest_msrun.sizes import format_size

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

RECORD_ENV = "MSRUN_SIM_RECORD"
BUDGET_ENV = "MSRUN_SIM_BUDGET"
__all__ = ["OverBudget", "account", "collectives"]


class OverBudget(AssertionError):
    """This rank holds more than the dry run's budget per rank."""


def _env_int(*names: str) -> int:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return -1


# ------------------------------------------------------------------------------------ the patches
def install() -> None:
    """Make ``init_process_group`` and device meshes need no peers and no devices (idempotent)."""
    import inspect

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.init_process_group, "_msrun_dry", False):
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (registers the "fake" backend)

    original = c10d.init_process_group
    signature = inspect.signature(original)

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(*args, **kwargs).arguments  # (a real backend's store, device: unused)
        rank, world = given.get("rank", -1), given.get("world_size", -1)
        rank = rank if rank >= 0 else _env_int("RANK", "RANK_ID")
        world = world if world > 0 else _env_int("WORLD_SIZE", "RANK_SIZE")
        keep = {k: v for k, v in given.items() if k in ("timeout", "group_name") and v is not None}
        return original("fake", store=FakeStore(), rank=rank, world_size=world, **keep)

    init_process_group._msrun_dry = True  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    for module in [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "torch"]:
        if getattr(module, "init_process_group", None) is original:  # torch.distributed, device_mesh, ...
            setattr(module, "init_process_group", init_process_group)  # noqa: B010

    for name in OBJECT_COLLECTIVES:  # no peers to take objects from: said, not garbage unpickled
        setattr(c10d, name, _no_objects(name))
        setattr(dist, name, getattr(c10d, name))
    _ddp_hook(dist)

    from torch.distributed import device_mesh

    mesh_init = device_mesh.DeviceMesh.__init__

    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if not _available(torch, str(device_type).split(":")[0]):
            device_type = "cpu"
        mesh_init(self, device_type, *args, **kwargs)

    device_mesh.DeviceMesh.__init__ = __init__
    threads = os.environ.get("MSRUN_SIM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # this rank's share of the CPUs (msrun runs ranks side by side)
        torch.set_num_threads(int(threads))


# What this module imports in a simulated rank, which a session's fork server imports once for all
# of them where its marked tests are dry runs of torch code (plugin/controller/frameworks.py)
RANK_MODULES = ("torch.testing._internal.distributed.fake_pg", "torch.distributed.tensor.debug")

OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def _no_objects(name: str) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"torch.distributed.{name} in a dry run (MS_SIMULATION_LEVEL): each simulated rank runs alone, "
            "with no peers to exchange objects with; compute the object on every rank, or skip the exchange "
            "when pytest_msrun.cluster.is_dryrun()"
        )

    return collective


def _ddp_hook(dist: Any) -> None:
    """DistributedDataParallel's gradient all-reduce as a comm hook (the fake process group's own
    work gives DDP's reducer no result to wait on): the all-reduce is issued - seen by
    :func:`collectives` - and the bucket is its result. A comm hook of the user's is not run."""
    import warnings

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    init, register = DDP.__init__, DDP.register_comm_hook

    def all_reduce(state: Any, bucket: Any) -> Any:
        dist.all_reduce(bucket.buffer(), group=state)
        done: Any = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    all_reduce.__annotations__.clear()  # DDP checks a hook's annotations: none is always right

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        register(self, self.process_group, all_reduce)

    def register_comm_hook(self: Any, state: Any, hook: Any) -> None:
        warnings.warn(f"msrun dry run: DDP runs its all-reduce as msrun's comm hook; {hook!r} is not run", stacklevel=2)

    DDP.__init__, DDP.register_comm_hook = __init__, register_comm_hook


def _available(torch: Any, kind: str) -> bool:
    """Whether this machine has a device of ``kind`` (cpu and meta always)."""
    if kind in ("cpu", "meta"):
        return True
    module = getattr(torch, kind, None)
    try:
        return bool(module is not None and module.is_available())
    except Exception:  # noqa: BLE001 - a backend that cannot even say: not here
        return False


# ------------------------------------------------------------------------------------ the record
def _local_bytes(tensor: Any) -> int:
    """Bytes of this rank's part of ``tensor`` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _mesh(params: list[Any]) -> dict[str, Any] | None:
    """This rank's place in the largest mesh its parameters are placed on (dims, shape, coordinate)."""
    meshes = [m for m in (getattr(p, "device_mesh", None) for p in params) if m is not None]
    if not meshes:
        return None
    mesh = max(meshes, key=lambda m: m.ndim)
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    return {"dims": names, "shape": list(mesh.shape), "coordinate": list(mesh.get_coordinate() or [])}


def _optimizer_bytes(optimizer: Any) -> int:
    """Bytes of ``optimizer``'s state for this rank's shards: what it holds, or - before its first
    step - what a step of the same optimizer over ``meta`` copies of the shards creates."""
    import torch

    def state_bytes(state: Any) -> int:
        return sum(_local_bytes(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))

    if optimizer.state:
        return state_bytes(optimizer.state)
    groups = []
    for group in optimizer.param_groups:
        shadows = []
        for p in group["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p
            shadow = torch.empty(local.shape, dtype=local.dtype, device="meta", requires_grad=True)
            shadow.grad = torch.empty_like(shadow)
            shadows.append(shadow)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": shadows})
    import collections
    import copy

    shadow_opt = copy.copy(optimizer)  # the same optimizer, its steps applied to the copies only
    shadow_opt.state, shadow_opt.param_groups = collections.defaultdict(dict), groups
    shadow_opt.step()
    return state_bytes(shadow_opt.state)


def _write(update: dict[str, Any]) -> dict[str, Any]:
    """Add ``update`` to this rank's record; the record."""
    path = os.environ.get(RECORD_ENV, "")
    record: dict[str, Any] = {"rank": _env_int("RANK_ID", "RANK")}
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    record.update(update)
    if path:
        from pytest_msrun.fileio import write_whole

        write_whole(path, json.dumps(record))
    return record


def account(model: Any, optimizer: Any = None) -> dict[str, Any]:
    """What this rank holds of ``model`` (and ``optimizer``): bytes of parameters, of gradients
    (as held, else as backward makes them: one per parameter that requires one, sharded alike) and
    of optimizer state; its mesh coordinate. Recorded; :class:`OverBudget` past the budget."""
    params = list(model.parameters())
    held = {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad if p.grad is not None else p) for p in params if p.requires_grad),
        "optimizer": 0 if optimizer is None else _optimizer_bytes(optimizer),
    }
    mesh = _mesh(params)
    record = _write({**held, **({"mesh": mesh} if mesh else {})})
    total, budget = sum(held.values()), _env_int(BUDGET_ENV)
    if budget > 0 and total > budget:
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in held.items())
        where = f" at {tuple(mesh['coordinate'])} of mesh {tuple(mesh['dims'])}" if mesh else ""
        raise OverBudget(
            f"rank {record['rank']}{where} holds {format_size(total)} > budget {format_size(budget)} "
            f"(--sim_budget / sim_budget=): {parts}"
        )
    return record


def _op_name(op: Any) -> str:
    """A collective's name as people say it: ``c10d._allgather_base_`` -> ``all_gather``."""
    name = str(op).rsplit(".", 1)[-1].strip("_").replace("_base", "").replace("_tensor", "")
    for short, full in (("allgather", "all_gather"), ("allreduce", "all_reduce"), ("alltoall", "all_to_all")):
        name = name.replace(short, full)
    return name


def collectives(step: Callable[[], Any]) -> dict[str, list[int]]:
    """Run ``step`` (one training step, say) and record the collectives this rank issued:
    ``{name: [count, bytes this rank put in]}`` (a collective's arguments but its outputs).
    Returns that."""
    import torch

    try:
        from torch.distributed.tensor.debug import CommDebugMode, _comm_mode
    except ModuleNotFoundError as exc:  # its package imports numpy, which torch does not require
        raise ModuleNotFoundError(
            f"pytest_msrun.dryrun.collectives counts with torch's CommDebugMode, whose package imports "
            f"{exc.name}: pip install {exc.name}",
            name=exc.name,
        ) from exc
    from torch.utils._pytree import tree_flatten

    counts: dict[str, list[int]] = {}

    class Counting(CommDebugMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and (packet in self.comm_registry or packet in _comm_mode.c10d_collective_ops):
                schema = [a.name for a in func._schema.arguments]
                given = [*zip(schema, args), *(kwargs or {}).items()]
                sent = [v for n, v in given if "output" not in n]  # what this rank puts in
                entry = counts.setdefault(_op_name(_comm_mode.NATIVE_TO_PY_MAPPING.get(packet, packet)), [0, 0])
                entry[0] += 1
                entry[1] += sum(_local_bytes(t) for t in tree_flatten(sent)[0] if isinstance(t, torch.Tensor))
            return out

    with Counting():
        step()
    _write({"collectives": counts})
    return counts
