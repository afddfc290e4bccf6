"""Download CIFAR-10: fetch ``cifar-10-python.tar.gz`` over http(s) or from a file URL,
check its md5, extract it safely (regular files with in-tree names only) and move a
complete ``cifar-10-batches-py`` into place with one rename, so an interrupted download
never leaves a partial folder behind. `data.load_cifar10` calls it when the folder is
missing; the environment variables below point it at a mirror or a local archive. A
download that fails leaves nothing behind, not even the --data-dir folder it created.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import socket
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from vit_pure.errors import DataError, one_line

FOLDER = "cifar-10-batches-py"  # what the archive holds, and what the reader opens
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
HOW_TO_PROVIDE = (
    "pass --data-dir DIR where DIR/cifar-10-batches-py/ exists (torchvision's "
    "torchvision.datasets.CIFAR10(DIR, download=True) writes that folder), "
    "or run without it with --dataset synthetic"
)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
URL_ENV = "VIT_PURE_CIFAR10_URL"   # overrides CIFAR10_URL when no url= is given
MD5_ENV = "VIT_PURE_CIFAR10_MD5"   # overrides CIFAR10_MD5 when no md5= is given
NET_TIMEOUT_S = 10.0               # per socket operation (connect, each read)



def _resolve(host: str, port: int, timeout: float) -> None:
    """getaddrinfo with a deadline (the socket timeout does not cover DNS)."""
    result: list = []

    def lookup():
        try:
            socket.getaddrinfo(host, port)
            result.append(None)
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise OSError(f"DNS lookup of {host} timed out after {timeout:.0f} s")
    if result[0] is not None:
        raise result[0]


def download_cifar10(data_dir, *, url: str | None = None, md5: str | None = None,
                     log: Callable[[str], None] = print,
                     timeout: float | None = None) -> pathlib.Path:
    """Download, md5-check and extract ``cifar-10-python.tar.gz`` into data_dir.

    Everything happens in a temporary folder inside data_dir; only a complete,
    verified ``cifar-10-batches-py`` is moved into place (one os.rename), and the
    temporary folder is removed whatever happens. Returns the final folder.
    timeout (default NET_TIMEOUT_S) bounds the DNS lookup and each socket operation.
    """
    timeout = NET_TIMEOUT_S if timeout is None else timeout
    url = url or os.environ.get(URL_ENV) or CIFAR10_URL
    md5 = (md5 or os.environ.get(MD5_ENV) or CIFAR10_MD5).lower()
    data_dir = pathlib.Path(data_dir).expanduser()
    final = data_dir / FOLDER
    created = _first_missing(data_dir)  # removed again, with what it holds, if this fails
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create --data-dir {data_dir}: {e.strerror or e}") from None
    try:
        return _download_into(data_dir, final, url, md5, log, timeout)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def _first_missing(path: pathlib.Path) -> pathlib.Path | None:
    """The outermost folder of `path` that does not exist yet (None: it all exists)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _download_into(data_dir: pathlib.Path, final: pathlib.Path, url: str, md5: str, log,
                   timeout: float) -> pathlib.Path:
    try:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".cifar10-download-", dir=data_dir))
    except OSError as e:
        raise DataError(f"cannot write in --data-dir {data_dir}: {e.strerror or e}") from None
    try:
        archive = tmp / "cifar-10-python.tar.gz"
        got = _fetch(url, archive, log, timeout, f"CIFAR-10 not found at {final}; ")
        if got != md5:
            raise DataError(f"md5 mismatch for {url}: got {got}, expected {md5} "
                            f"(corrupt or different file; nothing was kept)")
        log(f"md5 ok ({got}); extracting")
        extracted = tmp / "extract"
        _safe_extract(archive, extracted, url)
        src = _find_folder_in(extracted)
        if src is None:
            raise DataError(f"archive from {url} has no {FOLDER}/ folder")
        missing = [f for f in (*TRAIN_FILES, TEST_FILE) if not (src / f).is_file()]
        if missing:
            raise DataError(f"archive from {url} lacks {FOLDER}/{missing[0]}")
        try:
            os.rename(src, final)
        except OSError as e:
            if not final.is_dir():  # a concurrent run may have put it there first
                raise DataError(f"cannot move the extracted data to {final}: "
                                f"{e.strerror or e}") from None
        log(f"CIFAR-10 ready at {final}")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fetch(url: str, dest: pathlib.Path, log, timeout: float, why: str = "") -> str:
    """Stream url to dest, printing progress once the server answers (`why` first); return
    the md5 hex digest. A failure is one line: the cause, and what to do without a network."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https", "file"):
        raise DataError(f"unsupported download URL {url!r} (use http, https or file)")
    h = hashlib.md5()
    try:
        if parsed.hostname:
            port = parsed.port or (80 if parsed.scheme == "http" else 443)
            _resolve(parsed.hostname, port, timeout)
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(dest, "wb") as f:
            total = int(resp.headers.get("Content-Length") or 0)
            size = f" ({total / 1e6:.1f} MB, once)" if total else ""
            log(f"{why}downloading {url}{size}")
            done, next_report, t0 = 0, 0.25, time.monotonic()
            while chunk := resp.read(1 << 20):
                f.write(chunk)
                h.update(chunk)
                done += len(chunk)
                if total and done / total >= next_report:
                    log(f"  {done / 1e6:.1f} / {total / 1e6:.1f} MB "
                        f"({done / total:.0%}, {time.monotonic() - t0:.0f} s)")
                    next_report += 0.25
    except DataError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(f"{why}could not download it from {url} ({one_line(reason)}); "
                        f"without a network, {HOW_TO_PROVIDE}") from None
    if total and done != total:
        raise DataError(f"download from {url} ended early ({done} of {total} bytes); try again")
    return h.hexdigest()


def _safe_extract(archive: pathlib.Path, dest: pathlib.Path, url: str) -> None:
    """Extract only regular files and folders with relative, in-tree names."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            for m in members:
                parts = pathlib.PurePosixPath(m.name).parts
                if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                    raise DataError(f"archive from {url} has an unsafe entry {m.name!r}")
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **kwargs)
    except DataError:
        raise
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"cannot extract the archive from {url}: {one_line(e)}") from None


def _find_folder_in(root: pathlib.Path) -> pathlib.Path | None:
    for p in [root / FOLDER, *root.glob(f"*/{FOLDER}")]:
        if p.is_dir():
            return p
    return None
