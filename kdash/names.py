"""Kernel names: demangled once, where records come in, and shortened the same way everywhere.

CUPTI reports C++ kernels by their Itanium-mangled symbol (`_ZN2at6native...`); Kineto writes
the same kernels demangled. kdash demangles at ingest — when a batch enters the store, a
capture is loaded or a trace imported (`demangle_kernels`) — so `kernels.name` reads like
Kineto's and the symbol as recorded stays in `kernels.mangled`. The demangler is the `demangle`
package (pure Python, maintained), in GNU style: its output is what c++filt and
`abi::__cxa_demangle` (which Kineto calls) print, character for character, on every C++ name of
the shipped captures and traces (tests/test_names.py). No subprocess.

`short_names` makes the labels that tables show: the kernel's own name without namespaces,
with what tells instances of one template apart (the functor or op of an ATen elementwise
kernel, the reduction of a reduce kernel) and, where two labels of one table would still read
the same, the first tokens that differ (a dtype, a vector width, a tile); names too long for
the column are cut in the middle, keeping a GEMM's tile. Pure functions of the names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from kdash.schema import Batch


def demangle(name: str) -> str:
    """The demangled C++ name, or `name` unchanged (not mangled, or not readable)."""
    if not name.startswith("_Z"):
        return name
    import demangle as _dm

    return _dm.demangle(name, language="itanium", style="gnu")


def demangle_kernels(batch: Batch) -> tuple[Batch, dict[str, str]]:
    """A `kernels` batch with `name` demangled, and {symbol: demangled name} for the names it
    changed (the batch itself when there were none)."""
    names = batch["name"]
    if not len(names):
        return batch, {}
    listed = names.tolist()
    done = {n: d for n in dict.fromkeys(listed) if n.startswith("_Z") and (d := demangle(n)) != n}
    if not done:
        return batch, {}
    new_names = np.empty(len(listed), dtype=object)
    new_names[:] = [done.get(n, n) for n in listed]
    return {**batch, "name": new_names}, done


def demangle_kernel_frame(df) -> dict[str, str]:
    """The same for a `kernels` DataFrame (a capture's table), in place."""
    if df.empty:
        return {}
    names = df["name"].astype(str)
    todo = [n for n in names.unique().tolist() if n.startswith("_Z")]
    done = {n: d for n in todo if (d := demangle(n)) != n}
    if done:
        df["name"] = names.map(lambda n: done.get(n, n))
    return done


def symbol_rows(done: dict[str, str], t_ns: int) -> Batch:
    """`kernel_symbols` rows for {symbol: demangled name}."""
    from kdash import schema

    return schema.make_batch(
        "kernel_symbols",
        t_ns=[t_ns] * len(done),
        name=list(done.values()),
        mangled=list(done.keys()),
    )


def symbols_of(kernel_symbols) -> dict[str, str]:
    """{demangled name: symbol} from a `kernel_symbols` table (DataFrame or batch)."""
    out: dict[str, str] = {}
    for n, m in zip(list(kernel_symbols["name"]), list(kernel_symbols["mangled"]), strict=True):
        out.setdefault(str(n), str(m))
    return out


# -- short labels -------------------------------------------------------------------------
# Templates that only carry the op they apply: a label names the op inside them.
_WRAPPERS = frozenset(
    {
        "gpu_kernel_impl",
        "gpu_kernel_impl_nocast",
        "gpu_index_kernel",
        "BinaryFunctor",
        "AUnaryFunctor",
        "BUnaryFunctor",
        "UnaryFunctor",
        "ReduceOp",
        "func_wrapper_t",
        "launch_kernel",
    }
)
# Template arguments that never tell two kernels apart in a way a reader cares for first.
_PLUMBING = re.compile(
    r"^(std::array|TrivialOffsetCalculator|OffsetCalculator|at::native::memory::\w+|"
    r"at::detail::Array|c10::Array|std::tuple)\b"
)
_BUILTIN = frozenset(
    [
        "void",
        "bool",
        "char",
        "short",
        "int",
        "long",
        "float",
        "double",
        "unsigned",
        "signed",
        "const",
        "true",
        "false",
    ]
)
_DTYPES = (
    "float|double|int|long|short|char|bool|BFloat16|Half|__nv_bfloat16|__half|"
    "Float8_e4m3fn|Float8_e5m2|__nv_fp8_e4m3|__nv_fp8_e5m2|complex|int8_t|uint8_t"
)
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:x\d+)+|\d+")
_DTYPE = re.compile(rf"^(?:{_DTYPES})$")
_TILE = re.compile(r"\d+x\d+")
# ATen's op functions are `<op>_kernel_cuda`, `<op>_kernel_impl`, `<op>_kernel`: the op is the name
_OP_SUFFIX = re.compile(r"(?:_kernel)?(?:_cuda|_impl)?$|_kernel$")


