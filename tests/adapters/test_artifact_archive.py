"""Safe unpacking of uploaded archives: what is refused, and that a refusal leaves nothing behind."""

from __future__ import annotations

import gzip
import io
import random
import tarfile
import zipfile
from pathlib import Path

import pytest

from adapters.artifacts.archive import ArchiveLimits, archive_kind, extract_archive
from adapters.artifacts.errors import ArtifactError
from tests.adapters.corpus import TINY_DENSE, add_tar_member, make_archive, write_lora_adapter, write_many_empty_zip

LIMITS = ArchiveLimits()


def leftovers(dest: Path) -> list[Path]:
    return sorted(dest.rglob("*")) if dest.exists() else []


def refuse(archive: Path, dest: Path, code: str, limits: ArchiveLimits = LIMITS) -> ArtifactError:
    with pytest.raises(ArtifactError) as caught:
        extract_archive(archive, dest, limits)
    assert caught.value.code == code, caught.value.message
    assert leftovers(dest) == []
    return caught.value


@pytest.fixture
def upload(tmp_path) -> Path:
    """A folder holding an adapter nested one level down, as people usually archive it."""
    write_lora_adapter(tmp_path / "upload" / "my-adapter", TINY_DENSE)
    (tmp_path / "upload" / "my-adapter" / "README.md").write_text("notes\n")
    return tmp_path / "upload"


def tar_with(path: Path, members: list[tuple[str, bytes, dict]], src: Path | None = None) -> Path:
    """A tar.gz holding `src` (if given) followed by exactly these members."""
    with tarfile.open(path, "w:gz") as tar:
        if src is not None:
            tar.add(src, arcname=".")
        for name, data, fields in members:
            add_tar_member(tar, name, data, **fields)
    return path


def zip_with(path: Path, members: list[tuple[zipfile.ZipInfo | str, bytes]], src: Path | None = None) -> Path:
    if src is not None:
        make_archive(src, path, "zip")
    with zipfile.ZipFile(path, "a" if src is not None else "w") as zf:
        for info, data in members:
            zf.writestr(info, data)
    return path


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_archive_kind_is_judged_by_content_not_name(tmp_path, upload, kind):
    archive = make_archive(upload, tmp_path / "upload.bin", kind)
    expected = "zip" if kind == "zip" else "tar"
    assert archive_kind(archive) == expected
    misnamed = archive.rename(tmp_path / ("adapter.zip" if expected == "tar" else "adapter.tar.gz"))
    assert archive_kind(misnamed) == expected


def test_archive_kind_is_none_for_other_files(tmp_path, upload):
    json_file = upload / "my-adapter" / "adapter_config.json"
    safetensors_file = upload / "my-adapter" / "adapter_model.safetensors"
    gzipped_text = tmp_path / "notes.tar.gz"
    gzipped_text.write_bytes(gzip.compress(b"just some text, not a tar\n" * 50))
    empty = tmp_path / "empty.zip"
    empty.write_bytes(b"")
    for path in (json_file, safetensors_file, gzipped_text, empty, tmp_path / "missing.tar"):
        assert archive_kind(path) is None, path


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_extract_archive_reproduces_the_tree(tmp_path, upload, kind):
    archive = make_archive(upload, tmp_path / f"upload.{kind}", kind)
    dest = tmp_path / "out"
    written = extract_archive(archive, dest, LIMITS)
    expected = sorted(p.relative_to(upload) for p in upload.rglob("*") if p.is_file())
    assert written == sorted(written)
    assert [p.relative_to(dest) for p in written] == expected
    for rel in expected:
        assert (dest / rel).read_bytes() == (upload / rel).read_bytes()


def test_extract_archive_accepts_directories_and_dot_prefixed_names(tmp_path):
    archive = tar_with(
        tmp_path / "a.tar.gz",
        [("./", b"", {"type": tarfile.DIRTYPE}), ("./a/b/", b"", {"type": tarfile.DIRTYPE}), ("./a/b/c.txt", b"x", {})],
    )
    assert extract_archive(archive, tmp_path / "out", LIMITS) == [tmp_path / "out" / "a" / "b" / "c.txt"]


def test_extract_archive_streams_large_members_in_chunks(tmp_path):
    payload = random.Random(0).randbytes(3 * 1024 * 1024)  # several chunks
    archive = tar_with(tmp_path / "big.tar.gz", [("big.dat", payload, {})])
    (written,) = extract_archive(archive, tmp_path / "out", LIMITS)
    assert written.read_bytes() == payload


