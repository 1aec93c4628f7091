"""Kernel names -> source: an index of the `@triton.jit` functions of an environment, and C++
name demangling.

Why it is built this way:

- **Read, never import.** The index is built with `ast` from the files of a folder (the target's
  site-packages, a checkout): importing SGLang would pull CUDA, torch and a model registry into
  kdash, and would run the target's code in our process. A file is parsed only when its text
  mentions "triton" (kernels and the files that launch them), so a whole site-packages is
  cheap to scan (about 10 s for 8,600 files here).
- **What counts as a Triton kernel**: a function decorated with `triton.jit`, `triton.jit(...)`
  or any alias bound in that file (`import triton as tr` -> `@tr.jit`; `from triton import jit
  as tjit` -> `@tjit`; `triton.runtime.jit`), alone or under `@triton.autotune(...)` /
  `@triton.heuristics(...)`; and Gluon's (`from triton.experimental import gluon` ->
  `@gluon.jit`), Triton's explicit-layout dialect. Kernels defined under an `if` (a library
  that guards them on what its Triton has), `try` or `with` block count too.
- **Names collide.** The GPU kernel's name is the Python function's name, and SGLang has
  `_fwd_kernel` in both extend_attention.py and prefill_attention.py. `lookup` returns every
  candidate; `resolve` ranks them with what a trace knows about the launch: a module hint (a file
  or module fragment), the launching Python file (torch.profiler's `with_stack`), the block size
  (`num_warps = threads / 32`) against the `num_warps=` constants at the kernel's launch sites,
  and the grid's dimensions against the `tl.program_id(axis)` axes the kernel reads. The reasons
  are returned with the score, so a pane can say why it picked one.
- **Kernel names as the GPU reports them**: Triton 3 names the kernel after the function; older
  Triton appended a specialisation suffix (`_fwd_kernel_0d1d2d3de4de`), stripped before lookup.
- **Where the code moved**: nothing here holds a path or a line number of SGLang's files; the
  index is built from whatever version is installed (`site_packages_of_pid` finds the target's
  own site-packages from the shared libraries it has mapped, through /proc/PID/root so a
  containerised target's files are read, not ours).
- **Demangling**: kdash.names (the pure-Python `demangle` package, GNU spelling); a name it
  cannot read stays as it is. Never an error, never a subprocess.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SPECIALISATION = re.compile(r"_(?:\d+[cdei]+)+$")
_SKIP_DIRS = {"__pycache__", ".git", "node_modules", ".tox", ".venv"}


@dataclass(frozen=True)
class LaunchSite:
    file: str
    line: int
    num_warps: int | None  # a literal `num_warps=` at the launch, None when not a constant


@dataclass(frozen=True)
class TritonFunction:
    name: str
    qualname: str  # module path + function, e.g. sglang.srt.layers....decode_attention._fwd_kernel
    module: str
    file: str
    line: int  # the `def` line
    decorator_line: int
    end_line: int
    params: tuple[str, ...]
    constexprs: tuple[str, ...]
    autotuned: bool
    program_axes: tuple[int, ...]  # axes read with tl.program_id(axis)
    launches: tuple[LaunchSite, ...] = ()

    def launch_num_warps(self) -> set[int]:
        return {s.num_warps for s in self.launches if s.num_warps is not None}


@dataclass
class Candidate:
    function: TritonFunction
    score: float
    reasons: list[str] = field(default_factory=list)


@dataclass
class TritonIndex:
    root: str
    functions: list[TritonFunction] = field(default_factory=list)
    files_scanned: int = 0
    files_parsed: int = 0
    files_failed: list[str] = field(default_factory=list)

    @functools.cached_property
    def by_name(self) -> dict[str, list[TritonFunction]]:
        out: dict[str, list[TritonFunction]] = {}
        for f in self.functions:
            out.setdefault(f.name, []).append(f)
        return out

    def collisions(self) -> dict[str, list[TritonFunction]]:
        """Names defined by more than one `@triton.jit` function."""
        return {k: v for k, v in self.by_name.items() if len(v) > 1}

    def lookup(self, kernel_name: str) -> list[TritonFunction]:
        """Every function the GPU kernel name may come from (exact, then unspecialised)."""
        name = kernel_name.strip()
        hits = self.by_name.get(name)
        if hits:
            return list(hits)
        base = _SPECIALISATION.sub("", name)
        return list(self.by_name.get(base, []))

    def resolve(
        self,
        kernel_name: str,
        *,
        module_hint: str | None = None,
        caller_file: str | None = None,
        block: Sequence[int] | None = None,
        grid: Sequence[int] | None = None,
    ) -> list[Candidate]:
        """Candidates for a kernel, best first, each with its score and the reasons for it."""
        out = []
        for f in self.lookup(kernel_name):
            c = Candidate(f, 0.0)
            if module_hint:
                hint = module_hint.replace("/", ".").removesuffix(".py")
                if hint in f.qualname or module_hint in f.file:
                    c.score += 3
                    c.reasons.append(f"module matches {module_hint!r}")
            if caller_file:
                _score_caller(c, f, caller_file)
            if block:
                _score_block(c, f, block)
            if grid:
                _score_grid(c, f, grid)
            out.append(c)
        out.sort(key=lambda c: (-c.score, c.function.qualname))
        return out

    def best(self, kernel_name: str, **hints: object) -> TritonFunction | None:
        """The single best candidate, or None when none or a tie at the top."""
        ranked = self.resolve(kernel_name, **hints)  # type: ignore[arg-type]
        if not ranked:
            return None
        if len(ranked) > 1 and ranked[0].score == ranked[1].score:
            return None
        return ranked[0].function


def _score_caller(c: Candidate, f: TritonFunction, caller_file: str) -> None:
    """Closer to the launching file scores higher: defined or launched there, or beside it."""
    cf = os.path.realpath(caller_file)
    if os.path.realpath(f.file) == cf:
        c.score += 4
        c.reasons.append("defined in the launching file")
    elif any(os.path.realpath(s.file) == cf for s in f.launches):
        c.score += 4
        c.reasons.append("launched from that file")
    elif os.path.dirname(os.path.realpath(f.file)) == os.path.dirname(cf):
        c.score += 1
        c.reasons.append("same folder as the launching file")


def _score_block(c: Candidate, f: TritonFunction, block: Sequence[int]) -> None:
    """The block's warp count against the num_warps its launch sites pass."""
    threads = 1
    for b in block:
        if b and b > 0:
            threads *= b
    warps = threads // 32 if threads % 32 == 0 else None
    known = f.launch_num_warps()
    if warps is not None and known:
        if warps in known:
            c.score += 2
            c.reasons.append(f"num_warps={warps} at a launch site")
        else:
            c.score -= 1
            c.reasons.append(f"launch sites use num_warps {sorted(known)}, not {warps}")


