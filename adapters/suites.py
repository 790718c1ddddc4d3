"""Evaluation suites: parsing a tenant's JSONL of cases, and grading one answer against one case.

Django-free (the limits come in as arguments) so the runner, the API and the tests share one definition.

A case is one JSON object per line:

    {"prompt": "2+2=", "reference": "4", "grader": "exact", "max_tokens": 4}
    {"messages": [{"role": "user", "content": "Say hi"}], "reference": "hi", "grader": "contains"}
    {"prompt": "Date?", "reference": "^\\d{4}-\\d{2}-\\d{2}$", "grader": "regex"}
    {"prompt": "Rate it as JSON", "grader": "json_score", "field": "score", "reference": 0.5}

Graders (every score is in [0, 1]; a suite's score is the mean of its cases'):
- `exact`: the answer, stripped of surrounding whitespace, equals the reference (also stripped): 1 or 0.
- `contains`: the reference occurs in the answer: 1 or 0.
- `regex`: the reference is an RE2 pattern (linear-time: no backtracking, so no pattern can take the
  worker's time), searched in the answer: 1 or 0. Compiled at upload with a memory bound; a pattern RE2
  refuses (back-references, look-around, too large) is a 400 naming the line.
- `json_score`: the answer is a JSON object; `field` (dotted for nesting: `a.b`) names a number, clamped
  to [0, 1], which is the case's score; the case passes when that score is at least `reference` (a number
  in [0, 1], default 0.5). An answer that is no JSON object, or lacks the field, scores 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import re2

GRADERS = ("exact", "contains", "regex", "json_score")
CASE_FIELDS = {"prompt", "messages", "reference", "grader", "field", "max_tokens", "name"}
ROLES = {"system", "user", "assistant"}
JSON_SCORE_DEFAULT_PASS = 0.5


class SuiteError(Exception):
    """A suite refused at upload: `line` (1-based, 0 for the whole body) and the problem, for a 400."""

    def __init__(self, message: str, *, line: int = 0, code: str = "invalid_suite"):
        super().__init__(message)
        self.message = message
        self.line = line
        self.code = code


@dataclass(frozen=True)
class SuiteLimits:
    max_cases: int  # plan: Tenant.max_evaluation_cases
    max_tokens: int  # plan: Tenant.max_evaluation_tokens
    max_bytes: int  # MINT_EVALUATION_MAX_SUITE_BYTES
    max_line_bytes: int  # MINT_EVALUATION_MAX_LINE_BYTES
    max_pattern_bytes: int  # MINT_EVALUATION_MAX_PATTERN_BYTES
    regex_max_mem: int  # MINT_EVALUATION_REGEX_MAX_MEM


def _regex_options(max_mem: int) -> re2.Options:
    options = re2.Options()
    options.max_mem = max_mem
    options.log_errors = False
    return options


def compile_pattern(pattern: str, *, max_mem: int) -> re2._Regexp:
    """An RE2 regex (linear-time matching), or re2.error for a pattern it refuses."""
    return re2.compile(pattern, options=_regex_options(max_mem))


def _case(raw: Any, *, line: int, limits: SuiteLimits) -> dict[str, Any]:
    def bad(problem: str) -> SuiteError:
        return SuiteError(f"line {line}: {problem}", line=line)

    if not isinstance(raw, dict):
        raise bad(f"a case is a JSON object, not {type(raw).__name__}")
    unknown = sorted(set(raw) - CASE_FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; a case has {', '.join(sorted(CASE_FIELDS))}")
    grader = raw.get("grader")
    if grader not in GRADERS:
        raise bad(f"grader must be one of {', '.join(GRADERS)}, not {grader!r}")
    case: dict[str, Any] = {"grader": grader}
    if ("prompt" in raw) == ("messages" in raw):
        raise bad("give exactly one of prompt (a string) or messages (a list of {role, content})")
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str) or not raw["prompt"]:
            raise bad("prompt must be a non-empty string")
        case["prompt"] = raw["prompt"]
    else:
        messages = raw["messages"]
        if not isinstance(messages, list) or not messages or len(messages) > 64:
            raise bad("messages must be a list of 1 to 64 {role, content} objects")
        for i, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or set(message) != {"role", "content"}
                or message["role"] not in ROLES
                or not isinstance(message["content"], str)
            ):
                raise bad(f"messages[{i}] must be {{role: one of {', '.join(sorted(ROLES))}, content: a string}}")
        case["messages"] = messages
    reference = raw.get("reference")
    if grader == "json_score":
        field = raw.get("field")
        if not isinstance(field, str) or not field or len(field) > 200:
            raise bad("json_score needs field: the name (dotted for nesting) of a number in the answer's JSON")
        case["field"] = field
        if reference is None:
            reference = JSON_SCORE_DEFAULT_PASS
        if isinstance(reference, bool) or not isinstance(reference, (int, float)) or not 0 <= reference <= 1:
            raise bad("json_score's reference is the passing score, a number in [0, 1]")
        case["reference"] = float(reference)
    else:
        if "field" in raw:
            raise bad(f"field is for json_score only, not {grader}")
        if not isinstance(reference, str) or (grader != "exact" and not reference):
            raise bad(f"{grader} needs reference: a{' non-empty' if grader != 'exact' else ''} string")
        if grader == "regex":
            if len(reference.encode()) > limits.max_pattern_bytes:
                raise bad(
                    f"the pattern is {len(reference.encode())} bytes, over MINT_EVALUATION_MAX_PATTERN_BYTES="
                    f"{limits.max_pattern_bytes}"
                )
            try:
                compile_pattern(reference, max_mem=limits.regex_max_mem)
            except re2.error as exc:
                why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
                raise bad(f"RE2 refuses the pattern ({why}); RE2 has no back-references or look-around") from exc
        case["reference"] = reference
    if "max_tokens" in raw:
        max_tokens = raw["max_tokens"]
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise bad("max_tokens must be a positive integer")
        if max_tokens > limits.max_tokens:
            raise SuiteError(
                f"line {line}: max_tokens {max_tokens} is over this tenant's plan (max_evaluation_tokens="
                f"{limits.max_tokens})",
                line=line,
                code="evaluation_tokens_exceeded",
            )
        case["max_tokens"] = max_tokens
    if "name" in raw:
        if not isinstance(raw["name"], str) or len(raw["name"]) > 200:
            raise bad("name must be a string of at most 200 characters")
        case["name"] = raw["name"]
    return case


def parse_suite(body: bytes, *, limits: SuiteLimits) -> list[dict[str, Any]]:
    """The cases of a JSONL body, all checked, or SuiteError for the first bad line. Blank lines are skipped."""
    if len(body) > limits.max_bytes:
        raise SuiteError(
            f"the suite is {len(body)} bytes, over MINT_EVALUATION_MAX_SUITE_BYTES={limits.max_bytes}",
            code="suite_too_large",
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SuiteError(f"the suite is not UTF-8 (byte {exc.start})") from exc
    cases: list[dict[str, Any]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if len(line.encode()) > limits.max_line_bytes:
            raise SuiteError(
                f"line {number}: {len(line.encode())} bytes, over MINT_EVALUATION_MAX_LINE_BYTES="
                f"{limits.max_line_bytes}",
                line=number,
                code="suite_line_too_long",
            )
        if not line.strip():
            continue
        if len(cases) >= limits.max_cases:
            raise SuiteError(
                f"line {number}: more than {limits.max_cases} cases, this tenant's plan (max_evaluation_cases)",
                line=number,
                code="evaluation_cases_exceeded",
            )
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise SuiteError(f"line {number}: not JSON ({exc})", line=number) from exc
        except RecursionError:  # nested past Python's parser: no case is that deep
            raise SuiteError(f"line {number}: JSON nested too deeply", line=number) from None
        cases.append(_case(raw, line=number, limits=limits))
    if not cases:
        raise SuiteError("the suite has no cases: send one JSON object per line")
    return cases


def _field(document: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(document, dict) or part not in document:
            return None
        document = document[part]
    return document


def grade(case: dict[str, Any], answer: str, *, regex_max_mem: int) -> tuple[bool, float]:
    """(passed, score in [0, 1]) of one answer to one case (the module docstring has the rules)."""
    grader, reference = case["grader"], case["reference"]
    if grader == "exact":
        passed = answer.strip() == reference.strip()
    elif grader == "contains":
        passed = reference in answer
    elif grader == "regex":
        passed = compile_pattern(reference, max_mem=regex_max_mem).search(answer) is not None
    else:
        try:
            value = _field(json.loads(answer), case["field"])
        except (ValueError, RecursionError):  # no JSON, or nested past the parser: no score
            value = None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False, 0.0
        score = min(1.0, max(0.0, float(value)))
        return score >= reference, score
    return passed, 1.0 if passed else 0.0