def test_extract_archive_does_not_touch_what_was_already_in_dest(tmp_path, upload):
    dest = tmp_path / "out"
    (dest / "my-adapter").mkdir(parents=True)
    (dest / "keep.txt").write_text("mine")
    archive = tar_with(tmp_path / "bad.tar.gz", [("../x", b"x", {})], src=upload)
    with pytest.raises(ArtifactError):
        extract_archive(archive, dest, LIMITS)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["keep.txt", "my-adapter"]


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("../escaped.txt", "archive_path_traversal"),
        ("my-adapter/../../escaped.txt", "archive_path_traversal"),
        ("my-adapter/..", "archive_path_traversal"),
        ("..\\escaped.txt", "archive_path_traversal"),
        ("/etc/cron.d/mint", "archive_absolute_path"),
        ("C:/Windows/evil.dll", "archive_absolute_path"),
        ("\\\\server\\share\\evil", "archive_absolute_path"),
    ],
)
def test_tar_names_that_leave_the_destination_are_refused_after_cleaning_up(tmp_path, upload, name, code):
    archive = tar_with(tmp_path / "bad.tar.gz", [(name, b"gotcha", {})], src=upload)
    error = refuse(archive, tmp_path / "out", code)
    assert repr(name) in error.message
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("../escaped.txt", "archive_path_traversal"),
        ("a/../../escaped.txt", "archive_path_traversal"),
        ("/abs.txt", "archive_absolute_path"),
    ],
)
def test_zip_names_that_leave_the_destination_are_refused_before_writing(tmp_path, upload, name, code):
    archive = zip_with(tmp_path / "bad.zip", [(name, b"gotcha")], src=upload)
    refuse(archive, tmp_path / "out", code)
    assert not (tmp_path / "escaped.txt").exists()


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "archive_link"),
        ({"type": tarfile.SYMTYPE, "linkname": "adapter_config.json"}, "archive_link"),
        ({"type": tarfile.LNKTYPE, "linkname": "my-adapter/adapter_config.json"}, "archive_link"),
        ({"type": tarfile.FIFOTYPE}, "archive_special_file"),
        ({"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "archive_special_file"),
        ({"type": tarfile.BLKTYPE, "devmajor": 8, "devminor": 0}, "archive_special_file"),
    ],
)
def test_tar_links_and_special_files_are_refused(tmp_path, upload, fields, code):
    archive = tar_with(tmp_path / "bad.tar.gz", [("my-adapter/odd", b"", fields)], src=upload)
    error = refuse(archive, tmp_path / "out", code)
    assert "my-adapter/odd" in error.message


@pytest.mark.parametrize(("mode", "code"), [(0o120777, "archive_link"), (0o010644, "archive_special_file")])
def test_zip_links_and_special_files_are_refused(tmp_path, upload, mode, code):
    info = zipfile.ZipInfo("my-adapter/odd")
    info.create_system = 3
    info.external_attr = mode << 16
    archive = zip_with(tmp_path / "bad.zip", [(info, b"/etc/passwd")], src=upload)
    refuse(archive, tmp_path / "out", code)


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_too_many_files_is_refused(tmp_path, kind):
    src = tmp_path / "many"
    src.mkdir()
    for i in range(30):
        (src / f"f{i:02d}").write_bytes(b"x")
    archive = make_archive(src, tmp_path / f"many.{kind}", kind)
    limits = ArchiveLimits(max_files=29)
    error = refuse(archive, tmp_path / "out", "archive_too_many_files", limits)
    assert "29" in error.message
    assert len(extract_archive(archive, tmp_path / "ok", ArchiveLimits(max_files=30))) == 30


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_too_large_is_refused_whatever_the_kind(tmp_path, kind):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"part{i}").write_bytes(random.Random(i).randbytes(512 * 1024))
    archive = make_archive(src, tmp_path / f"big.{kind}", kind)
    limits = ArchiveLimits(max_total_bytes=1024 * 1024, max_compression_ratio=1000)
    refuse(archive, tmp_path / "out", "archive_too_large", limits)


