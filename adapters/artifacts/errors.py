"""The one exception artifact code raises: a machine code plus a sentence a person can act on."""

from __future__ import annotations

# The codes this package raises. Callers store the code on the failed revision and show the
# message; code outside this package (adapters.tasks) may raise its own codes too.
CODES = frozenset(
    {
        "pickle_forbidden",
        "missing_adapter_config",
        "bad_adapter_config",
        "no_tensors",
        "truncated_file",
        "bad_safetensors",
        "header_too_large",
        "bad_dtype",
        "unexpected_tensor",
        "shape_mismatch",
        "rank_mismatch",
        "rank_too_high",
        "unpaired_lora",
        "target_modules_mismatch",
        "non_finite",
        "too_many_tensors",
        "archive_path_traversal",
        "archive_absolute_path",
        "archive_link",
        "archive_special_file",
        "archive_too_many_files",
        "archive_too_large",
        "archive_compression_ratio",
        "archive_name_too_long",
        "archive_header_too_large",
        "archive_sparse_file",
        "bad_archive",
        "partial_experts",
    }
)


class ArtifactError(Exception):
    """An artifact that cannot be accepted: `code` is machine-readable, `message` says what to fix."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"ArtifactError({self.code!r}, {self.message!r})"

    def __reduce__(self):
        # Pickled with both arguments: it travels back from the sandboxed child process (mint_site/sandbox.py).
        return (type(self), (self.code, self.message))
