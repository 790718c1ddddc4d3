"""Every validation limit the readers take is a setting."""

from __future__ import annotations

from dataclasses import fields

from adapters.artifacts.archive import ArchiveLimits
from adapters.artifacts.validate import ValidationLimits
from adapters.pipeline import validation_limits


def test_every_reader_limit_comes_from_a_setting(settings):
    settings.MINT_SAFETENSORS_MAX_TOTAL_HEADER_BYTES = 12345
    settings.MINT_ARCHIVE_MAX_NAME_BYTES = 777
    settings.MINT_ARCHIVE_MAX_PAX_HEADER_BYTES = 4444
    settings.MINT_ARCHIVE_MAX_PAX_RECORDS = 55
    settings.MINT_ARCHIVE_MAX_ZIP_DIRECTORY_BYTES = 6666
    limits = validation_limits()
    assert limits.max_total_header_bytes == 12345
    assert (
        limits.archive.max_name_bytes,
        limits.archive.max_pax_header_bytes,
        limits.archive.max_pax_records,
        limits.archive.max_zip_directory_bytes,
    ) == (777, 4444, 55, 6666)
    # None is left at its dataclass default: a new limit must be wired here too.
    assert {f.name for f in fields(ValidationLimits)} == {
        "max_header_bytes",
        "max_total_header_bytes",
        "max_tensors",
        "archive",
    }
    assert len(fields(ArchiveLimits)) == 7
