"""Triton's logging extension (``GET``/``POST /v2/logging``, gRPC
``LogSettings``) over the ``ferrobatch`` logger: one process, one logger,
one set of settings, for every front-end and both protocols.

Triton switches its levels one by one; Python's are a threshold, so here
they nest: INFO is on only while WARNING is, WARNING only while ERROR is,
and ``log_verbose_level`` > 0 (DEBUG; the number is kept and reported)
only while INFO is. An update that would break the nesting is refused
(400), as is any bad setting, before anything changes. ``log_file`` and
``log_format`` are reported (``""``: the process's own handlers, else the
file :func:`to_file` writes, as ``ServeConfig(log_file=)`` asks;
``"default"``) and cannot be changed: Triton refuses a new ``log_file``
over the network too.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator, Mapping

from .protocol import ProtocolError

#: Every setting, in Triton's order.
SETTINGS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
#: The switches, from the lowest level up.
_SWITCHES = (("log_info", logging.INFO), ("log_warning", logging.WARNING), ("log_error", logging.ERROR))
_MAX_VERBOSE = (1 << 32) - 1  # uint32, as gRPC carries it

Setting = bool | int | str

_logger = logging.getLogger("ferrobatch")
_lock = threading.Lock()
#: The verbose level last set here (None: none set; read DEBUG as 1).
_verbose: int | None = None
#: The file the log is written to, as reported ("": the process's own handlers).
_file = ""
#: How each record is written, to that file and by ``ferrobatch serve``.
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def to_file(path: str | None, level: int) -> Iterator[None]:
    """While open, the ``ferrobatch`` logger writes its records of ``level``
    and above to the file ``path`` (appended), and only there, as Triton's
    ``--log-file`` takes its log off the console; reported as ``log_file``.
    None: logging is left as it is."""
    global _file
    if path is None:
        yield
        return
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    with _lock:
        saved = _logger.level, _logger.propagate, _file
        _logger.addHandler(handler)
        _logger.setLevel(level)
        _logger.propagate = False
        _file = path
    try:
        yield
    finally:
        with _lock:
            _logger.removeHandler(handler)
            _logger.setLevel(saved[0])
            _logger.propagate = saved[1]
            _file = saved[2]
        handler.close()


def current() -> dict[str, Setting]:
    """The settings as they are now."""
    with _lock:
        return _read()


def update(changes: Mapping[str, object]) -> dict[str, Setting]:
    """Applies ``changes`` (a None value leaves its setting as it is) and
    returns the settings as they are then; :class:`ProtocolError` 400, with
    nothing changed, for an unknown or ill-typed setting, a ``log_file``,
    a ``log_format`` other than ``"default"``, or levels that do not nest."""
    global _verbose
    with _lock:
        wanted = _read()
        for name, value in changes.items():
            if value is not None:
                wanted[name] = _checked(name, value)
        if wanted == _read():
            return wanted  # nothing to change: the logger's own level (or none) stays
        _check_nesting(wanted)
        verbose = int(wanted["log_verbose_level"])
        if verbose > 0:
            level = logging.DEBUG
        else:
            on = [lvl for name, lvl in _SWITCHES if wanted[name]]
            level = on[0] if on else logging.CRITICAL + 1
        _logger.setLevel(level)
        _verbose = verbose
        return _read()


def _read() -> dict[str, Setting]:
    on = _logger.isEnabledFor
    verbose = (_verbose or 1) if on(logging.DEBUG) else 0
    return {
        "log_file": _file,
        "log_info": on(logging.INFO),
        "log_warning": on(logging.WARNING),
        "log_error": on(logging.ERROR),
        "log_verbose_level": verbose,
        "log_format": "default",
    }


def _checked(name: str, value: object) -> Setting:
    if name == "log_file":
        raise ProtocolError(400, "log file location can not be updated through network protocol")
    if name in ("log_info", "log_warning", "log_error"):
        if not isinstance(value, bool):
            raise ProtocolError(400, f"{name} must be true or false, got {value!r}")
        return value
    if name == "log_verbose_level":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_VERBOSE:
            raise ProtocolError(400, f"log_verbose_level must be an integer from 0 to {_MAX_VERBOSE}, got {value!r}")
        return value
    if name == "log_format":
        if value != "default":
            raise ProtocolError(
                400,
                f"log_format {value!r} is not supported: ferrobatch's lines are formatted by the"
                " process's logging handlers ('default' only)",
            )
        return value
    raise ProtocolError(400, f"unknown log setting {name!r}; the settings are {', '.join(SETTINGS)}")


def _check_nesting(wanted: Mapping[str, Setting]) -> None:
    """Refuses levels a threshold cannot express: a level on below one off."""
    below = [("log_verbose_level", bool(wanted["log_verbose_level"]))]
    below += [(name, bool(wanted[name])) for name, _ in _SWITCHES]
    for (lower, lower_on), (upper, upper_on) in itertools.pairwise(below):
        if lower_on and not upper_on:
            off = "0" if lower == "log_verbose_level" else "off"
            raise ProtocolError(
                400,
                f"{upper} off needs {lower} {off} too: ferrobatch's log levels are a threshold"
                " (DEBUG < INFO < WARNING < ERROR)",
            )
