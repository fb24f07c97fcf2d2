"""Test helpers that are part of the project: namespace hosts for multi-host Ray clusters on one machine."""

from rollart.testing.hosts import (
    DriverResult,
    Host,
    HostCluster,
    HostsError,
    HostSpec,
    skip_reason,
    start_hosts,
    three_hosts,
)

__all__ = ["DriverResult", "Host", "HostCluster", "HostSpec", "HostsError", "skip_reason", "start_hosts", "three_hosts"]
