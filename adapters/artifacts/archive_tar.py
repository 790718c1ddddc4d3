"""Reading tar archives (plain or gzip) with every header bounded before tarfile allocates it.

tarfile reads a GNU long name or a PAX header whole into memory (a 400 KB .tar.gz can declare a
400 MiB name), so headers go through `_BoundedTarInfo`; sparse members are refused.
"""

from __future__ import annotations

import tarfile
from typing import ClassVar

from adapters.artifacts.archive_job import READ_ERRORS, Extraction
from adapters.artifacts.errors import ArtifactError

# Extended headers (GNU long name/link, PAX) tar may chain in front of one member: real writers use
# at most four (a global and an extended PAX header, a long name, a long link). tarfile follows a
# chain by recursion, so an endless one would end in RecursionError instead of a refusal.
MAX_HEADERS_PER_MEMBER = 8


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's header reader with our bounds applied before a header's payload is read.

    tarfile reads a GNU long name or long link (types L/K) and a PAX header (x/g) whole into
    memory, parses PAX records with a regular expression that can match across records
    (a 64 KiB header of short overlapping records costs a gigabyte of keys), and reads the
    sparse maps of GNU sparse members for as many blocks as the archive says. `_proc_member`
    is tarfile's documented extension point for this (see its comment in tarfile.py): it sees
    each header's type and declared size before any of that happens. Long names and PAX
    headers above their bounds are refused, PAX headers are parsed here with a strict parser,
    and sparse members (which an adapter never needs) are refused outright.

    One subclass is made per extraction (`for_job`), carrying that extraction's limits.
    """

    job: ClassVar[Extraction]

    @classmethod
    def for_job(cls, job: Extraction) -> type[_BoundedTarInfo]:
        return type(cls.__name__, (cls,), {"job": job})

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        job = self.job
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, *_PAX_TYPES):
            job.headers_in_a_row += 1
            if job.headers_in_a_row > MAX_HEADERS_PER_MEMBER:
                raise job.header_too_large(
                    f"more than {MAX_HEADERS_PER_MEMBER} extended headers (GNU long names, PAX) in front of one member"
                )
        else:
            job.headers_in_a_row = 0
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
            # The stored name ends with a NUL.
            job.check_name_length(self.size - 1, None)
        elif self.type == tarfile.GNUTYPE_SPARSE:
            raise _sparse_refusal(job, self.name)
        elif self.type in _PAX_TYPES:
            return self._proc_bounded_pax(tarfile_)
        return super()._proc_member(tarfile_)

    def _proc_bounded_pax(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        """tarfile's `_proc_pax` for a header within our bounds, with a parser that reads each record once."""
        job = self.job
        limits = job.limits
        if self.size > limits.max_pax_header_bytes:
            raise job.header_too_large(
                f"a PAX header of {self.size} bytes, above the limit of {limits.max_pax_header_bytes}"
            )
        buf = tarfile_.fileobj.read(self._block(self.size))
        if len(buf) < self.size:
            raise tarfile.ReadError("unexpected end of data in a PAX header")
        records = _pax_records(buf[: self.size], job)
        if self.type == tarfile.XGLTYPE:
            # Global records apply to every member after this one.
            pax_headers = tarfile_.pax_headers
            job.global_pax_bytes += self.size
            if job.global_pax_bytes > limits.max_pax_header_bytes:
                raise job.header_too_large(
                    f"PAX global headers of {job.global_pax_bytes} bytes together, above the limit of "
                    f"{limits.max_pax_header_bytes}"
                )
        else:
            pax_headers = tarfile_.pax_headers.copy()
        # As tarfile does: hdrcharset=BINARY (here or in a global header) means names are in the archive's encoding.
        charset = next((v.decode("utf-8", "replace") for k, v in records if k == b"hdrcharset"), None)
        charset = charset or pax_headers.get("hdrcharset")
        name_encoding = tarfile_.encoding if charset == "BINARY" else "utf-8"
        for key, value in records:
            keyword = _decode_pax(key, "utf-8", tarfile_)
            pax_headers[keyword] = _decode_pax(
                value, name_encoding if keyword in tarfile.PAX_NAME_FIELDS else "utf-8", tarfile_
            )
        if len(pax_headers) > limits.max_pax_records:
            raise job.header_too_large(
                f"PAX headers with {len(pax_headers)} records for one member, "
                f"above the limit of {limits.max_pax_records}"
            )

        try:
            member = self.fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            raise tarfile.SubsequentHeaderError(str(exc)) from None
        if self.type != tarfile.XGLTYPE:
            # As tarfile does: the extended header patches the member after it.
            member._apply_pax_info(pax_headers, tarfile_.encoding, tarfile_.errors)
            member.offset = self.offset
            if "size" in pax_headers:
                offset = member.offset_data
                if member.isreg() or member.type not in tarfile.SUPPORTED_TYPES:
                    offset += member._block(member.size)
                tarfile_.offset = offset
        return member


