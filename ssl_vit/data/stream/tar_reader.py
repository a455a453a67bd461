"""Tar members of a shard: an opener (`ssl_vit.storage.remote`: retries and a read timeout for remote
URLs, also installed as webdataset's `gopen` for those schemes) and webdataset's key grouping around a
tar header parser of our own (`tar_files`; the docstring there says why it is not `tarfile`)."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import tarfile
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from urllib.parse import urlparse

from webdataset.gopen import gopen, gopen_curl, gopen_pipe, gopen_schemes
from webdataset.tariterators import base_plus_ext, group_by_keys

from ssl_vit.data.format.members import IMAGE_MEMBERS, LABEL_MEMBERS
from ssl_vit.storage.remote import DEFAULT, ReadPolicy, open_url

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_CHUNK = 1 << 24  # largest single read: a size field that lies costs at most this much memory up front
_REGULAR = (b"0", b"\0", b"7")  # 7: contiguous file, a regular file for tarfile and GNU tar
_NO_DATA = b"123456"  # links, devices, directories, fifos: tarfile ignores their size field
_LINKS = (b"1", b"2")  # hard, symbolic
_PAX = (b"x", b"X", b"g")  # X: Solaris' name for x
_META = (*_PAX, b"L", b"K")  # headers that describe the member after them
_RECENT = 256  # member names kept to judge the sample in progress at a break: far more than a sample has


class GzipTarError(tarfile.ReadError):
    """A gzip-compressed shard that breaks off. Its data is vouched for only by the CRC at the end of
    the stream, so the member read last may hold what a damaged stream decompressed to."""


def tar_samples(
    handler: Callable[[Exception], bool], policy: ReadPolicy = DEFAULT, max_member_bytes: int | None = None
) -> list:
    """Stages: shard URLs -> samples `{"__key__", "__url__", ext: bytes ...}`, as webdataset's
    `tarfile_to_samples` (a URL opener and its grouping of members by key), with remote shards read
    with `policy` (`ssl_vit.storage.remote`) and the tar headers parsed by `tar_files` instead of Python's
    `tarfile`. A member larger than `max_member_bytes` (None: no limit) is passed over unread, and its
    sample skipped and counted (`OversizeMember`)."""
    return [
        # a handler that tells shards it could not open from broken samples (`SkipCounter.shard_failed`)
        partial(url_opener, handler=getattr(handler, "shard_failed", handler), policy=policy),
        partial(tar_file_members, handler=handler, max_member_bytes=max_member_bytes),
        partial(group_by_keys, handler=handler),
    ]


def url_opener(
    sources: Iterable[dict], handler: Callable[[Exception], bool], policy: ReadPolicy = DEFAULT
) -> Iterator[dict]:
    """Stage: `{"url"}` -> `{"url", "stream"}`, as webdataset's `url_opener`, remote URLs opened with
    `policy`; an error (after the tries) goes to `handler` with the URL, as there. Not webdataset's own:
    it passes its keyword arguments to every scheme's opener, and its own (`ais:`, `hf:`, ...) take
    none; the other schemes are opened by webdataset's `gopen`."""
    for source in sources:
        url = source["url"]
        try:
            stream = open_url(url, policy) if _ours(url) else gopen(url)
        except Exception as exn:
            exn.args = (*exn.args, url)
            if handler(exn):
                continue
            break
        yield {**source, "stream": stream}


def _ours(url: str) -> bool:
    scheme = urlparse(url).scheme
    return scheme in ("http", "https", "pipe") or gopen_schemes.get(scheme) is _gopen_fsspec


def _gopen_fsspec(url, mode="rb", bufsize=8192, **kw):
    """Open `s3://`, `gs://`, ... through fsspec (webdataset 1.0's gopen has no fsspec fallback),
    with retries."""
    if mode != "rb":
        import fsspec

        return fsspec.open(url, mode).open()
    return open_url(url)


def _gopen(url, mode="rb", bufsize=8192, **kw):
    """webdataset's opener for `http(s)://` and `pipe:` reads: ours, with the default policy."""
    if mode != "rb":
        return (gopen_pipe if url.startswith("pipe:") else gopen_curl)(url, mode, bufsize)
    return open_url(url)


