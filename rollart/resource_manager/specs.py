"""Pool specifications: the dicts a YAML config or ``ResourceManager({...})`` holds (RollArt paper §5.1, §6).

A pool is one hardware group ``{"hardware": "H800", "devices": 2}``, a list of groups for a mixed
pool, or CPUs ``{"hardware": "CPU", "cpus": 8}``; or ``{"colocate_with": "train"}``: a second name for
another pool's devices (colocated mode: nothing more is reserved, a Cluster on it shares that pool's
bundles). Errors name the pool and the field.

A group with ``max_devices`` is elastic (``{"hardware": "H20", "devices": 2, "max_devices": 8}``): it starts
with ``devices`` (0 allowed: it waits for such hardware to appear) and grows while the job runs as
matching devices come free, up to ``max_devices``; it shrinks when asked (``rollart scale``) or when a
node of it is marked for removal (:mod:`rollart.rollout.elastic`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollart.config_model import ConfigModel, type_problem

CPU = "CPU"


class ResourceSpecError(ValueError):
    """A pool specification or placement request that cannot be satisfied; raised before any actor."""


class HardwareGroup(ConfigModel):
    """One hardware type inside a pool."""

    model_config = ConfigDict(frozen=True)

    hardware: str = Field(min_length=1, description='hardware type, e.g. "H800", "H20", or "CPU"')
    devices: int | None = Field(
        default=None, ge=0, description="GPUs (or logical device slots) of this type; at start for an elastic group"
    )
    cpus: int | None = Field(default=None, ge=1, description="CPUs, for a CPU pool")
    max_devices: int | None = Field(
        default=None,
        ge=1,
        description="makes the group elastic: it grows up to this many devices as matching ones come free",
    )

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
        if self.max_devices is not None:
            if self.hardware == CPU:
                raise ValueError('"max_devices" is for accelerator groups; a CPU group has a fixed "cpus"')
            if self.max_devices < (self.devices or 0):
                raise ValueError(
                    f'"max_devices" ({self.max_devices}) is below "devices" ({self.devices}); '
                    f"set max_devices >= devices"
                )
        elif self.devices == 0:
            raise ValueError(
                f'"devices": 0 needs "max_devices" (an elastic group that waits for {self.hardware} to appear); '
                "give devices >= 1, or add max_devices"
            )
        return self

    @property
    def elastic(self) -> bool:
        """Whether the group grows and shrinks while the job runs (``max_devices`` is set)."""
        return self.max_devices is not None

    @property
    def amount(self) -> int:
        """Devices of an accelerator group, CPUs of a CPU group: the number of one-unit bundles."""
        return int(self.cpus if self.hardware == CPU else self.devices)  # type: ignore[arg-type]


class PoolSpec(BaseModel):
    """A named pool: one or more hardware groups, in the order given. A colocated pool
    (``colocate_with``) has the groups of the pool whose devices it shares and reserves nothing itself."""

    model_config = ConfigDict(frozen=True)

    name: str
    groups: tuple[HardwareGroup, ...]
    colocate_with: str | None = None

    @property
    def hardware_types(self) -> list[str]:
        return [g.hardware for g in self.groups]

    @property
    def elastic(self) -> bool:
        """Whether a group of the pool is elastic (has ``max_devices``)."""
        return any(g.elastic for g in self.groups)


COLOCATE_WITH = "colocate_with"


def colocation_target(name: str, raw: Any) -> str | None:
    """The pool ``raw`` (the spec of pool ``name``) shares devices with, or None for a pool of its own.
    ``colocate_with`` goes alone, in a mapping: ``{"colocate_with": "train"}``."""
    items = raw if isinstance(raw, list) else [raw]
    if not any(isinstance(i, Mapping) and COLOCATE_WITH in i for i in items):
        return None
    if isinstance(raw, list):
        raise ResourceSpecError(
            f"pools.{name}: colocate_with shares another pool's devices and goes alone, not in a list of "
            'groups: {"colocate_with": "train"}'
        )
    extra = sorted(k for k in raw if k != COLOCATE_WITH)
    if extra:
        raise ResourceSpecError(
            f"pools.{name}: colocate_with shares the devices of pool {raw[COLOCATE_WITH]!r}, so {extra} cannot be "
            f"given with it; drop {extra}, or drop colocate_with to give {name!r} devices of its own"
        )
    target = raw[COLOCATE_WITH]
    if not isinstance(target, str) or not target:
        raise ResourceSpecError(f"pools.{name}.colocate_with: the name of another pool (e.g. train), got {target!r}")
    return target


def parse_pools(pools: Mapping[str, Any]) -> dict[str, PoolSpec]:
    """Validate the pool dict; errors read ``pools.rollout[1].devices: <what is wrong and the fix>``."""
    if not isinstance(pools, Mapping) or not pools:
        raise ResourceSpecError('pools must be a non-empty dict such as {"train": {"hardware": "H800", "devices": 2}}')
    out: dict[str, PoolSpec] = {}
    colocated: dict[str, str] = {}
    for name, raw in pools.items():
        if not isinstance(name, str) or not name:
            raise ResourceSpecError(f"pool name {name!r} must be a non-empty string")
        target = colocation_target(name, raw)
        if target is not None:
            colocated[name] = target
            continue
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
                msg = type_problem(first) or first["msg"].removeprefix("Value error, ")
                raise ResourceSpecError(f"{where}{'.' + field if field else ''}: {msg}") from None
        hw = [g.hardware for g in groups]
        if len(set(hw)) != len(hw):
            raise ResourceSpecError(f"pools.{name}: hardware type listed twice ({hw}); merge the groups")
        out[name] = PoolSpec(name=name, groups=tuple(groups))
    for name, target in colocated.items():
        if target == name:
            raise ResourceSpecError(
                f"pools.{name}.colocate_with: {name!r} names this pool itself; name the pool whose devices it "
                "shares (e.g. colocate_with: train)"
            )
        if target in colocated:
            raise ResourceSpecError(
                f"pools.{name}.colocate_with: pool {target!r} has no devices of its own (it colocates with "
                f"{colocated[target]!r}); name {colocated[target]!r}"
            )
        if target not in out:
            raise ResourceSpecError(f"pools.{name}.colocate_with: {target!r} is not a pool; name one of {sorted(out)}")
        out[name] = PoolSpec(name=name, groups=out[target].groups, colocate_with=target)
    return {name: out[name] for name in pools}  # the order given
