"""The rules of the names every layer checks, in one home (tenants cannot import adapters, so it is here).

An adapter's name: a lowercase letter or digit, then lowercase letters, digits, `.`, `_` and `-`; at most 64
characters. An alias's: a lowercase letter, then lowercase letters, digits, `_` and `-`; at most 32 (`production`,
`candidate`, `canary-2`). The gateway parses `<adapter>`, `<adapter>:<alias>` and `<adapter>@r<n>` with them.
"""

ADAPTER_NAME_CHARS = "a-z0-9._-"
ADAPTER_NAME_MAX = 64
ADAPTER_NAME_PATTERN = rf"[a-z0-9][{ADAPTER_NAME_CHARS}]{{0,{ADAPTER_NAME_MAX - 1}}}"
ALIAS_NAME_PATTERN = r"[a-z][a-z0-9_-]{0,31}"
