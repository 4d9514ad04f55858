"""The devices an engine owns (its *device group*), and how a placement maps onto them.

An engine owns one device or several (config `engine_devices`: one engine per GPU, one per
node, or explicit sets). The group answers what the engine's single device used to answer, as
sums (`info`, `used_by`: what a status line or a one-device plan reads), and per device what a
placement needs: each device's room (`infos`), what each child holds on each device
(`used_by_device`), the environment that puts a child on a placement's devices
(`child_env`), and the stand-in claims filed for a child that does not claim itself, per device
of its placement (`on_spawn`).

Device indexes are the physical ones (nvidia-smi's, or the simulated device's), so a
placement's devices become its children's CUDA_VISIBLE_DEVICES as they are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from modelyard.config import Settings
from modelyard.engine.ledger import Device, HostDevice, SimulatedDevice, simulated_device
from modelyard.hw.simulated import CLAIM_SPLIT_ENV, CLAIMS_DIR_ENV, parse_simulated_gpus
from modelyard.placement.devices import DeviceRoom, Placement
from modelyard.placement.groups import device_groups
from modelyard.types import DeviceInfo

log = logging.getLogger("modelyard.engine.devices")

__all__ = ["DeviceGroup", "engine_group", "make_device"]


class DeviceGroup:
    """One engine's devices, by physical index, in the group's order."""

    def __init__(self, members: Sequence[tuple[int, Device]]) -> None:
        if not members:
            raise ValueError("a device group needs a device")
        self.members: dict[int, Device] = dict(members)
        self.kind = members[0][1].kind

    @classmethod
    def of(cls, device: Device) -> DeviceGroup:
        """A group of one (the CPU engine's host, one GPU, a test's device)."""
        if isinstance(device, DeviceGroup):
            return device
        return cls([(int(getattr(device, "index", 0)), device)])

    @property
    def indexes(self) -> tuple[int, ...]:
        return tuple(self.members)

    @property
    def first(self) -> Device:
        return next(iter(self.members.values()))

    # ---- the sums: the Device protocol --------------------------------------------------

    def info(self) -> DeviceInfo:
        """The group as one device (its totals); one member: that member's own reading."""
        infos = self.infos()
        if len(infos) == 1:
            return infos[0]
        first = infos[0]

        def total(values: Iterable[int | None]) -> int | None:
            found = list(values)
            return None if any(v is None for v in found) else sum(v or 0 for v in found)

        temps = [i.temperature_c for i in infos if i.temperature_c is not None]
        utils = [i.utilization_pct for i in infos if i.utilization_pct is not None]
        return DeviceInfo(
            index=first.index,
            uuid=None,
            name=" + ".join(i.name for i in infos),
            total_bytes=sum(i.total_bytes for i in infos),
            used_bytes=total(i.used_bytes for i in infos),
            free_bytes=total(i.free_bytes for i in infos),
            utilization_pct=round(sum(utils) / len(utils)) if utils else None,
            temperature_c=max(temps) if temps else None,  # the hottest decides a pause
            kind=first.kind,
        )

    def infos(self) -> list[DeviceInfo]:
        """Each device's reading, its `index` the physical one."""
        out = []
        for index, device in self.members.items():
            info = device.info()
            if info.index != index:
                info = DeviceInfo(index, info.uuid, info.name, info.total_bytes, info.used_bytes,
                                  info.free_bytes, info.utilization_pct, info.temperature_c,
                                  info.kind)
            out.append(info)
        return out

    def rooms(self, held: Mapping[int, int] | None = None) -> list[DeviceRoom]:
        """Each device as a plan sees it: free less `held` (bytes promised to loads that the
        device does not show yet, by device index)."""
        held = held or {}
        return [DeviceRoom(i.index, max(0, (i.free_bytes or 0) - held.get(i.index, 0)),
                           i.total_bytes) for i in self.infos()]

    def used_by(self, pids: Iterable[int]) -> dict[int, int]:
        """Bytes each pid holds over all the group's devices."""
        out: dict[int, int] = {}
        for per_device in self.used_by_device(pids).values():
            for pid, n in per_device.items():
                out[pid] = out.get(pid, 0) + n
        return out

    def used_by_device(self, pids: Iterable[int]) -> dict[int, dict[int, int]]:
        """{device index: {pid: bytes}}: what each pid holds on each device."""
        wanted = list(pids)
        return {index: device.used_by(wanted) for index, device in self.members.items()}

    # ---- a placement's devices ----------------------------------------------------------

    def child_env(self, placement: Placement | None = None) -> dict[str, str]:
        """The environment that puts a child on `placement`'s devices (None: the group's
        first device, what a one-device engine always did; a placement with no device: the
        CPU, every GPU hidden and no simulated device to claim on)."""
        if placement is not None and not placement.device_bytes:
            return {"CUDA_VISIBLE_DEVICES": "", CLAIMS_DIR_ENV: "", CLAIM_SPLIT_ENV: ""}
        devices = [d for d in (placement.devices if placement else ()) if d in self.members]
        if not devices:
            return self.first.child_env()
        sims = [self.members[d] for d in devices]
        if all(isinstance(s, SimulatedDevice) for s in sims):
            assert placement is not None
            env = {
                CLAIMS_DIR_ENV: os.pathsep.join(
                    str(s.gpu.claims_dir) for s in sims if isinstance(s, SimulatedDevice)),
                "CUDA_VISIBLE_DEVICES": "",  # no real GPU for a simulated one's child
            }
            if len(devices) > 1 or placement.host_bytes > 0:
                env[CLAIM_SPLIT_ENV] = ",".join(
                    [str(placement.on(d)) for d in devices]
                    + ([str(placement.host_bytes)] if placement.host_bytes > 0 else []))
            return env
        if self.kind == "cpu":
            return self.first.child_env()
        # Physical indexes, in the placement's order (llama-server's --tensor-split order);
        # PCI bus order makes CUDA number GPUs as nvidia-smi and NVML do.
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices),
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def on_spawn(self, pid: int, reserved_bytes: int,
                 placement: Placement | None = None) -> None:
        """A child was started: stand-in claims per device of its placement (its own win);
        none for a placement on the CPU (no device)."""
        if placement is not None and not placement.device_bytes:
            return
        if placement is None:
            self.first.on_spawn(pid, reserved_bytes)
            return
        for index, nbytes in placement.device_bytes:
            device = self.members.get(index)
            if device is not None:
                device.on_spawn(pid, nbytes)

    async def wait_for_recovery(
        self,
        gone_pids: set[int],
        want_free: Mapping[int, int],
        timeout_s: float,
        *,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> bool:
        """Wait until no device counts `gone_pids` and each device in `want_free` reports at
        least that free: a victim spanning several devices frees each of them. Bounded."""
        deadline = clock() + timeout_s
        while True:
            infos = {i.index: i for i in self.infos()}
            holding = {pid for per in self.used_by_device(gone_pids).values() for pid in per}
            short = {d: (infos[d].free_bytes or 0, want) for d, want in want_free.items()
                     if d in infos and infos[d].free_bytes is not None
                     and (infos[d].free_bytes or 0) < want}
            if not holding and not short:
                return True
            if clock() >= deadline:
                log.warning("memory not back after %.0f s: devices short (free, wanted) %s; "
                            "pids still holding: %s", timeout_s, short, sorted(holding))
                return False
            await asyncio.sleep(poll_s)  # a driver frees memory without an event


def engine_group(settings: Settings, index: int) -> list[int]:
    """The device indexes engine `index` owns (config `engine_devices`, over the simulated
    GPUs or the GPUs the engine's CUDA_VISIBLE_DEVICES names)."""
    if settings.simulate_gpus:
        count = len(parse_simulated_gpus(settings.simulate_gpus))
        groups = device_groups(settings.engine_devices, list(range(count)))
        return groups[min(index, len(groups) - 1)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ""
    return [int(x) for x in visible.split(",") if x.strip().isdigit()]


def make_device(
    settings: Settings, index: int, children: Callable[[], Iterable[int]]
) -> DeviceGroup:
    """The devices engine `index` owns: simulated ones, the GPUs its CUDA_VISIBLE_DEVICES
    names, or host RAM for the CPU engine."""
    if settings.simulate_gpus:
        sizes = parse_simulated_gpus(settings.simulate_gpus)
        return DeviceGroup([(i, simulated_device(i, sizes[i], settings.home))
                            for i in engine_group(settings, index)])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    host = DeviceGroup.of(HostDevice(settings.host_ram_cap_bytes, children))
    if settings.devices == "cpu" or visible == "":
        return host
    from modelyard.hw.gpu_probe import gpu_devices_for

    gpus = gpu_devices_for(visible)
    return DeviceGroup(gpus) if gpus else host