def _split_top(s: str, sep: str = ",") -> list[str]:
    """`s` split at `sep` where no bracket is open."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _top_level(s: str, needle: str) -> int:
    """Index of the first `needle` in `s` outside any bracket, or -1."""
    depth = 0
    for i, ch in enumerate(s):
        if ch in "<([{" and not s.startswith(needle, i):
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        elif depth == 0 and s.startswith(needle, i):
            return i
    return -1


def _head(s: str) -> tuple[str, str]:
    """(qualified name before its first top-level `<` or `(`, template argument text)."""
    for i, ch in enumerate(s):
        if ch in "<(":
            if ch == "(" and s.startswith("(anonymous namespace)", i):
                continue
            if ch == "<":
                depth = 0
                for j in range(i, len(s)):
                    if s[j] == "<":
                        depth += 1
                    elif s[j] == ">":
                        depth -= 1
                        if depth == 0:
                            return s[:i], s[i + 1 : j]
                return s[:i], s[i + 1 :]
            return s[:i], ""
    return s, ""


def _last(qualified: str) -> str:
    parts = [p for p in _split_top(qualified, ":") if p]
    parts = [p for p in parts if p not in ("operator()", "(anonymous namespace)")]
    return parts[-1].strip() if parts else qualified.strip()


def _strip_void(s: str) -> str:
    return s[5:] if s.startswith("void ") else s


def _op(arg: str) -> str | None:
    """What a template argument says the kernel does: a functor's or lambda's enclosing
    function's name, looked for inside wrapper templates; None for plumbing and numbers."""
    arg = _strip_void(arg.strip())
    if not arg or arg[0].isdigit() or _PLUMBING.match(arg):
        return None
    if all(w in _BUILTIN for w in arg.replace("*", " ").replace("&", " ").split()):
        return None
    # A lambda names its enclosing function: `f(...)::{lambda()#1}` reads as f
    cut = _top_level(arg, "::{lambda")
    if cut >= 0:
        arg = arg[:cut]
    name, targs = _head(arg)
    base = _last(name)  # `sum_functor<..>::operator()` reads as sum_functor
    if not base or base in _BUILTIN or _DTYPE.match(base):
        return None
    if base in _WRAPPERS and targs:
        for a in _split_top(targs):
            found = _op(a)
            if found:
                return found
    return _OP_SUFFIX.sub("", base) or base


def _label(full: str) -> str:
    """The first-try label: the kernel's name without namespaces, and its op if any."""
    s = _strip_void(full.strip())
    name, targs = _head(s)
    base = _last(name)
    if not targs:
        return base or full
    for a in _split_top(targs):
        op = _op(a)
        if op:
            return f"{base}<{op}>"
    return f"{base}<…>"


def _template_part(full: str) -> str:
    """The name up to its parameter list: where instances of one kernel differ."""
    s = _strip_void(full.strip())
    name, targs = _head(s)
    return f"{name}<{targs}>" if targs else name


def _tokens(full: str) -> list[str]:
    """Distinct tokens of the template part, namespaces left out, in order of appearance."""
    part = _template_part(full)
    out: list[str] = []
    for m in _TOKEN.finditer(part):
        tok = m.group(0)
        if part.startswith("::", m.end()) or tok in ("const", "lambda", "operator", "anonymous"):
            continue
        if tok.endswith("ul") and tok[:-2].isdigit():
            continue
        if tok not in out:
            out.append(tok)
    return out