def _score_grid(c: Candidate, f: TritonFunction, grid: Sequence[int]) -> None:
    """The grid axes in use against the program axes the kernel reads."""
    used = [i for i, g in enumerate(grid[:3]) if g and g > 1]
    axes = set(f.program_axes)
    if used and axes and not set(used) <= axes:
        c.score -= 2
        c.reasons.append(f"grid uses axes {used}; kernel reads {sorted(axes)}")
    elif used and axes and set(used) <= axes:
        c.score += 0.5
        c.reasons.append("grid axes read by the kernel")


def resolve_kernels(
    index: TritonIndex, kernels: Mapping[str, Any], module_hint: str | None = None
) -> dict[str, Candidate | None]:
    """For each distinct kernel name of a `kernels` batch: its best `@triton.jit` source, judged
    with that name's most frequent launch shape (block, grid); None for a tie or a kernel that
    is not a Triton function (cuBLAS, FlashAttention, torch's own)."""
    names = kernels["name"]
    shapes: dict[str, Counter[tuple[int, ...]]] = {}
    cols = ("block_x", "block_y", "block_z", "grid_x", "grid_y", "grid_z")
    arrays = [kernels[c] for c in cols]
    for i, name in enumerate(names):
        if not index.lookup(name):
            shapes.setdefault(name, Counter())
            continue
        shapes.setdefault(name, Counter())[tuple(int(a[i]) for a in arrays)] += 1
    out: dict[str, Candidate | None] = {}
    for name, counts in shapes.items():
        if not counts:
            out[name] = None
            continue
        shape = counts.most_common(1)[0][0]
        ranked = index.resolve(name, module_hint=module_hint, block=shape[:3], grid=shape[3:])
        tie = len(ranked) > 1 and ranked[0].score == ranked[1].score
        out[name] = None if not ranked or tie else ranked[0]
    return out


