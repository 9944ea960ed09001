"""The packages' imports point one way, serving -> inkling_jax -> pallas_kernels, and the model and the front end
reach the kernels only through their entry points: a kernel package (`pallas_kernels.<op>`, its __init__), the
top-level package, or a shared leaf module, never a kernel package's backend modules (gpu, tpu, reference, layouts,
...) nor the kernels' own plumbing (devices, backends, platform). Read from the sources' syntax trees: nothing is
imported."""

import ast
from collections.abc import Iterator
from pathlib import Path

from paths import REPO

KERNELS = REPO / "pallas_kernels"
SHARED_LEAVES = {"numerics", "quantized", "block_formats"}  # entry points of their own
OPS = {path.parent.name for path in KERNELS.glob("*/__init__.py")}


def imported(package: str) -> Iterator[tuple[Path, str]]:
    """(file, module) for every absolute import in `package`'s modules: `import a.b` gives a.b; `from a.b import
    c` gives a.b, and a.b.c where that is a module of the repository."""
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from ((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield path, node.module
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if _is_module(name):
                        yield path, name


def _is_module(name: str) -> bool:
    """Whether the dotted `name` is a module or package of the repository."""
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _an_entry_point(module: str) -> bool:
    """Whether `module` (of pallas_kernels) is the package, an op's package or a shared leaf module."""
    parts = module.split(".")
    return len(parts) == 1 or (len(parts) == 2 and (parts[1] in OPS or parts[1] in SHARED_LEAVES))


def test_the_model_and_the_front_end_reach_kernels_only_through_entry_points():
    assert {"moe", "ragged_paged_attention", "attn_res"} <= OPS
    reaching_in = [
        f"{path.relative_to(REPO)}: {module}"
        for package in ("inkling_jax", "serving")
        for path, module in imported(package)
        if module.split(".")[0] == "pallas_kernels" and not _an_entry_point(module)
    ]
    assert not reaching_in


def test_dependencies_point_one_way():
    upward = [
        f"{path.relative_to(REPO)}: {module}"
        for package, above in (("pallas_kernels", {"inkling_jax", "serving"}), ("inkling_jax", {"serving"}))
        for path, module in imported(package)
        if module.split(".")[0] in above
    ]
    assert not upward
