"""SM clock and board power while a benchmark level runs, sampled by nvidia-smi beside it.

Held compute runs an H200 into its 700 W power cap, which lowers its SM clock (1980 MHz to ~1450
under the prompts' GEMMs, docs/performance.md), so a level's distance from its matmul roofline is
partly the board's. Without nvidia-smi or a CUDA device nothing is sampled.

    with PowerSampler(devices=1) as power:
        ...  # the measured work
    print(power.summary.line() if power.summary else "not sampled")
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

# NVML's clock event reasons that mean "held down by power": the software power cap and the
# hardware power brake.
POWER_CAP_REASONS = 0x4 | 0x80


@dataclass
class PowerSummary:
    samples: int
    clock_mhz: float  # median SM clock
    power_w: float  # median board power
    capped_share: float  # share of samples whose clock the power cap held down

    def line(self) -> str:
        return (
            f"GPU while it ran: SM clock median {self.clock_mhz:.0f} MHz, board power median "
            f"{self.power_w:.0f} W, at its power cap in {self.capped_share:.0%} of "
            f"{self.samples} samples"
        )


def summarize(lines: Iterable[str]) -> PowerSummary | None:
    """Lines of `nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active
    --format=csv,noheader,nounits` (any number of GPUs); lines that do not parse are skipped."""
    rows = []
    for line in lines:
        try:
            clock, power, reasons = (field.strip() for field in line.split(","))
            rows.append((float(clock), float(power), int(reasons, 16)))
        except ValueError:  # a short line, "[N/A]", or the output cut by terminate()
            continue
    if not rows:
        return None
    return PowerSummary(
        samples=len(rows),
        clock_mhz=statistics.median(row[0] for row in rows),
        power_w=statistics.median(row[1] for row in rows),
        capped_share=sum(bool(row[2] & POWER_CAP_REASONS) for row in rows) / len(rows),
    )


class PowerSampler:
    """Samples the first `devices` CUDA devices (as this process numbers them) every `period_ms`
    while the block runs; `summary` is None when nothing was sampled."""

    def __init__(self, devices: int = 1, period_ms: int = 250):
        self.devices, self.period_ms = devices, period_ms
        self.summary: PowerSummary | None = None
        self._process: subprocess.Popen | None = None
        self._output = None

    def __enter__(self) -> PowerSampler:
        ids = gpu_uuids(self.devices)
        if ids:
            # A file, not a pipe: a level of minutes would fill a pipe nobody reads and stall it.
            self._output = tempfile.TemporaryFile("w+")
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--id=" + ",".join(ids),
                    "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                    "--format=csv,noheader,nounits",
                    f"--loop-ms={self.period_ms}",
                ],
                stdout=self._output,
                stderr=subprocess.DEVNULL,
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
            self._output.seek(0)
            self.summary = summarize(self._output.read().splitlines())
            self._output.close()


def gpu_uuids(devices: int) -> list[str]:
    """nvidia-smi's ids of the first `devices` CUDA devices (UUIDs: CUDA_VISIBLE_DEVICES and
    CUDA's device order do not change them); none without nvidia-smi or CUDA."""
    if devices < 1 or shutil.which("nvidia-smi") is None:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    count = min(devices, torch.cuda.device_count())
    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(count)]
