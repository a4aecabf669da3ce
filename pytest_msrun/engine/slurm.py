"""msrun inside a Slurm step: the flags a user did not give, taken from the step.

``srun -N2 --ntasks-per-node=1 msrun --local_worker_num=2 task.py`` starts one msrun per node.
Each reads the step's variables (``SLURM_NODEID``, ``SLURM_STEP_NUM_NODES``,
``SLURM_STEP_NODELIST``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``) and fills in, for flags absent from
its command line: ``--node_rank`` (the node's index in the step), ``--worker_num`` (nodes ×
``--local_worker_num``; or ``--local_worker_num`` from a given ``--worker_num``), ``--master_addr``
(the step's first host) and ``--master_port`` (the same on every node, from the job and step ids).
Flags given on the command line always win. ``MSRUN_SLURM=0`` turns this off.

Only an ``srun`` step counts (``SLURM_STEP_ID`` set and not the batch script's): ``msrun`` typed in
an ``salloc`` shell or an ``sbatch`` script runs on that one node, as it would outside Slurm.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from pytest_msrun.record import record

SWITCH_ENV = "MSRUN_SLURM"
PORT_BASE = 10000  # derived ports fall in 10000..29999: below Linux's ephemeral range (32768-60999)
PORT_SPAN = 20000
BATCH_STEPS = ("batch", "extern", "interactive", "4294967294", "4294967293", "4294967291")


class HostlistError(ValueError):
    """A node list that is not Slurm hostlist syntax."""


def expand_hostlist(text: str) -> list[str]:
    """``gpu[01-04,07],login2`` -> ``gpu01 gpu02 gpu03 gpu04 gpu07 login2`` (Slurm's hostlist
    syntax: comma-separated names, each with any number of bracketed ranges; zero padding kept)."""
    return [host for item in _split_top(text.strip()) if item for host in _expand_one(item)]


def _split_top(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in {text!r}")
    items.append(text[start:].strip())
    return items


def _expand_one(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise HostlistError(f"unbalanced ']' in {item!r}")
        return [item]
    close_at = item.index("]", open_at)
    head, body, tail = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    rest = _expand_one(tail) if tail else [""]
    out: list[str] = []
    for part in body.split(","):
        for value in _expand_range(part.strip(), item):
            out.extend(head + value + r for r in rest)
    return out


def _expand_range(part: str, item: str) -> list[str]:
    low, sep, high = part.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise HostlistError(f"{part!r} in {item!r} is not a number or a range such as 01-04")
    if not sep:
        return [low]
    first, last = int(low), int(high)
    if last < first:
        raise HostlistError(f"range {part!r} in {item!r} runs backwards")
    if last - first >= 1 << 20:
        raise HostlistError(f"range {part!r} in {item!r} is larger than any cluster")
    width = len(low) if low.startswith("0") or len(low) == len(high) else 0
    return [str(n).zfill(width) for n in range(first, last + 1)]


def tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (``SLURM_STEP_TASKS_PER_NODE``)."""
    counts: list[int] = []
    for count, _, repeat in (item.strip().partition("(x") for item in text.split(",") if item.strip()):
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


@record
class SlurmStep:
    """The parts of an ``srun`` step msrun uses."""

    job_id: str
    step_id: str
    node_id: int
    nodes: list[str]  # the step's hosts, in node-id order
    tasks: list[int]  # tasks on each node of the step

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def master_port(self) -> int:
        """The port every node of this step derives alike (the job and step ids, hashed)."""
        return PORT_BASE + zlib.crc32(f"msrun-slurm-{self.job_id}.{self.step_id}".encode()) % PORT_SPAN