def test_declared_size_over_the_limit_is_refused_before_reading_data(tmp_path, upload):
    archive = tmp_path / "huge.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(upload, arcname=".")
        info = tarfile.TarInfo("my-adapter/huge.dat")
        info.size = 5 * 1024**3  # the data is not there at all
        tar.fileobj.write(info.tobuf())
    error = refuse(archive, tmp_path / "out", "archive_too_large")
    assert "huge.dat" in error.message


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_compression_bomb_is_refused_early(tmp_path, upload, kind):
    src = upload
    (src / "my-adapter" / "zeros.dat").write_bytes(bytes(16 * 1024 * 1024))
    archive = make_archive(src, tmp_path / f"bomb.{kind}", kind)
    assert archive.stat().st_size * 200 < 16 * 1024 * 1024
    refuse(archive, tmp_path / "out", "archive_compression_ratio")


def test_compression_ratio_counts_all_members_together(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"z{i}").write_bytes(bytes(256 * 1024))
    archive = make_archive(src, tmp_path / "zeros.tar.gz", "tar.gz")
    ratio = 8 * 256 * 1024 / archive.stat().st_size
    refuse(archive, tmp_path / "out", "archive_compression_ratio", ArchiveLimits(max_compression_ratio=ratio * 0.9))
    assert len(extract_archive(archive, tmp_path / "ok", ArchiveLimits(max_compression_ratio=ratio * 1.1))) == 8


def test_damaged_archive_is_bad_archive_and_cleaned_up(tmp_path, upload):
    archive = make_archive(upload, tmp_path / "upload.tar.gz", "tar.gz")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    error = refuse(archive, tmp_path / "out", "bad_archive")
    assert "upload.tar.gz" in error.message


def test_zip_with_corrupt_member_is_bad_archive_and_cleaned_up(tmp_path):
    archive = tmp_path / "crc.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("a.txt", b"first member, written before the damage is seen")
        zf.writestr("b.txt", b"B" * 64)
    data = bytearray(archive.read_bytes())
    data[data.index(b"B" * 64) + 10] ^= 0xFF
    archive.write_bytes(bytes(data))
    refuse(archive, tmp_path / "out", "bad_archive")


def test_duplicate_member_is_refused(tmp_path):
    archive = tar_with(tmp_path / "dup.tar.gz", [("a.txt", b"one", {}), ("a.txt", b"two", {})])
    refuse(archive, tmp_path / "out", "bad_archive")


def test_not_an_archive_is_bad_archive(tmp_path):
    path = tmp_path / "adapter.tar.gz"
    path.write_bytes(b"definitely not an archive" * 40)
    refuse(path, tmp_path / "out", "bad_archive")


def test_encrypted_zip_member_is_bad_archive(tmp_path):
    archive = tmp_path / "enc.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("a.txt", b"secret")
    data = bytearray(archive.read_bytes())
    # Set the "encrypted" flag in both the local and the central header.
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.index(signature) + flag_at
        data[at] |= 0x1
    archive.write_bytes(bytes(data))
    refuse(archive, tmp_path / "out", "bad_archive")


def test_gnu_long_names_and_pax_headers_are_supported(tmp_path):
    long_name = "deep/" + "d" * 120 + "/" + "f" * 120 + ".txt"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_tar_member(tar, long_name, b"pax")
    archive = tmp_path / "pax.tar"
    archive.write_bytes(buffer.getvalue())
    (written,) = extract_archive(archive, tmp_path / "out", LIMITS)
    assert written == tmp_path / "out" / long_name
    assert written.read_bytes() == b"pax"


# -- the archive's own headers, bounded before the standard library reads them ----------------------


def test_gnu_format_long_names_are_supported_up_to_the_name_bound(tmp_path):
    name = "deep/" + "n" * 190 + ".txt"  # 199 bytes: stored as a GNU long name (type L)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        add_tar_member(tar, name, b"gnu")
    archive = tmp_path / "gnu.tar"
    archive.write_bytes(buffer.getvalue())
    (written,) = extract_archive(archive, tmp_path / "out", ArchiveLimits(max_name_bytes=199))
    assert written.read_bytes() == b"gnu"
    error = refuse(archive, tmp_path / "refused", "archive_name_too_long", ArchiveLimits(max_name_bytes=198))
    assert "198" in error.message


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_member_names_above_the_bound_are_refused_after_cleaning_up(tmp_path, upload, tar_format):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as tar:
        tar.add(upload, arcname=".")
        add_tar_member(tar, "my-adapter/" + "x" * 300, b"x")
    archive = tmp_path / "long.tar"
    archive.write_bytes(buffer.getvalue())
    refuse(archive, tmp_path / "out", "archive_name_too_long", ArchiveLimits(max_name_bytes=256))