def _rank(tok: str) -> int:
    if _DTYPE.match(tok):
        return 0
    if _TILE.fullmatch(tok):
        return 1
    if tok[0].isdigit():
        return 3
    return 2


def _cut(s: str, width: int) -> str:
    """`s` in `width` characters. A label `kernel<op>` loses the middle of the kernel's name
    first (the op is what tells it apart); otherwise the middle is elided, keeping a tile
    (`128x104_64x7...`) and what follows it when the name has one."""
    if len(s) <= width:
        return s
    lt = s.find("<")
    if lt > 0 and s.endswith(">"):
        base, args = s[:lt], s[lt:]
        if base.endswith("_kernel") and len(base) > 7:
            base = base[:-7]  # what every one of them is
        if len(base) + len(args) <= width:
            return base + args
        room = width - len(args)
        if room >= 10:
            return base[: room - 1] + "…" + args
        keep = min(len(base), 10)
        return (base[: keep - 1] + "…" if keep < len(base) else base) + _elide(args, width - keep)
    m = _TILE.search(s)
    if m:
        tail = s[m.start() :]
        head = width - 1 - len(tail)
        if head >= 6:
            return s[:head] + "…" + tail
        if len(tail) < width:
            return "…" + tail
    return _elide(s, width)


def _elide(s: str, width: int) -> str:
    if len(s) <= width:
        return s
    keep = width - 1
    return s[: keep // 2] + "…" + s[-(keep - keep // 2) :]


def _with(label: str, extra: Sequence[str]) -> str:
    if not extra:
        return label
    if label.endswith(">"):
        return label[:-1] + ", " + ", ".join(extra) + ">"
    return label + " " + " ".join(extra)


def _refine(members: list[str], extra: dict[str, list[str]], depth: int = 0) -> None:
    """Add to each member's `extra` the first token (by `_rank`) that the members do not all
    share, then again within the members still alike, until they differ or nothing does."""
    if depth >= 8:
        return
    toks = {n: [t for t in _tokens(n) if t not in extra[n]] for n in members}
    common = set.intersection(*(set(t) for t in toks.values()))
    grew = False
    for n in members:
        diff = sorted((t for t in toks[n] if t not in common), key=_rank)
        if diff:
            extra[n].append(diff[0])
            grew = True
    if not grew:
        return
    sub: dict[tuple[str, ...], list[str]] = {}
    for n in members:
        sub.setdefault(tuple(extra[n]), []).append(n)
    for again in sub.values():
        if len(again) > 1:
            _refine(again, extra, depth + 1)


def short_names(names: Iterable[str], width: int = 48) -> dict[str, str]:
    """A label per distinct name, at most `width` characters, no two alike (as far as the
    names differ at all; a last resort numbers them)."""
    uniq = list(dict.fromkeys(str(n) for n in names))
    labels = {n: _label(n) for n in uniq}
    groups: dict[str, list[str]] = {}
    for n in uniq:
        groups.setdefault(labels[n], []).append(n)
    extra: dict[str, list[str]] = {n: [] for n in uniq}
    for members in groups.values():
        if len(members) > 1:
            _refine(members, extra)
    labels = {n: _with(labels[n], extra[n]) for n in uniq}
    out = {n: _cut(labels[n], width) for n in uniq}
    # Cutting can make two labels alike again: those are numbered, clear of every other label
    count: dict[str, int] = {}
    for v in out.values():
        count[v] = count.get(v, 0) + 1
    taken = {v for v, c in count.items() if c == 1}
    for n in uniq:
        if count[out[n]] == 1:
            continue
        i = 1
        while True:
            tag = f" #{i}"
            cand = _cut(labels[n], width - len(tag)) + tag
            if cand not in taken:
                break
            i += 1
        out[n] = cand
        taken.add(cand)
    return out


def short_name(name: str, width: int = 48) -> str:
    """One name's label (no table to tell it apart from: `short_names` for tables)."""
    return short_names([name], width)[name]