# -- scanning ------------------------------------------------------------------------------
def _module_name(path: Path, root: Path) -> str:
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    parts = list(rel.with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or path.stem


class _Aliases:
    """Names that mean the triton module, triton.jit, triton.autotune in one file."""

    def __init__(self, tree: ast.Module) -> None:
        self.triton = {"triton"}
        self.gluon: set[str] = set()  # names bound to triton.experimental.gluon
        self.jit: set[str] = set()
        self.wrappers: set[str] = set()  # autotune, heuristics
        self.imported: dict[str, str] = {}  # local name -> "module.name" for `from m import x`
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "triton":
                        self.triton.add(a.asname or "triton")
                    elif a.name == "triton.experimental.gluon" and a.asname:
                        self.gluon.add(a.asname)
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from triton import jit`, `from triton.runtime.jit import jit`, and inside
                # triton itself `from ..runtime.jit import jit`
                from_triton = node.module.split(".")[0] == "triton" or (
                    node.level > 0 and "jit" in node.module.split(".")
                )
                for a in node.names:
                    local = a.asname or a.name
                    if from_triton:
                        if a.name == "gluon":
                            self.gluon.add(local)
                        elif a.name == "jit":
                            self.jit.add(local)
                        elif a.name in ("autotune", "heuristics"):
                            self.wrappers.add(local)
                    self.imported[local] = f"{node.module}.{a.name}"

    def kind(self, deco: ast.expr) -> str | None:
        """ "jit", "autotune", "heuristics" or None for a decorator expression."""
        target = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(target, ast.Name):
            if target.id in self.jit:
                return "jit"
            if target.id in self.wrappers:
                return "autotune"
            return None
        if isinstance(target, ast.Attribute):
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in self.gluon and target.attr == "jit":
                return "jit"
            if isinstance(root, ast.Name) and root.id in self.triton:
                if target.attr == "jit":
                    return "jit"
                if target.attr in ("autotune", "heuristics"):
                    return "autotune"
        return None


def _program_axes(fn: ast.FunctionDef) -> tuple[int, ...]:
    axes = set()
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "program_id"
        ):
            arg = node.args[0] if node.args else None
            if arg is None:
                for kw in node.keywords:
                    if kw.arg == "axis":
                        arg = kw.value
            if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
                axes.add(arg.value)
    return tuple(sorted(axes))


def _constexprs(fn: ast.FunctionDef) -> tuple[str, ...]:
    def is_constexpr(ann: ast.expr | None) -> bool:
        if isinstance(ann, ast.Attribute):
            return ann.attr == "constexpr"
        return isinstance(ann, ast.Name) and ann.id == "constexpr"

    return tuple(a.arg for a in fn.args.args + fn.args.kwonlyargs if is_constexpr(a.annotation))


def _launches(tree: ast.Module, file: str) -> list[tuple[str, LaunchSite]]:
    """`kernel[grid](..., num_warps=N)` calls in a file: (local kernel name, site)."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        v = node.func.value
        name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
        if not name:
            continue
        warps = None
        for kw in node.keywords:
            value = kw.value.value if isinstance(kw.value, ast.Constant) else None
            if kw.arg == "num_warps" and isinstance(value, int):
                warps = value
        out.append((name, LaunchSite(file, node.lineno, warps)))
    return out


def _iter_py(root: Path) -> Iterable[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                yield Path(dirpath) / fn


def scan(root: str | os.PathLike, *, module_root: str | os.PathLike | None = None) -> TritonIndex:
    """Index every `@triton.jit` function under `root` (a folder or one file).

    `module_root` is the folder module names are counted from (default: `root`; give the
    site-packages folder when scanning one package inside it)."""
    root_p = Path(root)
    mod_root = (
        Path(module_root)
        if module_root is not None
        else (root_p if root_p.is_dir() else root_p.parent)
    )
    index = TritonIndex(root=str(root_p))
    found: list[dict] = []
    launches: list[tuple[str, LaunchSite, dict[str, str], str]] = []
    for path in _iter_py(root_p):
        index.files_scanned += 1
        try:
            raw = path.read_bytes()
        except OSError:
            index.files_failed.append(str(path))
            continue
        # Kernels need "jit"; launch sites in other files name the kernel's triton module
        # (SGLang's `...attention.triton_ops...` imports) or triton itself.
        if b"triton" not in raw and b"runtime.jit" not in raw:
            continue
        text = raw.decode("utf-8", errors="replace")
        try:
            tree = ast.parse(text, filename=str(path))
        except (SyntaxError, ValueError):
            index.files_failed.append(str(path))
            continue
        index.files_parsed += 1
        aliases = _Aliases(tree)
        module = _module_name(path, mod_root)
        for name, site in _launches(tree, str(path)):
            launches.append((name, site, aliases.imported, module))
        _collect(tree, aliases, module, str(path), found)
    # Launch sites -> functions: same file first; elsewhere through `from module import name`.
    sites: dict[int, list[LaunchSite]] = {}
    by_name: dict[str, list[int]] = {}
    for i, f in enumerate(found):
        by_name.setdefault(f["name"], []).append(i)
    for local, site, imported, _module in launches:
        target = imported.get(local)
        name = target.rsplit(".", 1)[1] if target else local
        for i in by_name.get(name, []):
            f = found[i]
            if f["file"] == site.file or (target and target == f"{f['module']}.{f['name']}"):
                sites.setdefault(i, []).append(site)
    for i, f in enumerate(found):
        index.functions.append(TritonFunction(**f, launches=tuple(sites.get(i, []))))
    return index


def _collect(tree: ast.Module, aliases: _Aliases, module: str, file: str, out: list[dict]) -> None:
    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kinds = [aliases.kind(d) for d in node.decorator_list]
                if "jit" in kinds:
                    out.append(
                        {
                            "name": node.name,
                            "qualname": f"{module}.{prefix}{node.name}",
                            "module": module,
                            "file": file,
                            "line": node.lineno,
                            "decorator_line": min(d.lineno for d in node.decorator_list),
                            "end_line": node.end_lineno or node.lineno,
                            "params": tuple(a.arg for a in node.args.args + node.args.kwonlyargs),
                            "constexprs": _constexprs(node),  # type: ignore[arg-type]
                            "autotuned": "autotune" in kinds,
                            "program_axes": _program_axes(node),  # type: ignore[arg-type]
                        }
                    )
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.If | ast.With):
                visit(node.body, prefix)
                visit(getattr(node, "orelse", []), prefix)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody):
                    visit(part, prefix)
                for handler in node.handlers:
                    visit(handler.body, prefix)

    visit(tree.body, "")


def site_packages_of_pid(pid: int, proc_root: str = "/proc") -> list[Path]:
    """The site-packages folders a live process loads from (seen in /proc/PID/maps), as paths
    readable from here (through /proc/PID/root, so a container's files are its own)."""
    roots: list[Path] = []
    try:
        with open(f"{proc_root}/{pid}/maps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5]
        for marker in ("/site-packages/", "/dist-packages/"):
            i = path.find(marker)
            if i >= 0:
                p = Path(f"{proc_root}/{pid}/root") / path[: i + len(marker)].lstrip("/")
                if p not in roots:
                    roots.append(p)
    return [p for p in roots if p.is_dir()]


# -- demangling ----------------------------------------------------------------------------
def demangle(name: str) -> str:
    """Demangled C++ name, or `name` itself when it is not mangled (kdash.names)."""
    from kdash.names import demangle as _demangle

    return _demangle(name)


def demangle_many(names: Iterable[str]) -> dict[str, str]:
    """`demangle` for a batch; unmangled names map to themselves."""
    return {n: demangle(n) for n in dict.fromkeys(names)}
