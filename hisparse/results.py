"""Long-format result rows (DESIGN section 9): one row per (configuration, metric).

Every row carries the GPU, software versions, commit and timestamp, so a number can be traced to
what made it. Appends never rewrite rows already stored: a failed run leaves the file as it was,
and rows that bring new columns rewrite the file under the widened header, the old rows' values
as they were (empty in the new columns).

Where rows go: every command that writes them (the sweep, the benchmarks, the HTTP load client)
writes to `DEFAULT_OUT` (out/, which git ignores) unless told `--out results`, the committed
results the README's tables cite; those hold GPU rows only (and the policy study's simulation,
which runs on the host), so CPU rows of a timed bench are refused there (`check_out_folder`,
before the run, and `append_rows`).
"""
from __future__ import annotations

import codecs
import csv
import datetime as _dt
import errno
import io
import os
import secrets
import stat
import subprocess
import warnings
from pathlib import Path

import pandas as pd
import torch
import triton

try:                        # appends from several processes to one folder take turns (POSIX)
    import fcntl
except ImportError:         # pragma: no cover - Windows: no lock
    fcntl = None

COLUMNS = [
    "bench", "family", "mode", "batch", "context", "k", "cache_slots", "unit_bytes",
    "metric", "value", "unit", "gpu", "torch", "triton", "commit", "timestamp",
]
REQUIRED = ("bench", "metric", "value", "unit")          # what every row and every results file has
STAMPS = ("gpu", "torch", "triton", "commit", "timestamp")  # where and with what: set here, or all by an imported row


PACKAGE_ROOT = Path(__file__).resolve().parent.parent     # the checkout holding hisparse/
COMMITTED_RESULTS = PACKAGE_ROOT / "results"               # the rows the README cites: GPU rows only
DEFAULT_OUT = "out"                                        # where runs write unless told: git ignores /out/
HOST_BENCHES = ("policies", "newest_token")  # the policy study's simulations, run on the host wherever:
                                                # their committed rows say cpu
OUT_HELP = (f"folder for the result CSVs (default: {DEFAULT_OUT}/, which git ignores; --out results appends to the "
            f"committed results, GPU rows only)")


def current_commit(root: Path = PACKAGE_ROOT) -> str:
    """The commit that made a result: $HISPARSE_COMMIT (set where no .git travels, or an older one
    does: the GPU machine's copy of the working tree), else this package's git checkout, with
    "-dirty" where its code differs from that commit (tracked files, or new .py / .toml files; the
    results folder, which runs write to, left out). "unknown" outside a checkout of its own (an
    installed or unpacked copy, or one inside another project's repository), with a warning."""
    if os.environ.get("HISPARSE_COMMIT"):
        return os.environ["HISPARSE_COMMIT"]
    root = Path(root).resolve()

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            raise ValueError("the git checkout around this package is another project's")
        sha = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=all", "--", ".", ":(exclude)results")
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        warnings.warn(f"results are stamped commit 'unknown': {root} is not a git checkout of hisparse ({exc}); "
                      f"set HISPARSE_COMMIT to the commit this copy came from", RuntimeWarning, stacklevel=3)
        return "unknown"
    code = [line for line in changed.splitlines() if not line.startswith("??") or line.endswith((".py", ".toml"))]
    return sha + ("-dirty" if code else "")


def environment() -> dict:
    """The columns that say where and with what a row was measured."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": current_commit(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def is_committed_results(out: str | os.PathLike) -> bool:
    """Whether `out` is this checkout's results/ folder (the committed rows)."""
    return Path(out).resolve() == COMMITTED_RESULTS.resolve()


def out_note(out: str | os.PathLike) -> str:
    """What a run prints beside its --out: the committed results, or a folder git ignores (out/ of
    this checkout, or anything in it), or nothing."""
    folder = Path(out).resolve()
    if is_committed_results(folder):
        return " (the committed results)"
    ignored = (PACKAGE_ROOT / DEFAULT_OUT).resolve()
    return " (git ignores it)" if folder == ignored or ignored in folder.parents else ""


