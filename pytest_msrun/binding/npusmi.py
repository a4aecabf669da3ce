"""Ascend NPUs from ``npu-smi``: the device table (``info -m``) and each chip's PCIe bus (``info -t board``).

Parsing follows MindSpore msrun's rules with its crash paths turned into errors that say
what was wrong: the first non-empty line is the header, columns are separated by two or more
spaces, ``mcu`` and nameless rows are skipped, and the device id column is the first of
``chip_logic_id``, ``npu_id``, ``chip_phy_id`` that is present and unique in every row.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from pytest_msrun.record import record

COLUMN_NAMES = {
    "npu id": "npu_id",
    "slot id": "slot_id",
    "chip id": "chip_id",
    "chip logic id": "chip_logic_id",
    "chip phy-id": "chip_phy_id",
    "chip name": "chip_name",
}
ID_COLUMNS = ("chip_logic_id", "npu_id", "chip_phy_id")


class NpuSmiError(RuntimeError):
    """npu-smi output could not be understood."""


@record
class NpuChip:
    device_id: int
    npu_id: int
    chip_id: int
    name: str
    slot_id: str = ""
    has_logic_id: bool = False

    def board_args(self) -> list[str]:
        args = ["info", "-t", "board", "-i", str(self.npu_id)]
        if not self.slot_id or self.has_logic_id:
            args += ["-c", str(self.chip_id)]
        return args


def parse_device_table(text: str) -> list[NpuChip]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise NpuSmiError("'npu-smi info -m' printed nothing")
    header = [COLUMN_NAMES.get(c.strip().lower(), c.strip().lower()) for c in re.split(r"\s{2,}", lines[0].strip())]
    for need in ("npu_id", "chip_id", "chip_name"):
        if need not in header:
            raise NpuSmiError(f"'npu-smi info -m' has no {need!r} column (header: {lines[0].strip()!r})")
    rows = []
    for line in lines[1:]:
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) != len(header):
            raise NpuSmiError(
                f"'npu-smi info -m' row {line.strip()!r} has {len(cols)} columns, header has {len(header)}"
            )
        row = dict(zip(header, cols))
        name = row.get("chip_name", "").strip()
        if not name or name.lower() == "mcu":
            continue
        rows.append(row)
    numbers = {col: [r.get(col, "") for r in rows] for col in ID_COLUMNS if col in header}
    id_col = next((c for c, v in numbers.items() if all(x.isdigit() for x in v) and len(set(v)) == len(v)), None)
    if id_col is None:
        raise NpuSmiError("'npu-smi info -m' has no column that numbers every chip uniquely")
    return [
        NpuChip(
            device_id=int(r[id_col]),
            npu_id=int(r["npu_id"]),
            chip_id=int(r["chip_id"]),
            name=r["chip_name"].strip(),
            slot_id=r.get("slot_id", ""),
            has_logic_id="chip_logic_id" in header,
        )
        for r in rows
    ]


def parse_board_pcie(text: str) -> str:
    """The ``PCIe Bus Info`` value of ``npu-smi info -t board`` (lower-case bus id)."""
    for line in text.splitlines():
        squeezed = "".join(line.split())
        if squeezed.lower().startswith("pciebusinfo"):
            rest = squeezed[len("PCIeBusInfo") :]
            return rest[1:].lower() if rest[:1] in (":", "=") else rest.lower()
    raise NpuSmiError("'npu-smi info -t board' printed no 'PCIe Bus Info' line")


def run_npu_smi(args: list[str], timeout: float = 10.0) -> str:
    exe = shutil.which("npu-smi")
    if exe is None:
        raise NpuSmiError("npu-smi is not installed")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise NpuSmiError(f"'npu-smi {' '.join(args)}' failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout
