"""The kernel's SysV message limits, which the FastDeploy-style path needs raised.

Kept apart from ``_fastdeploy`` (which needs ``sysv_ipc``), so that a script can read, raise
and put back the limits on a machine without the ``bench`` extra. The settings are system-wide:
nothing raises them unless asked, and whoever raises them puts them back.
"""

from __future__ import annotations

from typing import Any

__all__ = ("raise_msg_limits", "read_msg_limits", "restore_msg_limits")

_MSGMAX = "/proc/sys/kernel/msgmax"
_MSGMNB = "/proc/sys/kernel/msgmnb"


def raise_msg_limits(msgmax: int = 1 << 20, msgmnb: int = 256 << 20) -> dict[str, Any]:
    """Raise kernel.msgmax / kernel.msgmnb (as FastDeploy's FAQ asks); report what happened.

    The report is also what ``restore_msg_limits`` needs to put back what this call changed:
    the settings are system-wide, so whoever raises them restores them when done.
    """
    out: dict[str, Any] = {}
    for path, want in ((_MSGMAX, msgmax), (_MSGMNB, msgmnb)):
        key = path.rsplit("/", 1)[1]
        try:
            with open(path) as f:
                before = int(f.read())
        except OSError as exc:
            out[key] = {"error": f"cannot read {path}: {exc.strerror}"}
            continue
        if before < want:
            try:
                with open(path, "w") as f:
                    f.write(str(want))
            except OSError as exc:
                out[key] = {"value": before, "error": f"cannot raise to {want}: {exc.strerror}"}
                continue
        with open(path) as f:
            out[key] = {"before": before, "value": int(f.read())}
    return out


def restore_msg_limits(report: dict[str, Any]) -> None:
    """Put back the values ``raise_msg_limits`` changed, unless somebody changed them since."""
    for path in (_MSGMAX, _MSGMNB):
        entry = report.get(path.rsplit("/", 1)[1], {})
        if "before" not in entry or entry["before"] == entry["value"]:
            continue
        try:
            with open(path) as f:
                now = int(f.read())
            if now == entry["value"]:
                with open(path, "w") as f:
                    f.write(str(entry["before"]))
        except (OSError, ValueError):
            pass  # reported by nobody: the value stays as whoever changed it left it


def read_msg_limits() -> dict[str, int | None]:
    """kernel.msgmax and kernel.msgmnb as they are now (None where unreadable)."""
    out: dict[str, int | None] = {}
    for path in (_MSGMAX, _MSGMNB):
        try:
            with open(path) as f:
                out[path.rsplit("/", 1)[1]] = int(f.read())
        except (OSError, ValueError):
            out[path.rsplit("/", 1)[1]] = None
    return out
