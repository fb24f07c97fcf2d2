"""Pool specifications: the dicts a YAML config or ``ResourceManager({...})`` holds (RollArt paper §5.1, §6).

A pool is one hardware group ``{"hardware": "H800", "devices": 2}``, a list of groups for a mixed
pool, or CPUs ``{"hardware": "CPU", "cpus": 8}``. Errors name the pool and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CPU = "CPU"


class ResourceSpecError(ValueError):
    """A pool specification or placement request that cannot be satisfied; raised before any actor."""


class HardwareGroup(BaseModel):
    """One hardware type inside a pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hardware: str = Field(min_length=1, description='hardware type, e.g. "H800", "H20", or "CPU"')
    devices: int | None = Field(default=None, ge=1, description="GPUs (or logical device slots) of this type")
    cpus: int | None = Field(default=None, ge=1, description="CPUs, for a CPU pool")

    @model_validator(mode="after")
    def _check_kind(self) -> HardwareGroup:
        if self.hardware == CPU:
            if self.devices is not None:
                raise ValueError('a CPU group takes "cpus", not "devices": {"hardware": "CPU", "cpus": 8}')
            if self.cpus is None:
                raise ValueError('a CPU group needs "cpus": {"hardware": "CPU", "cpus": 8}')
        else:
            if self.devices is None:
                raise ValueError(
                    f'hardware {self.hardware!r} needs "devices": {{"hardware": "{self.hardware}", "devices": 2}}'
                )
            if self.cpus is not None:
                raise ValueError('"cpus" is only for {"hardware": "CPU"} groups; give devices for accelerators')
        return self

    @property
    def amount(self) -> int:
        """Devices of an accelerator group, CPUs of a CPU group: the number of one-unit bundles."""
        return int(self.cpus if self.hardware == CPU else self.devices)  # type: ignore[arg-type]


class PoolSpec(BaseModel):
    """A named pool: one or more hardware groups, in the order given."""

    model_config = ConfigDict(frozen=True)

    name: str
    groups: tuple[HardwareGroup, ...]

    @property
    def hardware_types(self) -> list[str]:
        return [g.hardware for g in self.groups]


def parse_pools(pools: Mapping[str, Any]) -> dict[str, PoolSpec]:
    """Validate the pool dict; errors read ``pools.rollout[1].devices: <what is wrong and the fix>``."""
    if not isinstance(pools, Mapping) or not pools:
        raise ResourceSpecError('pools must be a non-empty dict such as {"train": {"hardware": "H800", "devices": 2}}')
    out: dict[str, PoolSpec] = {}
    for name, raw in pools.items():
        if not isinstance(name, str) or not name:
            raise ResourceSpecError(f"pool name {name!r} must be a non-empty string")
        items = raw if isinstance(raw, list) else [raw]
        if not items:
            raise ResourceSpecError(f"pools.{name}: an empty list; give at least one hardware group")
        groups = []
        for i, item in enumerate(items):
            where = f"pools.{name}[{i}]" if isinstance(raw, list) else f"pools.{name}"
            if not isinstance(item, Mapping):
                raise ResourceSpecError(
                    f'{where}: expected a dict like {{"hardware": "H20", "devices": 4}}, got {item!r}'
                )
            try:
                groups.append(HardwareGroup.model_validate(dict(item)))
            except ValidationError as err:
                first = err.errors()[0]
                field = ".".join(str(p) for p in first["loc"])
                msg = first["msg"].removeprefix("Value error, ")
                raise ResourceSpecError(f"{where}{'.' + field if field else ''}: {msg}") from None
        hw = [g.hardware for g in groups]
        if len(set(hw)) != len(hw):
            raise ResourceSpecError(f"pools.{name}: hardware type listed twice ({hw}); merge the groups")
        out[name] = PoolSpec(name=name, groups=tuple(groups))
    return out