def cpu_rows_refused(out: str | os.PathLike, gpu: str, bench: str = "") -> str | None:
    """Why rows measured on `gpu` ("cpu": none) of `bench` may not go to `out`, or None: CPU rows
    of a timed bench never mix into the committed GPU results."""
    if gpu != "cpu" or bench in HOST_BENCHES or not is_committed_results(out):
        return None
    return (f"--out {out} is the committed results, which hold GPU rows only (the README's tables cite them), and "
            f"these {bench + ' ' if bench else ''}rows come from a machine without a GPU: write them to another "
            f"--out (default {DEFAULT_OUT}/, which git ignores)")


def check_out_folder(parser, out: str | os.PathLike, host_only: bool = False) -> None:
    """Before any work: an --out that exists as a file (not a folder for result CSVs) is the
    parser's error, not a failure at the first write after the run; so is the committed results
    folder on a machine without a GPU (`cpu_rows_refused`), unless the run is a host-only study.
    Then it says where the rows go (a run that writes none, a --tune, says it all the same)."""
    if Path(out).exists() and not Path(out).is_dir():
        parser.error(f"--out {out} is a file, not a folder for the result CSVs")
    why = None if host_only else cpu_rows_refused(out, "cuda" if torch.cuda.is_available() else "cpu")
    if why:
        parser.error(why)
    print(f"result rows go to {Path(out)}/{out_note(out)}", flush=True)


class NotResultsCSV(ValueError):
    """A file that is not a results CSV: its `path` and `problem`, what is wrong with it."""

    def __init__(self, path: str | os.PathLike, problem: str, advice: str = ""):
        super().__init__(f"{path} is not a results CSV: {problem}{advice}")
        self.path, self.problem = str(path), problem


