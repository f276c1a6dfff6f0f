"""What every door to an upstream's private surface shares: the checked versions and the error.

qaccel reads a few private attributes of torch, transformers and Accelerate. Each upstream gets one
door module that holds all of them (style guide §9): :mod:`qaccel._torch_internals`,
:mod:`qaccel.integration._transformers_internals` and :mod:`qaccel.integration._accelerate_internals`.
A door names the versions it was checked against through a :class:`PrivateSurface`, and every read
goes through :meth:`PrivateSurface.get` (or a check of the same kind), so an upstream release that
drops or renames an attribute stops with one message naming the attribute, the installed version
and the checked ones, instead of an ``AttributeError`` deep in a training step or, worse, a
``getattr`` default that silently changes behaviour.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PrivateSurface"]

_MISSING = object()


@dataclass(frozen=True)
class PrivateSurface:
    """The private surface of one upstream package, as one door module uses it.

    Args:
        package: the import name of the upstream (``"torch"``); its ``__version__`` is the
            installed version named in errors.
        checked_versions: the releases the door was checked against, oldest first.
        door: the module that holds every private access to ``package``, named in errors so that
            whoever updates qaccel for a new release knows where to look.

    Example::

        TORCH = PrivateSurface("torch", ("2.13.0",), "qaccel._torch_internals")
        groups = TORCH.get(state, "_fsdp_param_groups", "the param groups of an FSDP2 unit")
    """

    package: str
    checked_versions: tuple[str, ...]
    door: str

    def installed_version(self) -> str:
        """The installed version of the upstream (its ``__version__``)."""
        return str(getattr(importlib.import_module(self.package), "__version__", "unknown"))

    def missing(self, what: str, purpose: str) -> RuntimeError:
        """The error for a private name ``what`` (``"Owner.attribute"``) this upstream no longer has.

        Args:
            what: the attribute, with the class or module that should hold it.
            purpose: what qaccel uses it for, so the message says what stops working.
        """
        checked = ", ".join(self.checked_versions)
        return RuntimeError(
            f"qaccel needs {what} from {self.package} ({purpose}), but the installed {self.package} "
            f"{self.installed_version()} does not have it; {self.door} was checked against {self.package} "
            f"{checked}: install one of those versions, or update {self.door} for this release"
        )

    def get(self, obj: Any, name: str, purpose: str, *, owner: str | None = None) -> Any:
        """``getattr(obj, name)``, or :meth:`missing` when ``obj`` does not define ``name``.

        An ``AttributeError`` raised while computing an attribute that exists (a property's own
        bug) propagates unchanged: only a name that is really gone becomes the version message.

        Args:
            obj: the object, class or module to read from.
            name: the attribute name.
            purpose: what qaccel uses it for.
            owner: how the message names ``obj`` (default: its module's or class's name).

        Raises:
            RuntimeError: ``obj`` has no attribute ``name``.
        """
        try:
            return getattr(obj, name)
        except AttributeError:
            if self.defines(obj, name):
                raise
            raise self.missing(f"{owner or _owner_name(obj)}.{name}", purpose) from None

    def set(self, obj: Any, name: str, value: Any, purpose: str, *, owner: str | None = None) -> None:
        """``setattr(obj, name, value)`` for an attribute ``obj`` already has.

        Setting an attribute that upstream no longer reads would silently do nothing, so a name
        that is gone is an error here too.

        Raises:
            RuntimeError: ``obj`` has no attribute ``name``.
        """
        if not self.defines(obj, name):
            raise self.missing(f"{owner or _owner_name(obj)}.{name}", purpose)
        setattr(obj, name, value)

    def require_method(self, cls: type, name: str, parameters: Iterable[str], purpose: str) -> None:
        """Check that ``cls.name`` is a method taking ``parameters`` (after ``self``), in that order.

        A subclass that overrides a private method whose upstream was renamed or re-signed would
        never be called, or be called with other arguments; this check turns that into an error.

        Raises:
            RuntimeError: the method is gone or its parameters differ.
        """
        method = self.get(cls, name, purpose, owner=cls.__qualname__)
        wanted = tuple(parameters)
        found = tuple(inspect.signature(method).parameters)[1:]  # without self
        if found != wanted:
            checked = ", ".join(self.checked_versions)
            raise RuntimeError(
                f"qaccel overrides {cls.__qualname__}.{name}({', '.join(wanted)}) ({purpose}), but in the installed "
                f"{self.package} {self.installed_version()} it takes ({', '.join(found)}); {self.door} was checked "
                f"against {self.package} {checked}: install one of those versions, or update {self.door} for this release"
            )

    @staticmethod
    def defines(obj: Any, name: str) -> bool:
        """Whether ``obj`` (or its class) defines ``name``, without running a property or ``__getattr__``."""
        return inspect.getattr_static(obj, name, _MISSING) is not _MISSING


def _owner_name(obj: Any) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    if isinstance(obj, type):
        return obj.__qualname__
    return type(obj).__qualname__
