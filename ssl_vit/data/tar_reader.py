"""Tar members of a shard: webdataset's URL opener and key grouping around a tar header parser of our
own (`tar_files`; the docstring there says why it is not `tarfile`)."""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterable, Iterator
from functools import partial

from webdataset.tariterators import group_by_keys, url_opener


def tar_samples(handler: Callable[[Exception], bool]) -> list:
    """Stages: shard URLs -> samples `{"__key__", "__url__", ext: bytes ...}`, as webdataset's
    `tarfile_to_samples` (its URL opener and its grouping of members by key), with the tar headers
    parsed by `tar_files` instead of Python's `tarfile`."""
    return [
        partial(url_opener, handler=handler),
        partial(tar_file_members, handler=handler),
        partial(group_by_keys, handler=handler),
    ]


def tar_file_members(sources: Iterable[dict], handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """webdataset's `tar_file_expander`: opened shards -> `{"fname", "data", "__url__"}` per member,
    `{}` at the end of each shard (so that `group_by_keys` never joins samples across shards)."""
    for source in sources:
        stream, url = source["stream"], source["url"]
        try:
            for fname, data in tar_files(stream):
                yield {"fname": fname, "data": data, "__url__": url}
            yield {}
        except Exception as exn:
            exn.args = (*exn.args, url)
            if not handler(exn):
                break
        finally:
            stream.close()


def _octal(field: bytes) -> int:
    if field[0] & 0x80:  # GNU base-256 for values that do not fit in octal
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def tar_files(stream) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file of a tar stream (ustar, pax and GNU long names).

    Hand-written rather than `tarfile.open(mode="r|")` as webdataset does: `tarfile` spends about
    0.2 ms per sample (two members, each with a pax header as `webdataset.TarWriter` writes them) in
    Python header parsing, 10-15% of decoding and cropping an ImageNet-sized JPEG, which is what
    `ssl-vit bench data` measures; this reads each header with one slice per field. Like webdataset,
    it skips names whose first component is `__...__` (metadata)."""
    pax: dict[bytes, bytes] = {}
    long_name = None
    while True:
        header = stream.read(512)
        if not header or header == _ZERO_BLOCK:  # end of archive (or of a stream without end blocks)
            return
        if len(header) < 512:
            raise tarfile.ReadError("unexpected end of data in a tar header")
        if _octal(header[148:156]) != sum(header[:148]) + 256 + sum(header[156:]):  # chksum as spaces
            raise tarfile.ReadError("bad tar header checksum")
        kind = header[156:157]
        size = int(pax[b"size"]) if b"size" in pax and kind not in _META_KINDS else _octal(header[124:136])
        data = stream.read(size)
        if len(data) < size:
            raise tarfile.ReadError("unexpected end of data in a tar member")
        stream.read(-size % 512)
        if kind == b"x":  # pax extended header of the next member: "LEN key=value\n" records
            pax = {}
            pos = 0
            while pos < len(data):
                space = data.index(b" ", pos)
                end = pos + int(data[pos:space])
                key, _, value = data[space + 1 : end - 1].partition(b"=")
                pax[key] = value
                pos = end
            continue
        if kind == b"L":  # GNU long name of the next member
            long_name = data.rstrip(b"\0")
            continue
        if kind in (b"0", b"\0", b"7"):  # regular files (7: contiguous, read as regular by tarfile)
            name = header[:100].rstrip(b"\0")
            if header[257:262] == b"ustar" and header[345] != 0:
                name = header[345:500].rstrip(b"\0") + b"/" + name
            name = pax.get(b"path", long_name or name).decode("utf-8", "surrogateescape")
            first = name.split("/", 1)[0]
            if not (first.startswith("__") and first.endswith("__") and len(first) >= 4):
                yield name, data
        pax, long_name = {}, None  # they describe one member only (global pax headers, "g", are ignored)


_ZERO_BLOCK = bytes(512)
_META_KINDS = (b"x", b"g", b"L")