def install_openers() -> None:
    """Make webdataset's `gopen` (anything in this process that opens a URL through webdataset) read
    http(s), `pipe:` and fsspec URLs as `ssl_vit.storage.remote` does, with the default policy."""
    import fsspec

    for proto in fsspec.available_protocols():
        if proto not in gopen_schemes or proto == "gs":  # gs: fsspec (gcsfs), not the gsutil CLI
            gopen_schemes[proto] = _gopen_fsspec
    for scheme in ("http", "https", "pipe"):
        gopen_schemes[scheme] = _gopen


def tar_file_members(
    sources: Iterable[dict], handler: Callable[[Exception], bool], max_member_bytes: int | None = None
) -> Iterator[dict]:
    """webdataset's `tar_file_expander`: opened shards -> `{"fname", "data", "__url__"}` per member,
    `{}` at the end of each shard (so that `group_by_keys` never joins samples across shards).

    A shard that breaks off is one error for `handler`. Every member read before the break is whole
    (`tar_files` yields one only when its header passed the checksum and all its data came), so
    every sample before the last is too; the last, cut off where its next member would have come, is
    kept only when it holds all a sample needs (`_whole_at_break`), and otherwise dropped (a sample
    whose `.cls` is lost would pass as unlabelled). In a gzip-compressed shard it is always dropped
    (`GzipTarError`). Closing the stream is part of reading it: a `pipe:` command or any opener that
    reports a failure only when closed (webdataset's `Pipe` raises the command's exit status there)
    fails the shard the same way, once."""
    for source in sources:
        stream, url = source["stream"], source["url"]
        recent: deque[str] = deque(maxlen=_RECENT)
        dropped: list[DroppedMember] = []  # members `tar_files` passed over since the last one it gave
        unkeyed = None  # the name (less its extension) of the last member without a key, counted once
        try:
            for fname, data in tar_files(stream, dropped.append, max_member_bytes):
                if not (yield from _dropped(dropped, handler, url)):
                    return
                if base_plus_ext(fname)[0] is None and not _is_meta(fname):
                    if fname.rsplit(".", 1)[0] != unkeyed and not handler(
                        UnkeyedMember(f"member {fname!r} has", url)
                    ):
                        return
                    unkeyed = fname.rsplit(".", 1)[0]
                    continue  # group_by_keys would drop it without a word
                recent.append(fname)
                yield {"fname": fname, "data": data, "__url__": url}
            if not (yield from _dropped(dropped, handler, url)):
                return
            stream.close()
            yield {}
        except Exception as exn:
            exn.args = (*exn.args, url)
            if not handler(exn):
                break
            key = base_plus_ext(recent[-1])[0] if recent else None
            if key is not None and (isinstance(exn, GzipTarError) or not _whole_at_break(recent)):
                yield {"fname": f"{key}.__bad__", "data": True, "__url__": url}  # group_by_keys drops it
            yield {}
        finally:
            # after a failure (counted above) or when the reader stops early (nothing was lost)
            with contextlib.suppress(Exception):
                stream.close()


