"""The commands' paths: models of N ranks, and outputs checked before any work starts.

A MODEL (``run``, ``check``, ``inputs``) or an IN (``convert``, ``lower``) is one of

* a file: every rank runs it (``run`` needs ``--ranks`` unless it has no collective);
* a folder of ``rank{r}.onnx`` files: rank r runs ``rank{r}.onnx``, N is the number of files;
* a path with ``{r}`` in it (``exports/layer_r{r}.onnx``): rank r runs the path with r in
  place of ``{r}``, N is the number of such files.

N is found from the files (they must be numbered 0 .. N-1); ``--ranks``, when given, must
agree. Output files and folders are checked before the work, so that a run never ends in
an error it could have given at its start: an output may not be an existing folder (or, for
a folder, an existing file) and its folder must exist or be creatable; folders are created
when the outputs are written.
"""

from __future__ import annotations

import glob
import os
import re

from ..errors import UserError

RANK_FILE = re.compile(r"rank(0|[1-9]\d*)\.onnx")
PLACEHOLDER = "{r}"


def is_pattern(spec: str) -> bool:
    return PLACEHOLDER in spec


def rank_path(spec: str, rank: int) -> str:
    """Rank ``rank``'s file of MODEL ``spec`` (a file, a folder of rank{r}.onnx or a {r} path)."""
    if is_pattern(spec):
        return spec.replace(PLACEHOLDER, str(rank))
    if os.path.isdir(spec):
        return os.path.join(spec, f"rank{rank}.onnx")
    return spec


def ranks_found(spec: str) -> int | None:
    """N for a folder or a ``{r}`` path (from the files there, numbered 0 .. N-1); None for
    one file. :class:`UserError` when there are none, or the numbers have gaps."""
    if is_pattern(spec):
        parts = spec.split(PLACEHOLDER)
        rest = re.escape(parts[1]) + "".join(r"\1" + re.escape(p) for p in parts[2:])  # {r} again: the same r
        number = re.compile(re.escape(parts[0]) + r"(0|[1-9]\d*)" + rest)
        paths = glob.glob("*".join(glob.escape(p) for p in parts))
        found = {int(m[1]) for path in paths if (m := number.fullmatch(path))}
        where = f"no file matches {spec}"
    elif os.path.isdir(spec):
        found = {int(m[1]) for name in os.listdir(spec) if (m := RANK_FILE.fullmatch(name))}
        where = f"folder {spec} holds no rank{{r}}.onnx file"
    else:
        return None
    if not found:
        raise UserError(where)
    missing = sorted(set(range(max(found) + 1)) - found)
    if missing:
        listed = ", ".join(rank_path(spec, r) for r in missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise UserError(f"{spec}: ranks are numbered 0 .. {max(found)} but {listed} is missing")
    return len(found)


def rank_count(spec: str, ranks: int | None, what: str = "MODEL") -> int | None:
    """N for MODEL ``spec``: the files found (``ranks`` must agree), else ``ranks`` (None if
    neither says)."""
    if ranks is not None and ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {ranks}")
    found = ranks_found(spec)
    if found is not None and ranks is not None and found != ranks:
        raise UserError(
            f"--ranks {ranks}, but {what} {spec} has {found} rank file(s) ({rank_path(spec, 0)} .. "
            f"{rank_path(spec, found - 1)}); leave --ranks out to run them all"
        )
    if not is_pattern(spec) and not os.path.isdir(spec) and not os.path.isfile(spec):
        raise UserError(
            f"{what} {spec} does not exist (give a model file, a folder of rank{{r}}.onnx, or a path with {{r}})"
        )
    return found if found is not None else ranks


def output_pairs(source: str, target: str) -> list[tuple[str, str]]:
    """(input file, output file) of each rank for ``convert`` / ``lower``: IN one file and OUT
    one file (or a folder, existing or written with a trailing slash: ``OUT/<IN's file
    name>``), or IN of N ranks and OUT a folder (``OUT/rank{r}.onnx``, made if missing) or a
    path with ``{r}``."""
    count = ranks_found(source)
    if count is None:
        if is_pattern(target):
            raise UserError(f"OUT {target} has {{r}}, but IN {source} is one model file")
        if target.endswith(("/", os.sep)) or os.path.isdir(target):  # a folder: OUT/<IN's file name>
            return [(source, os.path.join(target, os.path.basename(source)))]
        return [(source, target)]
    if is_pattern(target):
        outputs = [rank_path(target, r) for r in range(count)]
    else:
        if os.path.lexists(target) and not os.path.isdir(target):
            raise UserError(
                f"OUT {target} is a file, but IN {source} holds {count} rank models: "
                "give a folder (made if missing) or a path with {r}"
            )
        outputs = [os.path.join(target, f"rank{r}.onnx") for r in range(count)]
    return [(rank_path(source, r), out) for r, out in enumerate(outputs)]


# --- outputs ------------------------------------------------------------------------------


def _creatable(folder: str, option: str) -> None:
    """``folder`` exists as a writable folder or can be made (its nearest existing parent is
    a writable folder)."""
    folder = os.path.abspath(folder or ".")
    probe = folder
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        if probe == folder:
            raise UserError(f"{option}: {folder} is a file, not a folder to write into")
        raise UserError(f"{option}: {probe} is a file, so the folder {folder} cannot be made")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{option}: folder {probe} is not writable")


def check_output_file(path: str, option: str) -> None:
    """A file the command will write at the end: not a folder, in a folder that exists or can
    be made. Checked before any work."""
    if os.path.isdir(path):
        raise UserError(f"{option} {path} exists and is not a file: it is a folder")
    if os.path.lexists(path) and not (os.path.isfile(path) or os.path.islink(path)):
        raise UserError(f"{option} {path} exists and is not a file")
    _creatable(os.path.dirname(os.path.abspath(path)), option)


def check_output_folder(path: str, option: str) -> None:
    """A folder the command will write files into: an existing folder, or one it can make."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{option} {path} exists and is not a folder")
    _creatable(path, option)


def make_parent(path: str) -> None:
    """Make the folder ``path`` goes into (checked earlier by :func:`check_output_file`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
