#!/usr/bin/env python3
"""unpack_debs.py: unpacks .deb files into a prefix without dpkg, root or network.

    unpack_debs.py PREFIX DEB...

A .deb is an ar archive holding control.tar.* and data.tar.{xz,gz,zst,bz2}; the data tarball's
files land under PREFIX (e.g. PREFIX/usr/include/zmq.h). Python's standard library reads ar (by
hand, below), xz, gz and bz2; zstd-compressed data needs the `zstd` program. Members that would
leave PREFIX (absolute paths, "..", links pointing outside) are refused. tools/gpu-check.sh uses
it for the dependencies listed in tools/gpu/debs.txt.
"""
import io
import os
import shutil
import subprocess
import sys
import tarfile


def ar_members(path):
    """Yields (name, bytes) of each member of an ar archive."""
    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{path}: not an ar archive (a .deb starts with !<arch>)")
        while True:
            header = f.read(60)
            if not header:
                return
            if len(header) < 60:
                raise ValueError(f"{path}: truncated ar header")
            name = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            data = f.read(size)
            if size % 2:
                f.read(1)
            yield name, data


def open_data_tar(name, data):
    if name.endswith(".zst"):
        if not shutil.which("zstd"):
            raise RuntimeError(f"{name} is zstd-compressed: install the zstd program or fetch xz-compressed .debs")
        data = subprocess.run(["zstd", "-dc"], input=data, stdout=subprocess.PIPE, check=True).stdout
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")


def inside(prefix, path):
    prefix = os.path.realpath(prefix)
    return os.path.commonpath([prefix, os.path.realpath(path)]) == prefix


def unpack(deb, prefix):
    count = 0
    for name, data in ar_members(deb):
        if not name.startswith("data.tar"):
            continue
        with open_data_tar(name, data) as tar:
            for m in tar.getmembers():
                target = os.path.join(prefix, m.name)
                if os.path.isabs(m.name) or ".." in m.name.split("/") or not inside(prefix, target):
                    raise ValueError(f"{deb}: member {m.name} would leave {prefix}")
                if m.issym():
                    link = m.linkname if os.path.isabs(m.linkname) else os.path.join(os.path.dirname(target), m.linkname)
                    link = os.path.join(prefix, link.lstrip("/")) if os.path.isabs(m.linkname) else link
                    if not inside(prefix, link):
                        raise ValueError(f"{deb}: link {m.name} -> {m.linkname} leaves {prefix}")
                    # Absolute links inside the package (e.g. /usr/lib/...) point into PREFIX.
                    if os.path.isabs(m.linkname):
                        m.linkname = os.path.relpath(link, os.path.dirname(target))
                if m.isdir():
                    os.makedirs(target, exist_ok=True)
                    continue
                if m.isfile() or m.issym():
                    if os.path.lexists(target):
                        os.remove(target)
                    tar.extract(m, prefix, set_attrs=False)
                    count += 1
        return count
    raise ValueError(f"{deb}: no data.tar member")


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    prefix = os.path.abspath(argv[1])
    os.makedirs(prefix, exist_ok=True)
    total = 0
    for deb in argv[2:]:
        try:
            total += unpack(deb, prefix)
        except (ValueError, RuntimeError, tarfile.TarError) as e:
            print(f"unpack_debs: {e}", file=sys.stderr)
            return 1
    print(f"unpack_debs: {len(argv) - 2} packages, {total} files into {prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