def stored_table(path: str | os.PathLike) -> tuple[list[str], dict[int, list[str]], bool]:
    """The header, the rows by the line each starts on (blank lines left out) and whether the file
    starts with a UTF-8 byte-order mark (as spreadsheets save "CSV UTF-8"; read past, and kept), of
    the results CSV at `path`, as text; NotResultsCSV where it is not one (not UTF-8 text; no header
    naming bench, metric, value and unit; an empty or repeated column name; a row with more or fewer
    fields than the header). The appends' checks, which experiments.figures makes too."""
    data = Path(path).read_bytes()
    bom = data.startswith(codecs.BOM_UTF8)
    try:
        text = data[len(codecs.BOM_UTF8) if bom else 0:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start + (len(codecs.BOM_UTF8) if bom else 0)
        raise NotResultsCSV(path, f"it is not UTF-8 text (byte {data[at]:#04x} at offset {at})") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows, line = {}, 0
    try:
        for row in reader:
            if row:
                rows[line + 1] = row
            line = reader.line_num
    except csv.Error as exc:
        raise NotResultsCSV(path, f"line {reader.line_num}: {exc}") from None
    if not rows:
        return [], {}, bom
    (_, header), *body = rows.items()
    body = dict(body)
    problems = []
    if set(REQUIRED) - set(header):
        problems.append(f"its header {header[:6]}{'...' if len(header) > 6 else ''} lacks "
                        f"{sorted(set(REQUIRED) - set(header))}")
    if any(not name for name in header) or len(set(header)) < len(header):
        problems.append("its header has an empty or repeated column name")
    ragged = [line for line, row in body.items() if len(row) != len(header)]
    if ragged:
        problems.append(f"line {ragged[0]} has {len(body[ragged[0]])} fields, the header {len(header)}"
                        + (f" ({len(ragged)} such lines)" if len(ragged) > 1 else ""))
    if problems:
        raise NotResultsCSV(path, "; ".join(problems))
    return header, body, bom


def read_stored_rows(path: Path) -> pd.DataFrame:
    """The rows already in the results CSV at `path`, every value as its text, indexed by the line
    each starts on; a file that is not one (`stored_table`) is refused by name (NotResultsCSV, a
    ValueError), so that no append rewrites it."""
    return _read_stored(path)[0]


def _read_stored(path: Path) -> tuple[pd.DataFrame, bool]:
    """`read_stored_rows` and whether the file starts with a byte-order mark."""
    try:
        header, body, bom = stored_table(path)
    except NotResultsCSV as exc:
        raise NotResultsCSV(path, exc.problem, ". Nothing was written; move it aside or fix it.") from None
    if not header:
        return pd.DataFrame(columns=COLUMNS), bom
    return pd.DataFrame(list(body.values()), columns=header, index=list(body)), bom


def append_rows(path: str | os.PathLike, rows: list[dict]) -> pd.DataFrame:
    """Append `rows` (dicts with at least bench, metric, value, unit) to the CSV at `path`.

    Missing standard columns are left empty and the environment columns are filled in, unless a row
    brings all of its own (rows measured elsewhere, copied here: gpu, torch, triton, commit and
    timestamp, none empty); extra parameter columns are kept, new ones after the file's own. The
    file is rewritten through a temporary file and a rename (rows bringing new columns: under the
    union header, every old row's fields as they were and empty in the new columns), under a lock on its folder, so an
    interrupted write never truncates the rows already there and concurrent appends lose none; the
    file keeps its mode (and a byte-order mark), and a symlink's target is written, the link kept.
    (A file with other hard links is replaced under this name only; its owner becomes the writer.)
    """
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise TypeError(f"rows: expected a list of dicts (one per row), got {type(rows).__name__}"
                        + (f" of {sorted({type(r).__name__ for r in rows})}" if isinstance(rows, list) else ""))
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    for row in rows:
        missing = set(REQUIRED) - row.keys()
        if missing:
            raise ValueError(f"result row {row} lacks the columns {sorted(missing)}")
        bad = [key for key in row if not isinstance(key, str) or not key.strip()]
        if bad:
            raise ValueError(f"result row {row} has the column name {bad[0]!r}: expected a non-empty string")
        stamped = [key for key in STAMPS if key in row]
        if stamped and (len(stamped) < len(STAMPS) or any(pd.isna(row[k]) or row[k] == "" for k in STAMPS)):
            raise ValueError(f"result row {row} sets {stamped}: a row brings all of {list(STAMPS)}, none empty "
                             f"(copied from where it was measured), or none (stamped here)")
    env = environment()
    new = pd.DataFrame([{**env, **row} for row in rows])
    path = Path(path)
    for row in rows:
        why = cpu_rows_refused(path.parent, row.get("gpu", env["gpu"]), str(row["bench"]))
        if why:
            raise ValueError(f"{why}; nothing was written to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    target = Path(os.path.realpath(path))        # through a symlink to its target: the link stays a link
    if target.is_symlink():
        raise OSError(errno.ELOOP, "a loop of symlinks, not a results CSV; nothing was written", str(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        if fcntl is not None:
            fcntl.flock(folder, fcntl.LOCK_EX)
        # old rows as the text they are, so a rewrite never reformats them (4096 -> 4096.0)
        old, bom = _read_stored(target) if target.exists() else (pd.DataFrame(columns=COLUMNS), False)
        ordered = list(dict.fromkeys([*old.columns, *COLUMNS, *new.columns]))   # the file's own order first
        frame = pd.concat([old, new], ignore_index=True) if len(old) else new
        frame = frame.reindex(columns=ordered)
        fd, tmp = _temporary_beside(target)
        try:
            with os.fdopen(fd, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
                frame.to_csv(f, index=False)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    finally:
        os.close(folder)                  # and the lock with it
    return new.reindex(columns=ordered)


def _temporary_beside(target: Path) -> tuple[int, Path]:
    """A new file in `target`'s folder (for a rename over it) with the mode `target` has, or where
    there is none yet the mode open() would give it (0666 less the umask), not mkstemp's 0600."""
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if mode is not None else 0o666)
        except FileExistsError:
            continue
        try:
            if mode is not None:
                os.chmod(tmp, mode)           # not masked by the umask, as the mode given to os.open is
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return fd, tmp
    raise FileExistsError(f"no free temporary name beside {target}")