def _ids(env: Mapping[str, str]) -> tuple[str, str]:
    """(job id, step id) as Slurm exports them; both "" with ``MSRUN_SLURM=0``."""
    if env.get(SWITCH_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return "", ""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    return job_id, env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The ``srun`` step this process runs in, or ``None`` (outside Slurm, in a batch script or an
    ``salloc`` shell, or with ``MSRUN_SLURM=0``). Malformed variables raise ``ValueError``."""
    job_id, step_id = _ids(env)
    if not job_id or not step_id or step_id in BATCH_STEPS:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = expand_hostlist(nodelist)
    if not nodes:
        raise ValueError("SLURM_STEP_NODELIST is empty")
    node_id = int(env.get("SLURM_NODEID", "0"))
    if not 0 <= node_id < len(nodes):
        raise ValueError(f"SLURM_NODEID={node_id} is outside the step's {len(nodes)} nodes")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    tasks = tasks_per_node(per_node) if per_node else [1] * len(nodes)
    return SlurmStep(job_id=job_id, step_id=step_id, node_id=node_id, nodes=nodes, tasks=tasks)


@record
class Inferred:
    """What msrun took from the step: ``flags`` (flag -> value, in command-line order)."""

    step: SlurmStep
    flags: dict[str, object]

    def line(self) -> str:
        taken = " ".join(f"--{k}={v}" for k, v in self.flags.items()) or "nothing (every flag was given)"
        return (
            f"Slurm job {self.step.job_id} step {self.step.step_id}, node {self.step.node_id} of "
            f"{self.step.num_nodes} ({', '.join(self.step.nodes[:8])}{', ...' if self.step.num_nodes > 8 else ''}): "
            f"inferred {taken}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "job_id": self.step.job_id,
            "step_id": self.step.step_id,
            "node_id": self.step.node_id,
            "nodes": list(self.step.nodes),
            "inferred": dict(self.flags),
        }


@record
class Allocation:
    """A Slurm allocation this process runs in but not as a step's task (an ``salloc`` shell, an
    ``sbatch`` script): where each marked test's job runs as a step of its own, placed by Slurm."""

    job_id: str
    nodes: list[str]
    cpus: tuple[int, ...] = ()  # each node's CPUs in the allocation (unknown: empty)
    gpus: int = 0  # GPUs on each node of the allocation, which Slurm hands to steps (0: none it manages)
    mem_per_cpu: int = 0  # MB of the allocation's memory per CPU where Slurm tracks memory (0: it does not)

    def gpus_per_node(self, devices: int, nodes: int) -> int:
        """The GPUs a step of ``nodes`` nodes asks on each for a job of ``devices`` devices."""
        return -(-devices // max(1, nodes))  # rounded up

    def cpus_for(self, ranks_per_node: int) -> int:
        """The CPUs a step asks on each node for ``ranks_per_node`` ranks: one per rank, at most
        what the allocation holds on a node (a step can never have more)."""
        most = min(self.cpus) if self.cpus else ranks_per_node
        return max(1, min(ranks_per_node, most))

    def srun(self, nodes: int, ranks_per_node: int, label: str = "", devices: int = 0) -> list[str]:
        """``srun`` running one msrun on each of ``nodes`` nodes that Slurm picks where the step's
        CPUs (and ``devices`` GPUs in all) are free now (``--exact``: only those; the step waits
        while none are), ending the step when any node's msrun fails (``--kill-on-bad-exit``).
        Slurm makes the step's GPUs visible (``CUDA_VISIBLE_DEVICES``)."""
        argv = [
            "srun",
            f"--nodes={nodes}",
            f"--ntasks={nodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={self.cpus_for(ranks_per_node)}",
            "--exact",
            "--kill-on-bad-exit=1",
            "--export=ALL",
        ]
        if devices and self.gpus:
            argv.append(f"--gpus-per-node={self.gpus_per_node(devices, nodes)}")
        if self.mem_per_cpu:  # its CPUs' share: a step given no memory would hold all of a node's
            argv.append(f"--mem-per-cpu={self.mem_per_cpu}M")
        if label:
            argv.append(f"--job-name={label}")
        return argv


def allocation(env: Mapping[str, str]) -> Allocation | None:
    """The allocation this process can start steps in, or ``None`` (outside Slurm, inside a step's
    task, or with ``MSRUN_SLURM=0``)."""
    job_id, step_id = _ids(env)
    if not job_id or (step_id and step_id not in BATCH_STEPS):
        return None
    try:
        nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    except HostlistError:
        return None
    if not nodes:
        return None
    try:
        cpus = tasks_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""))
    except ValueError:
        cpus = []
    if len(cpus) != len(nodes):
        cpus = []
    return Allocation(
        job_id=job_id, nodes=nodes, cpus=tuple(cpus), gpus=_gpus(env), mem_per_cpu=_mem_per_cpu(env, cpus)
    )


def _mem_per_cpu(env: Mapping[str, str], cpus: list[int]) -> int:
    """MB per CPU of the allocation (``--mem-per-cpu``, or ``--mem`` over a node's CPUs): 0 where
    Slurm does not track memory."""
    per_cpu = env.get("SLURM_MEM_PER_CPU", "")
    if per_cpu.isdigit() and int(per_cpu) > 0:
        return int(per_cpu)
    per_node = env.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0 and cpus:
        return max(1, int(per_node) // max(cpus))
    return 0


def _gpus(env: Mapping[str, str]) -> int:
    """GPUs per node that the allocation holds (``--gpus-per-node``, ``--gres=gpu:N``): 0 if none."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(name, "").rpartition(":")[2]  # "4" or "a100:4"
        if value.isdigit():
            return int(value)
    return sum(1 for i in env.get("SLURM_JOB_GPUS", "").split(",") if i.strip())
