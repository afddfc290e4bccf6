"""A URL given to --init-from: fetched once into a cache folder, then read from there.

The cache is $VIT_PURE_WEIGHTS_CACHE, else ~/.cache/vit_pure/weights; each URL gets a
file named by its address's hash and its own file name, written to a temporary name and
renamed when complete, so an interrupted download leaves nothing that looks finished. A
Hugging Face or timm file (model.safetensors) brings its config.json and
preprocessor_config.json from beside it, where there are such files. No network: one line
saying so, and that a local path works as well.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import urllib.error
import urllib.parse
import urllib.request

from vit_pure.errors import WeightsError, one_line

CACHE_ENV = "VIT_PURE_WEIGHTS_CACHE"
TIMEOUT_S = 20.0
SIDECARS = ("config.json", "preprocessor_config.json")  # beside a model.safetensors


def is_url(text: str) -> bool:
    return urllib.parse.urlparse(str(text)).scheme in ("http", "https", "file")


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_ENV) or
                        pathlib.Path.home() / ".cache" / "vit_pure" / "weights")


def local_path(url: str, log=print) -> pathlib.Path:
    """The cached copy of `url`, fetched first if it is not there yet."""
    name = pathlib.PurePosixPath(urllib.parse.urlparse(url).path).name or "weights"
    folder = cache_dir() / hashlib.sha256(url.encode()).hexdigest()[:16]
    target = folder / name
    if target.is_file():
        return target
    created = [d for d in (folder, *folder.parents) if not d.exists()]  # innermost first
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WeightsError(f"cannot create the weights cache {folder}: {e.strerror or e}") from None
    log(f"fetching {url} into {folder}")
    try:
        _download(url, target, required=True)
    except WeightsError:
        for d in created:  # no empty cache folder left behind by a failed fetch
            try:
                d.rmdir()
            except OSError:  # not empty (another fetch wrote there meanwhile): kept
                break
        raise
    if name.endswith(".safetensors"):
        for sidecar in SIDECARS:
            _download(urllib.parse.urljoin(url, sidecar), folder / sidecar, required=False)
    return target


def _download(url: str, target: pathlib.Path, required: bool) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp, open(tmp, "wb") as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError, ValueError) as e:
        tmp.unlink(missing_ok=True)
        if required:
            reason = getattr(e, "reason", None) or e
            raise WeightsError(f"cannot fetch {url} ({one_line(reason)}); download it where "
                               f"there is a network and pass --init-from the local path") from None
