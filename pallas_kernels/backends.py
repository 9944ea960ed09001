"""How every op's entry point chooses its implementation (in the spirit of openxla/tokamax's registry of
implementations per op): each op keeps a `Backends` that names its implementations, the pure-jnp "reference"
first, then its kernels ("tpu", "gpu", "xla") in the order "auto" tries them. Each kernel names the platform it
runs on (`jax.default_backend()`) and a predicate saying whether it takes a call's operands there; "auto" is the
first that does, the reference where none does. Every implementation is its module's function of the op's name, with
the reference's signature, looked up when a call is traced."""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from types import ModuleType

import jax

from pallas_kernels import devices

AUTO, REFERENCE = "auto", "reference"
_references_only = False


@contextlib.contextmanager
def references_only() -> Iterator[None]:
    """Within it, "auto" takes every op's reference: for tracing code that differentiates the model (training),
    which only the pure-jnp references allow."""
    global _references_only
    before, _references_only = _references_only, True
    try:
        yield
    finally:
        _references_only = before


@dataclasses.dataclass(frozen=True)
class Kernel:
    """An implementation "auto" may choose: `module`'s function, on `platform`, for operands `takes` accepts."""

    module: ModuleType
    platform: str
    takes: Callable[..., bool]


class Backends:
    """One op's implementations by name: "reference" (`reference`'s function `function`) and the kernels
    registered after it. `op` names the op in errors."""

    def __init__(self, op: str, function: str, reference: ModuleType):
        self.op, self.function_name, self.reference = op, function, reference
        self.kernels: dict[str, Kernel] = {}

    def register(self, name: str, module: ModuleType, *, platform: str, takes: Callable[..., bool]) -> None:
        """Add kernel `name`: `module`'s function, which "auto" runs on `platform` for operands `takes` accepts
        (after the kernels registered before it)."""
        self.kernels[name] = Kernel(module, platform, takes)

    @property
    def names(self) -> tuple[str, ...]:
        """The names a call's `backend` may take: "auto", "reference", then the kernels in registration order."""
        return (AUTO, REFERENCE, *self.kernels)

    def check(self, backend: str, *, chosen: bool = False) -> None:
        """Raise ValueError unless `backend` is one of `names` (other than "auto" where it is to be `chosen`)."""
        if backend not in (self.names[1:] if chosen else self.names):
            raise ValueError(f"{self.op} backend {backend!r} is not one of {', '.join(self.names)}")

    def choose(self, backend: str, *operands) -> str:
        """The implementation `backend` names for these operands: itself, or for "auto" the first kernel of the
        platform this process runs on that takes them, else the reference (always, within `references_only`)."""
        self.check(backend)
        if backend != AUTO:
            return backend
        if _references_only:
            return REFERENCE
        platform = jax.default_backend()
        chosen = (name for name, k in self.kernels.items() if k.platform == platform and k.takes(*operands))
        return next(chosen, REFERENCE)

    def function(self, name: str) -> Callable[..., jax.Array]:
        """The function of implementation `name` (a `choose`n one, not "auto"), with the reference's signature."""
        self.check(name, chosen=True)
        module = self.reference if name == REFERENCE else self.kernels[name].module
        return getattr(module, self.function_name)


def hopper_takes(check: Callable[..., None], *operands) -> bool:
    """A Mosaic GPU kernel's predicate: on an sm90 GPU, operands its `check` accepts (raises no ValueError for)."""
    if not devices.on_hopper():
        return False
    try:
        check(*operands)
    except ValueError:
        return False
    return True