_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


def _pax_records(buf: bytes, job: Extraction) -> list[tuple[bytes, bytes]]:
    """The (key, value) records of a PAX header: each "<length> <key>=<value>\\n", lengths tiling the header.

    Anything else is a damaged archive. GNU sparse records are refused: their maps make
    tarfile read as many numbers as the archive claims.
    """
    records: list[tuple[bytes, bytes]] = []
    position = 0
    while position < len(buf) and buf[position] != 0:  # NUL padding may follow the last record
        space = buf.find(b" ", position, position + 21)
        length_field = buf[position:space] if space > position else b""
        if not length_field.isdigit():
            raise tarfile.ReadError("malformed PAX header record")
        end = position + int(length_field)
        if end <= space + 1 or end > len(buf) or buf[end - 1] != 0x0A:
            raise tarfile.ReadError("malformed PAX header record")
        key, equals, value = buf[space + 1 : end - 1].partition(b"=")
        if not equals or not key:
            raise tarfile.ReadError("malformed PAX header record")
        if key.startswith(b"GNU.sparse."):
            raise _sparse_refusal(job, "<a PAX header>")
        records.append((key, value))
        if len(records) > job.limits.max_pax_records:
            raise job.header_too_large(f"a PAX header with more than {job.limits.max_pax_records} records")
        position = end
    return records


def _decode_pax(raw: bytes, encoding: str, tarfile_: tarfile.TarFile) -> str:
    """Decode a PAX field as tarfile does: strictly first, then with the archive's own encoding and error handler."""
    try:
        return raw.decode(encoding, "strict")
    except UnicodeDecodeError:
        return raw.decode(tarfile_.encoding, tarfile_.errors)


def _sparse_refusal(job: Extraction, name: str) -> ArtifactError:
    return ArtifactError(
        "archive_sparse_file",
        f"{job.archive.name} contains {name!r}, a sparse file; archive the adapter's files without "
        "--sparse (adapters never need sparse files).",
    )


def extract_tar(job: Extraction) -> None:
    # Stream mode ("r|*"): members are read in order, once, so a .tar.gz is decompressed a
    # single time and limits apply to members as they arrive.
    tarinfo = _BoundedTarInfo.for_job(job)
    try:
        tar = tarfile.open(job.archive, mode="r|*", tarinfo=tarinfo)  # noqa: SIM115 - closed by the `with` below
    except READ_ERRORS as exc:
        raise job.bad(str(exc) or type(exc).__name__) from exc
    with tar:
        while True:
            try:
                member = tar.next()
            except READ_ERRORS as exc:
                raise job.bad(str(exc) or type(exc).__name__) from exc
            if member is None:
                break
            # Stream mode needs no index of past members (links are refused), but tarfile keeps
            # one: drop it, so memory does not grow with the member count.
            tar.members.clear()
            # offset_data: where this member's data starts in the decompressed stream, i.e. every
            # byte read so far, headers included (its data is counted as it is written).
            job.check_stream(member.offset_data, member.name)
            if member.sparse is not None:  # pragma: no cover - sparse headers are refused while read
                raise _sparse_refusal(job, member.name)
            if member.issym() or member.islnk():
                kind = "link"
            elif member.isdir():
                kind = "dir"
            elif member.isreg():
                kind = "file"
            else:
                kind = "special"
            parts = job.check_entry(member.name, kind, member.size if kind == "file" else 0)
            if not job.wanted(kind, parts):
                if kind == "file":
                    job.skip_file(member.size, member.name)  # tarfile reads past its data at next()
                continue
            if kind == "dir":
                job.make_dirs(parts, member.name)
                continue
            job.write_member(parts, member.name, lambda m=member: tar.extractfile(m))