class DroppedMember(Exception):
    """A member of a shard that `tar_files` passes over instead of giving its data; its sample is
    skipped, and counted. `name` is the member's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message} (its sample is dropped)")
        self.name = name


class UnkeyedMember(Exception):
    """A member whose name gives no sample key (webdataset's: the name up to the first dot of its last
    component, which must not be empty: `.hidden.png`, `..\\w.png`, `README`); its sample is skipped, counted
    once."""

    def __init__(self, what: str, url: str) -> None:
        super().__init__(
            f"{what} no sample key (webdataset names members KEY.EXT, KEY not empty): skipped", url
        )


class LinkMember(DroppedMember):
    """A symbolic or hard link member (`name -> target`). Shards hold regular files only: a link's data
    is not in the shard (a symlink may point anywhere on the reader's machine)."""

    def __init__(self, name: str, target: str, symbolic: bool) -> None:
        super().__init__(name, f"a {'symbolic' if symbolic else 'hard'} link to {target!r}, not a file")


class OversizeMember(DroppedMember):
    """A regular member larger than the reader's limit, judged from its tar header: its data is read
    past in chunks and never held, so a shard of a few hundred KB that decompresses to a 400 MB member
    costs no memory."""

    def __init__(self, name: str, size: int, limit: int) -> None:
        message = f"{size:,} bytes, more than the {limit:,} an image within max_image_pixels takes"
        super().__init__(name, message)


def _dropped(dropped: list[DroppedMember], handler: Callable[[Exception], bool], url: str):
    """Each member in `dropped` (emptied) counted by `handler`, and its sample marked bad, so that
    `group_by_keys` drops it whole, before the member after it in the shard's order. Returns False
    when the handler says to stop."""
    while dropped:
        member = dropped.pop(0)
        member.args = (*member.args, url)
        if not handler(member):
            return False
        key = base_plus_ext(member.name)[0]
        if key is not None:
            yield {"fname": f"{key}.__bad__", "data": True, "__url__": url}
    return True


def _whole_at_break(names: deque[str]) -> bool:
    """Whether the sample of the last of `names` (the names of the last members read, a shard's
    first ones included unless the deque is full) is whole although its shard broke off after it: it
    holds an image and a label, all that is read of a sample, or at least the members of the sample
    before it (an unlabelled shard's image alone)."""
    pairs = [pair for pair in map(base_plus_ext, names) if pair[0] is not None]
    runs = [{ext.lower() for _, ext in run} for _, run in itertools.groupby(pairs, key=lambda pair: pair[0])]
    last = runs[-1]
    if not last.isdisjoint(IMAGE_MEMBERS) and not last.isdisjoint(LABEL_MEMBERS):
        return True
    # the sample before is known whole when a third key precedes it, or nothing was pushed out
    before_known = len(runs) >= 3 or (len(runs) == 2 and len(names) < _RECENT)
    return before_known and last >= runs[-2]


def tar_files(
    stream,
    on_dropped: Callable[[DroppedMember], None] | None = None,
    max_member_bytes: int | None = None,
) -> Iterator[tuple[str, bytes]]:
    """Yields `(name, bytes)` for each regular file of a tar stream (ustar, pax and GNU headers, plain
    or gzip-compressed), in order; raises `tarfile.ReadError` for anything malformed or cut short.
    Symbolic and hard link members, and regular members of more than `max_member_bytes` (read past,
    never held), are passed to `on_dropped` as they come instead of being dropped without a word; other
    members that hold no file (directories, devices, fifos) are skipped.

    Hand-written rather than `tarfile.open(mode="r|")` as webdataset does: `tarfile` spends about
    0.12 ms per sample (two members, each with a pax header as `webdataset.TarWriter` writes them) in
    Python header parsing, 7-9% of decoding and cropping an ImageNet-sized JPEG, which is what
    `ssl-vit bench data` measures; this reads each header with one slice per field it uses and sums
    the checksum in C, about 0.011 ms per sample (11x less). Like webdataset, it skips names whose
    first component is `__...__` (metadata).

    Headers are read as `tarfile` reads them (numbers, names, pax records, global pax headers, which
    types carry data), so for any archive `tarfile` reads to its end both give the same members,
    except where this one raises: on a malformed pax record, a negative size or a size in a global
    pax header (which `tarfile` silently makes do with), and on GNU sparse files (not supported
    here). It also raises where `tarfile` stops early, without a word, at a header it cannot read.
    Sizes are trusted only as far as the data goes: reads are chunked, so a corrupt size field fails
    at the end of the data without a large allocation."""
    head = stream.read(_BLOCK)
    if head[:2] == b"\x1f\x8b":
        try:
            gunzipped = gzip.GzipFile(fileobj=_Rewound(head, stream), mode="rb")
            yield from _members(gunzipped, gunzipped.read(_BLOCK), on_dropped, max_member_bytes)
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise GzipTarError(f"gzip data does not decompress ({err})") from None
        except tarfile.ReadError as err:
            raise GzipTarError(*err.args) from None
    elif (head[:3] == b"BZh" and head[4:10] == b"1AY&SY") or head.startswith((b"\xfd7zXZ", b"\x5d\0\0\x80")):
        raise tarfile.ReadError("bz2/xz-compressed tar stream: store shards as .tar or .tar.gz")
    else:
        yield from _members(stream, head, on_dropped, max_member_bytes)


def _members(
    stream, header: bytes, on_dropped: Callable | None, max_member_bytes: int | None
) -> Iterator[tuple[str, bytes]]:
    """`tar_files` on an uncompressed stream whose first header block has been read already. One pass
    per member: its header checked (`_checked`), its data read (`_data`), then what its kind asks for;
    the metadata headers (pax, GNU long names) are read by `_Meta`. Regular members stay on the
    shortest path: `ssl-vit bench data` counts every call made per member."""
    read = stream.read
    if not header:
        raise tarfile.ReadError("empty tar stream")  # not even end blocks: a failed write or download
    offset = 0  # of `header` in the stream, for error messages
    meta = _Meta()
    while (header := _checked(read, header, offset)) is not None:
        kind = header[156:157]
        if kind == b"\0" and _name(header[:100]).endswith(b"/"):
            kind = b"5"  # a directory, as old (V7) tars mark it: by a trailing slash only
        size = _size(header, kind, meta.size, offset)
        oversize = max_member_bytes is not None and size > max_member_bytes and kind in _REGULAR
        data, pad, cut = _data(read, size, oversize, offset)
        if kind in _REGULAR:
            name = _member_name(header, meta.path, meta.global_path)
            if name.startswith("__") and _is_meta(name):
                pass
            elif not oversize:
                yield name, data
            elif on_dropped is not None:
                on_dropped(OversizeMember(name, size, max_member_bytes))
        elif kind in _LINKS:
            if on_dropped is not None:
                on_dropped(meta.link_member(header, kind))
        else:
            meta.read(kind, data, offset)
        if kind in _META:
            meta.waiting = True
        elif meta.waiting:  # pax and long-name headers describe one member
            meta.clear()
        if cut:
            raise _error("the data ends inside the padding of a tar member", offset)
        offset += _BLOCK + size + pad
        header = read(_BLOCK)
    if meta.waiting:
        raise _error("no member after a pax or long-name header", offset)


def sample_spans(stream, size: int, label_bytes: int) -> Iterator[tuple[str, int, int, dict[str, bytes]]]:
    """`(key, start, end, labels)` for each sample of an uncompressed tar file of `size` bytes opened
    for random access: the bytes `[start, end)` hold the sample's members with their headers (pax and
    long-name ones included), so that the sample can be read alone; `labels` holds its `cls`/`json`
    members of at most `label_bytes` bytes (what a class filter reads before anything is decoded).

    A walk over the headers that seeks past the data: indexing a shard reads about 1.5 KB per sample
    whatever the images weigh. Members are grouped by key as `group_by_keys` groups them (consecutive
    members of one key). Raises `tarfile.ReadError` as `tar_files` does, after yielding the samples
    that were whole before the damage; a global pax header (which renames every later member, so that
    a sample read alone would have other names) is refused the same way."""
    read = stream.read
    header = read(_BLOCK)
    if not header:
        raise tarfile.ReadError("empty tar stream")
    offset = start = 0
    meta, gathered = _Meta(), _Gathered()
    while (header := _checked(read, header, offset)) is not None:
        kind = header[156:157]
        if kind == b"\0" and _name(header[:100]).endswith(b"/"):
            kind = b"5"
        length = _size(header, kind, meta.size, offset)
        if offset + _BLOCK + length > size:
            raise _error(f"the data ends inside a tar member ({size - offset - _BLOCK} of {length})", offset)
        end = min(offset + _BLOCK + length + (-length % _BLOCK), size)  # a last member may lack its padding
        if kind in _REGULAR or kind in _LINKS:
            name = _member_name(header, meta.path, meta.global_path)
            label = kind in _REGULAR and length <= label_bytes
            yield from gathered.add(name, start, end, read if label else None, length)
            start = end
        elif kind not in _NO_DATA:
            if length > _CHUNK:
                raise _error(f"a metadata header of {length:,} bytes", offset)
            meta.read(kind, read(length), offset)
            if meta.global_path is not None:
                raise _error("global pax header naming later members (not supported by the index)", offset)
        if kind in _META:
            meta.waiting = True
        elif meta.waiting:
            meta.clear()
        offset = end
        stream.seek(offset)
        header = read(_BLOCK)
    if meta.waiting:
        raise _error("no member after a pax or long-name header", offset)
    yield from gathered.add(None, 0, 0, None, 0)
    if gathered.unkeyed:
        raise UnkeyedMember(f"{gathered.unkeyed} member(s) have", "")


class _Gathered:
    """`sample_spans`' sample in progress: `[key, start, end, labels]`, handed on when a member of
    another key (or the end, `name` None) comes."""

    def __init__(self) -> None:
        self.current: list | None = None
        self.unkeyed = 0  # members whose name gives no sample key, passed over

    def add(self, name: str | None, start: int, end: int, read: Callable | None, length: int) -> Iterator:
        key, ext = base_plus_ext(name) if name is not None else (None, None)
        if name is not None and (key is None or (name.startswith("__") and _is_meta(name))):
            self.unkeyed += key is None and not _is_meta(name)
            return
        if self.current is not None and self.current[0] != key:
            yield tuple(self.current)
            self.current = None
        if key is None:
            return
        if self.current is None:
            self.current = [key, start, end, {}]
        self.current[2] = end
        if read is not None and ext.lower() in LABEL_MEMBERS:
            self.current[3][ext.lower()] = read(length)


def _checked(read: Callable[[int], bytes], header: bytes, offset: int) -> bytes | None:
    """The 512-byte header block that starts with `header` (completed from `read` after a short read),
    its checksum verified; None at the end of the archive (a zero block, like tarfile, or the end of
    the data where the end blocks should be)."""
    if len(header) != _BLOCK:
        header = _fill(read, header, _BLOCK)  # a short read (from a pipe), or the end of the data
        if not header.strip(b"\0"):
            return None  # a stream without end blocks, or cut inside them
        if len(header) != _BLOCK:
            raise _error("the data ends inside a tar header", offset)
    if header == _ZERO_BLOCK:
        return None
    # The checksum is the sum of the header's bytes, its own field counted as eight spaces. Adler-32's
    # low 16 bits are 1 + that sum modulo 65521, exact for 256 bytes (at most 65280): two halves
    # give the sum 5x faster than sum() over 512 bytes.
    chksum = header[148:156]
    unsigned = (zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2
    expected = _number(chksum, "checksum", offset)
    if expected != unsigned - sum(chksum) + 256 and not _signed_checksum(header, expected):
        raise _error("bad tar header checksum", offset)
    return header


def _size(header: bytes, kind: bytes, pax_size: int | None, offset: int) -> int:
    """The bytes of data after a member's header, as tarfile judges them: none for the kinds without
    data, a pax header's `size` for the member it describes, else the header's own field."""
    if kind in _NO_DATA:
        return 0
    if pax_size is not None and kind not in _META:
        return pax_size
    size = _number(header[124:136], "size", offset)
    if size < 0:
        raise _error(f"negative member size {size}", offset)
    return size


def _data(read: Callable[[int], bytes], size: int, oversize: bool, offset: int) -> tuple[bytes, int, bool]:
    """A member's `size` bytes of data (b"" when `oversize`: read past, never held), the padding to the
    next block read past; `(data, padding, cut)`, `cut` when the data ends inside the padding (raised
    after the member, which is whole)."""
    if oversize:
        data, got = b"", _pass(read, size)
    else:
        data = read(size) if size <= _CHUNK else b""
        if len(data) != size:
            data = _fill(read, data, size)
        got = len(data)
    if got != size:
        raise _error(f"the data ends inside a tar member ({got} of {size} bytes)", offset)
    pad = -size % _BLOCK
    if not pad:
        return data, 0, False
    padding = read(pad)
    return data, pad, len(padding) != pad and len(_fill(read, padding, pad)) != pad


class _Meta:
    """What pax and GNU long-name headers say of the member after them (`path`, `size`, `link`: cleared
    once that member is read), and global pax headers of every member after them (`global_path`)."""

    __slots__ = ("path", "size", "link", "global_path", "waiting")

    def __init__(self) -> None:
        self.global_path = None
        self.clear()

    def clear(self) -> None:
        self.path = self.size = self.link = None
        self.waiting = False  # a pax or long-name header waits for its member

    def link_member(self, header: bytes, kind: bytes) -> LinkMember:
        target = self.link if self.link is not None else _name(header[157:257])
        name = _member_name(header, self.path, self.global_path)
        return LinkMember(name, target.decode("utf-8", "surrogateescape"), symbolic=kind == b"2")

    def read(self, kind: bytes, data: bytes, offset: int) -> None:
        """A header of `kind` other than a regular file or a link: its metadata kept; members without
        a file (directories, devices, fifos) are passed over."""
        if kind in _PAX:
            self._pax(kind, _pax_records(data, offset), offset)
        elif kind == b"L":  # GNU long name
            if self.path is None:
                self.path = _name(data)
        elif kind == b"K":  # GNU long link target
            if self.link is None:
                self.link = _name(data)
        elif kind == b"S":
            raise _error("GNU sparse member (not supported)", offset)

    def _pax(self, kind: bytes, records: dict[bytes, bytes], offset: int) -> None:
        if kind == b"g":  # a later global header overrides an earlier one
            if b"path" in records:
                self.global_path = records[b"path"].rstrip(b"/")
            if b"size" in records:  # tarfile gives it as every member's size, but skips their own
                raise _error("size in a global pax header (not supported)", offset)
            return
        # the first header of a chain wins, as in tarfile
        if self.path is None and b"path" in records:
            self.path = records[b"path"].rstrip(b"/")
        if self.size is None and b"size" in records:
            self.size = _pax_size(records[b"size"], offset)
        if self.link is None and b"linkpath" in records:
            self.link = records[b"linkpath"]


def _fill(read: Callable[[int], bytes], data: bytes, size: int) -> bytes:
    """`data` followed by what `read` gives, up to `size` bytes in all (fewer at the end of the data),
    read in chunks of at most `_CHUNK` bytes."""
    chunks, got = [data], len(data)
    while got < size:
        chunk = read(min(size - got, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _pass(read: Callable[[int], bytes], size: int) -> int:
    """Reads past `size` bytes in chunks of at most `_CHUNK`, holding none; returns how many there were
    (fewer at the end of the data)."""
    got = 0
    while got < size:
        chunk = read(min(size - got, _CHUNK))
        if not chunk:
            break
        got += len(chunk)
    return got


def _number(field: bytes, what: str, offset: int) -> int:
    """A numeric header field as tarfile's `nti` reads it: octal digits up to the first NUL, spaces
    around them allowed, or GNU base-256, 0x80 (positive) or 0xff (negative) then big-endian bytes."""
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    if field[0] == 0xFF:
        return int.from_bytes(field[1:], "big") - 256 ** (len(field) - 1)
    try:
        return int(field.partition(b"\0")[0], 8)
    except ValueError:  # the fast path misses empty fields and str.strip()'s whitespace
        pass
    try:
        return int(field.partition(b"\0")[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        raise _error(f"bad {what} field {field!r}", offset) from None


def _signed_checksum(header: bytes, expected: int) -> bool:
    """Whether the header matches `expected` as a sum of signed bytes (some old tars wrote those)."""
    high = sum(b >= 128 for b in header[:148]) + sum(b >= 128 for b in header[156:])
    return expected == sum(header[:148]) + 256 + sum(header[156:]) - 256 * high


def _name(field: bytes) -> bytes:
    return field.partition(b"\0")[0]


def _member_name(header: bytes, path: bytes | None, global_path: bytes | None) -> str:
    """A member's name: from its pax or long-name header, a global pax header, or its own header (the
    ustar prefix joined, as tarfile does whatever the magic says)."""
    if path is None:
        path = global_path
    if path is None:
        path = _name(header[:100])
        if header[345]:
            path = _name(header[345:500]) + b"/" + path
    return path.decode("utf-8", "surrogateescape")


def _is_meta(name: str) -> bool:
    first = name.split("/", 1)[0]
    return len(first) >= 4 and first.endswith("__")


def _pax_records(data: bytes, offset: int) -> dict[bytes, bytes]:
    """`{keyword: value}` of a pax header's data, records `LENGTH KEYWORD=VALUE\\n` where LENGTH (in
    decimal) counts the whole record. Raises ReadError for a record that does not parse, where tarfile
    stops reading records without a word."""
    records = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 21)
        length = data[pos:space] if space > pos else b""
        end = pos + int(length) if length.isdigit() else 0
        if not (space + 1 < end <= len(data) and data[end - 1] == 10):
            raise _error(f"bad pax record at byte {pos} of {data[pos : pos + 40]!r}", offset)
        keyword, equals, value = data[space + 1 : end - 1].partition(b"=")
        if not (keyword and equals):
            raise _error(f"bad pax record at byte {pos} of {data[pos : pos + 40]!r}", offset)
        if keyword.startswith(b"GNU.sparse."):
            raise _error("GNU sparse member (not supported)", offset)
        records[keyword] = value
        pos = end
    return records


def _pax_size(value: bytes, offset: int) -> int:
    if not (value.isdigit() and len(value) <= 20):  # tarfile would take anything int() takes, or 0
        raise _error(f"bad pax size {value[:40]!r}", offset)
    return int(value)


def _error(message: str, offset: int) -> tarfile.ReadError:
    return tarfile.ReadError(f"{message} (tar header at byte {offset})")


class _Rewound:
    """`stream` with `head`, already read from it, put back in front: what a decompressor reads."""

    def __init__(self, head: bytes, stream):
        self.head, self.stream = head, stream

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.stream.read(size)
        if size < 0:
            head, self.head = self.head, b""
            return head + self.stream.read()
        out, self.head = self.head[:size], self.head[size:]
        return out


install_openers()  # on import: every reader of shards imports this module before it opens one