def test_pax_headers_above_their_bounds_are_refused(tmp_path, upload):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(upload, arcname=".")
        info = tarfile.TarInfo("my-adapter/notes.txt")
        info.pax_headers = {f"MINT.note{i}": "n" * 100 for i in range(20)}  # ~2.5 KB, 20 records
        tar.addfile(info)
    archive = tmp_path / "pax.tar"
    archive.write_bytes(buffer.getvalue())
    assert len(extract_archive(archive, tmp_path / "ok", ArchiveLimits(max_pax_header_bytes=4096))) == 4
    error = refuse(archive, tmp_path / "big", "archive_header_too_large", ArchiveLimits(max_pax_header_bytes=2048))
    assert "PAX header" in error.message and "2048" in error.message
    refuse(archive, tmp_path / "many", "archive_header_too_large", ArchiveLimits(max_pax_records=16))


def test_pax_global_headers_are_applied_and_bounded_together(tmp_path):
    # git archive writes one global header (comment=<commit>) before every member.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "c" * 600}) as tar:
        add_tar_member(tar, "a.txt", b"a")
    archive = tmp_path / "global.tar"
    archive.write_bytes(buffer.getvalue())
    assert [p.name for p in extract_archive(archive, tmp_path / "ok", LIMITS)] == ["a.txt"]
    refuse(archive, tmp_path / "out", "archive_header_too_large", ArchiveLimits(max_pax_header_bytes=512))


