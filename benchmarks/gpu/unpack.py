"""Unpack .gpu-carry/ (made by prepare.sh) on the machine that runs run.sh, with Python's own lzma
and tarfile (no xz binary needed there).

    python3 benchmarks/gpu/unpack.py --carry .gpu-carry --work /tmp/fedpower-gpu [--site /tmp/site]

--site DIR   unpack site-cp312.tar.xz (the carried Python packages) into DIR
--work DIR   unpack minilm-fp16/ into DIR/minilm-fp16 (its checksum checked) and SST-2.tar.xz into DIR/SST-2
Each part that is absent from the carry folder is reported and skipped; a bad checksum fails.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import shutil
import sys
import tarfile
import time
from pathlib import Path


def _extract(archive: Path, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = tar.getmembers()
        tar.extractall(dest, filter="tar")
    return len(members)


def unpack_model(folder: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("model.safetensors.xz", "SHA256"):
            shutil.copy(f, dest / f.name)
    digest = hashlib.sha256()
    with lzma.open(folder / "model.safetensors.xz") as src, open(dest / "model.safetensors", "wb") as out:
        while chunk := src.read(1 << 22):
            digest.update(chunk)
            out.write(chunk)
    expected = (folder / "SHA256").read_text().split()[0]
    if digest.hexdigest() != expected:
        raise SystemExit(f"unpack: {dest / 'model.safetensors'} has sha256 {digest.hexdigest()}, expected {expected}")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--carry", default=".gpu-carry")
    ap.add_argument("--work", required=True)
    ap.add_argument("--site", default="")
    a = ap.parse_args(argv)
    carry, work = Path(a.carry), Path(a.work)
    if not carry.is_dir():
        print(f"unpack: no {carry}/ (run benchmarks/gpu/prepare.sh and carry it)", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    if a.site:
        site = carry / "site-cp312.tar.xz"
        if not site.is_file():
            print(f"unpack: {site} is missing", file=sys.stderr)
            return 1
        n = _extract(site, Path(a.site))
        print(f"unpack: {n} files of the carried packages into {a.site} ({time.perf_counter() - t0:.1f} s)")
    model = carry / "minilm-fp16"
    if (model / "model.safetensors.xz").is_file():
        dest = unpack_model(model, work / "minilm-fp16")
        print(f"unpack: MiniLM in float16 at {dest} (sha256 ok; {time.perf_counter() - t0:.1f} s)")
    else:
        print(f"unpack: no {model}/model.safetensors.xz: the run uses model.name = minilm")
    data = carry / "SST-2.tar.xz"
    if data.is_file():
        if (work / "SST-2").exists():
            shutil.rmtree(work / "SST-2")
        _extract(data, work)
        lines = sum(1 for _ in open(work / "SST-2" / "train.tsv", encoding="utf-8"))
        print(f"unpack: SST-2 at {work / 'SST-2'} ({lines} train lines; {time.perf_counter() - t0:.1f} s)")
    else:
        print(f"unpack: no {data}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
