"""The seccomp filter of every code sandbox: :func:`program` (a BPF program for bubblewrap's ``--seccomp``).

It denies what would give sandboxed code a way around its limits or a large kernel attack surface, and
allows everything else:

- a user namespace of its own (``unshare`` or ``clone`` with ``CLONE_NEWUSER``: ``EPERM``): inside one,
  code would hold every capability over new mount namespaces and mount a tmpfs without the sandbox's
  size limit; ``clone3`` answers ``ENOSYS`` (its flags cannot be read by a filter; the C library then
  falls back to ``clone``, which is checked);
- anonymous files (``memfd_create``, ``memfd_secret``: ``ENOSYS``, so callers fall back): their pages
  are shared memory that neither a mount's size limit nor ``RLIMIT_AS`` sees;
- ``io_uring``, ``bpf``, ``perf_event_open``, ``userfaultfd``, the kernel keyrings (``add_key``,
  ``keyctl``, ``request_key``) and kernel loading (``kexec_*``, ``*_module``): ``EPERM``;
- system calls of another ABI (32-bit x86 or x32 on x86-64): the process is killed.

Built with libseccomp (the C library every Linux distribution has, ``libseccomp2`` on Debian/Ubuntu)
through ``pyseccomp``; where it is missing :func:`program` raises :class:`SeccompUnavailable`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile

CLONE_NEWUSER = 0x10000000

# denied outright (EPERM); names this kernel or libseccomp does not know are skipped
DENIED = (
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "add_key",
    "keyctl",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
)


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its Python binding) is not usable here."""


@functools.cache
def program() -> bytes:
    """The filter as a BPF program (built once per process)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as err:  # pyseccomp raises RuntimeError without libseccomp
        raise SeccompUnavailable(
            f"no seccomp filter ({err}): install libseccomp (Debian/Ubuntu: apt-get install libseccomp2) "
            "and the pyseccomp package"
        ) from None
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    newuser = sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
    flt.add_rule(sc.ERRNO(errno.EPERM), "unshare", newuser)
    flt.add_rule(sc.ERRNO(errno.EPERM), "clone", newuser)  # x86-64 and arm64: the flags are argument 0
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for name in ("memfd_create", "memfd_secret"):  # memory no size limit sees (ENOSYS: callers fall back)
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            flt.add_rule(sc.ERRNO(errno.ENOSYS), name)
    for name in DENIED:
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):  # not a system call of this architecture
            continue
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()


def memfd() -> int:
    """A fresh descriptor holding :func:`program`, at offset 0 (bubblewrap reads it with ``--seccomp``)."""
    data = program()
    fd = os.memfd_create("rollart-sandbox-seccomp")
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