def raw_pax_tar(path: Path, payload: bytes, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    """A tar with a PAX extended header holding exactly `payload`, then `member` and its data."""
    pax = tarfile.TarInfo("./PaxHeaders/x")
    pax.type = tarfile.XHDTYPE
    pax.size = len(payload)
    blocks = [
        pax.tobuf(tarfile.USTAR_FORMAT),
        payload,
        b"\0" * (-len(payload) % 512),
        member.tobuf(tarfile.USTAR_FORMAT),
    ]
    blocks += [data, b"\0" * (-len(data) % 512), b"\0" * 1024]
    path.write_bytes(b"".join(blocks))
    return path


def test_pax_size_and_path_records_patch_the_member_after_them(tmp_path):
    # The member's own header says 0 bytes and a short name; the PAX records say otherwise.
    payload = b"13 size=5000\n" + b"32 path=dir/from-pax-header.txt\n"
    archive = raw_pax_tar(tmp_path / "pax.tar", payload, tarfile.TarInfo("short"), b"p" * 5000)
    (written,) = extract_archive(archive, tmp_path / "out", LIMITS)
    assert written == tmp_path / "out" / "dir" / "from-pax-header.txt"
    assert written.read_bytes() == b"p" * 5000


@pytest.mark.parametrize(
    "payload",
    [
        b"2 2 2 2 2 2 2 2 =x\n",  # records overlapping each other: tarfile's parser read each as a key
        b"99 path=a\n",  # a length past the header's end
        b"10 path=ab\n",  # a length that does not end on the newline
        b"x path=a\n",
        b"7 patha\n",  # no '='
    ],
)
def test_malformed_pax_records_are_bad_archive(tmp_path, payload):
    archive = raw_pax_tar(tmp_path / "pax.tar", payload, tarfile.TarInfo("a.txt"))
    refuse(archive, tmp_path / "out", "bad_archive")


def test_tar_headers_count_toward_the_compression_ratio(tmp_path):
    # No file data at all, only headers: a bomb can fill PAX headers instead of files.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(200):
            info = tarfile.TarInfo(f"f{i:03d}")
            info.pax_headers = {"comment": "z" * 20_000}
            tar.addfile(info)
    archive = tmp_path / "headers.tar.gz"
    archive.write_bytes(gzip.compress(buffer.getvalue()))
    assert buffer.tell() > 200 * archive.stat().st_size
    error = refuse(archive, tmp_path / "out", "archive_compression_ratio")
    assert "f0" in error.message


def zip_bytes(members: list[tuple[str, bytes]], comment: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members:
            zf.writestr(name, data)
        zf.comment = comment
    return buffer.getvalue()


def test_zip_central_directory_above_its_bound_is_refused_before_zipfile_reads_it(tmp_path, monkeypatch):
    archive = tmp_path / "dir.zip"
    archive.write_bytes(zip_bytes([(f"f{i:04d}", b"") for i in range(100)]))
    monkeypatch.setattr(zipfile, "ZipFile", None)  # nothing may get as far as constructing one
    error = refuse(archive, tmp_path / "out", "archive_header_too_large", ArchiveLimits(max_zip_directory_bytes=1024))
    assert "central directory" in error.message
    refuse(archive, tmp_path / "out", "archive_too_many_files", ArchiveLimits(max_files=99))


def test_zip_entries_are_counted_whatever_the_end_record_claims(tmp_path):
    data = bytearray(zip_bytes([(f"f{i:02d}", b"") for i in range(30)]))
    end = data.rindex(b"PK\x05\x06")
    data[end + 8 : end + 12] = (1).to_bytes(2, "little") * 2  # "1 entry" on this disk and in total
    archive = tmp_path / "lying.zip"
    archive.write_bytes(bytes(data))
    refuse(archive, tmp_path / "out", "archive_too_many_files", ArchiveLimits(max_files=29))
    assert len(extract_archive(archive, tmp_path / "ok", ArchiveLimits(max_files=30))) == 30


def test_zip_with_a_comment_and_zip64_records_is_read_like_zipfile_reads_it(tmp_path):
    archive = tmp_path / "comment.zip"
    archive.write_bytes(zip_bytes([("a.txt", b"a"), ("b/c.txt", b"c")], comment=b"PK made by a tool " * 100))
    assert [p.name for p in extract_archive(archive, tmp_path / "out", ArchiveLimits(max_files=2))] == [
        "a.txt",
        "c.txt",
    ]
    refuse(archive, tmp_path / "refused", "archive_too_many_files", ArchiveLimits(max_files=1))
    many = write_many_empty_zip(tmp_path / "zip64.zip", 40)  # always written with zip64 end records
    assert len(extract_archive(many, tmp_path / "many", ArchiveLimits(max_files=40))) == 40
    refuse(many, tmp_path / "many-refused", "archive_too_many_files", ArchiveLimits(max_files=39))


def test_zip_member_names_above_the_bound_are_refused(tmp_path):
    archive = tmp_path / "names.zip"
    archive.write_bytes(zip_bytes([("a.txt", b"a"), ("d/" + "n" * 300, b"n")]))
    error = refuse(archive, tmp_path / "out", "archive_name_too_long", ArchiveLimits(max_name_bytes=256))
    assert "d/nnn" in error.message


def _adapter_files_only(name: str) -> bool:
    from adapters.artifacts.validate import adapter_member

    return adapter_member(name)


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_with_keep_only_adapter_files_are_written_and_the_rest_still_counts(tmp_path, upload, kind):
    for i in range(40):
        (upload / "my-adapter" / f"stray-{i:02d}").write_bytes(b"")
    (upload / "my-adapter" / "train.bin").write_bytes(b"pickle")
    archive = make_archive(upload, tmp_path / f"a.{kind}", kind)
    written = extract_archive(archive, tmp_path / "out", LIMITS, keep=_adapter_files_only)
    assert sorted(p.name for p in written) == ["adapter_config.json", "adapter_model.safetensors", "train.bin"]
    assert sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file()) == sorted(p.name for p in written)
    # Members read past still count against the archive's limits.
    with pytest.raises(ArtifactError) as refused:
        extract_archive(archive, tmp_path / "refused", ArchiveLimits(max_files=40), keep=_adapter_files_only)
    assert refused.value.code == "archive_too_many_files"
    assert leftovers(tmp_path / "refused") == []


def test_with_keep_skipped_bytes_count_towards_the_size_limit(tmp_path, upload):
    (upload / "my-adapter" / "filler").write_bytes(random.Random(1).randbytes(2 * 1024 * 1024))
    archive = make_archive(upload, tmp_path / "a.tar", "tar")
    with pytest.raises(ArtifactError) as refused:
        extract_archive(archive, tmp_path / "out", ArchiveLimits(max_total_bytes=1024 * 1024), keep=_adapter_files_only)
    assert refused.value.code == "archive_too_large"
    assert leftovers(tmp_path / "out") == []
